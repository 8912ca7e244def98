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

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null

if [ ! -x /usr/bin/chromium ]; then
    echo "install-browser.sh: apt-get finished but /usr/bin/chromium is still missing" >&2
    exit 1
fi
