#!/usr/bin/env bash
# Install the Debian packages the test suite needs beyond pip: chromium, for the
# real-browser notebook tests (tests/test_browser*.py), and bubblewrap, the namespaces of
# isolated sandboxes (docs/isolation.md; tests/test_isolation*.py).
# Idempotent: does nothing when both are there. Never runs `playwright install`.
set -euo pipefail

packages=()
[ -x /usr/bin/chromium ] || packages+=(chromium)
command -v bwrap >/dev/null 2>&1 || packages+=(bubblewrap)
if [ "${#packages[@]}" -eq 0 ]; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install-system.sh: ${packages[*]} missing and we are not root (no sudo)" >&2
        exit 1
    fi
fi

# --no-install-recommends: the recommends (udev, upower, mesa, cups tools...) are not needed
# headless; fonts come in through fontconfig's dependency on fonts-dejavu-core.
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${packages[@]}" >/dev/null

if [ ! -x /usr/bin/chromium ] || ! command -v bwrap >/dev/null 2>&1; then
    echo "install-system.sh: apt-get finished but chromium or bwrap is still missing" >&2
    exit 1
fi
