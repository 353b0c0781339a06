#!/usr/bin/env bash
# Install Debian's chromium and chromium-driver, for tests/test_dashboard_browser.py, which opens
# the Ray dashboard (scripts/apt_install.sh: when it does nothing, and why). Selenium itself comes
# with the project's dev extra (pip install -e '.[dev]').
set -u
source "$(dirname "$0")/apt_install.sh"
apt_install install_browser "the browser test" 'have chromium chromedriver' chromium chromium-driver
