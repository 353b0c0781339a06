#!/usr/bin/env bash
# The test command of the README and CI: sets up, installs the system packages the integration
# tests use (SLURM, Chromium) where it can, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
for installer in scripts/install_slurm.sh scripts/install_browser.sh; do
  [[ -f "$installer" ]] && bash "$installer"
done
export MLFLOW_DISABLE_TELEMETRY=true RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/python -m pytest "$@"
