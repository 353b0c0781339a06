#!/usr/bin/env bash
# Installs what the dashboard browser test needs: Debian's chromium and chromium-driver.
#
# Idempotent: does nothing when both are already there. It never fails the caller: when it
# cannot install (not root, no apt-get), it says why and exits 0, and the browser test then
# skips with its own reason. Selenium itself comes with the project's dev extra
# (pip install -e '.[dev]').
set -u

CHROMIUM=/usr/bin/chromium
CHROMEDRIVER=/usr/bin/chromedriver

if [ -x "$CHROMIUM" ] && [ -x "$CHROMEDRIVER" ]; then
    echo "install_browser: $CHROMIUM and $CHROMEDRIVER are already installed"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install_browser: skipped: not root, cannot apt-get install chromium chromium-driver (ask an admin, or run as root)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: skipped: no apt-get on this system; install Chromium and a matching chromedriver by hand"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y --no-install-recommends chromium chromium-driver; then
    # A fresh container has no package lists yet.
    apt-get update && apt-get install -y --no-install-recommends chromium chromium-driver || {
        echo "install_browser: skipped: apt-get could not install chromium chromium-driver (see the output above)"
        exit 0
    }
fi
echo "install_browser: installed $("$CHROMIUM" --version 2>/dev/null) and $("$CHROMEDRIVER" --version 2>/dev/null | head -1)"
