#!/usr/bin/env bash
# Install Debian's chromium for the real-browser notebook test (tests/test_browser.py).
# Idempotent: does nothing when /usr/bin/chromium already exists. Never runs `playwright install`.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install-browser.sh: /usr/bin/chromium is missing and we are not root (no sudo)" >&2
        exit 1
    fi
fi

# --no-install-recommends: the recommends (udev, upower, mesa, cups tools...) are not needed
# headless; fonts come in through fontconfig's dependency on fonts-dejavu-core.
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    chromium >/dev/null

if [ ! -x /usr/bin/chromium ]; then
    echo "install-browser.sh: apt-get finished but /usr/bin/chromium is still missing" >&2
    exit 1
fi
