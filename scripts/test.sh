#!/usr/bin/env bash
# The test command of the README and CI: sets up .venv, installs the system packages the
# integration tests use (SLURM, Chromium, PostgreSQL) where it can, then runs the whole suite.
#   bash scripts/test.sh [PYTEST ARGS]         # what CI runs; tests/test_zoo.py skips without .venv-zoo
#   bash scripts/test.sh --zoo [PYTEST ARGS]   # also makes .venv-zoo (timm, torchvision, transformers:
#                                              # ~6 GB, minutes), so tests/test_zoo.py runs too
#   ORCHESTRATOR_NO_SYSTEM_PACKAGES=1 bash scripts/test.sh ...   # installs no system packages; the
#                                              # tests that need them skip, naming this variable
#   bash scripts/test.sh -n 0 [PYTEST ARGS]    # in this one process, as plain pytest runs (for --pdb)
# The suite runs in two pytest-xdist processes, each taking a whole test module at a time (so a
# module's Ray or SLURM cluster starts once): most integration tests wait on what they start (Ray,
# a sweep's subprocesses, an outage they make), 60 % of two cores idle when they ran one at a
# time; two at once took pytest from 2,509-2,638 s to 1,841 s on a 2-core machine (CI's size).
# The two stay busy to the end: each one's tests summed to within 46 s of the other's (1,857 and
# 1,811 s of a 1,878 s run). Three at once took 1,756 s against 1,878-1,967 s for two on another
# 2-core machine, its cores 96 % busy and single tests up to 2.3x longer: not worth the timeouts
# that brings nearer on a loaded CI machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
if [[ "${1:-}" == "--zoo" ]]; then
  shift
  bash scripts/setup.sh --zoo
fi
if [[ "${ORCHESTRATOR_NO_SYSTEM_PACKAGES:-}" == 1 ]]; then
  echo "test.sh: ORCHESTRATOR_NO_SYSTEM_PACKAGES=1: installing no system packages; the SLURM, browser and PostgreSQL tests skip"
else
  cat <<'NOTICE'
test.sh: the integration tests use system packages; as root, the installers add the missing ones with apt-get:
  slurm-wlm munge            scripts/install_slurm.sh    tests/test_slurm.py runs sweeps on a local SLURM cluster
  chromium chromium-driver   scripts/install_browser.sh  tests/test_dashboard_browser.py opens the Ray dashboard
  postgresql                 scripts/install_postgres.sh tests/test_tracking.py runs an MLflow server on PostgreSQL
  To install none (those tests then skip): ORCHESTRATOR_NO_SYSTEM_PACKAGES=1 bash scripts/test.sh ...
NOTICE
  for installer in scripts/install_slurm.sh scripts/install_browser.sh scripts/install_postgres.sh; do
    [[ -f "$installer" ]] && bash "$installer"
  done
fi
export MLFLOW_DISABLE_TELEMETRY=true RAY_USAGE_STATS_ENABLED=0
# The layers of pyproject.toml [tool.importlinter]: an import against them fails before any test runs.
.venv/bin/lint-imports --no-cache
# The one-command GPU proof (bench/gpu_acceptance.py) cannot run here, but its list must not rot:
# every measurement's command, imports and sweep overrides are checked without a GPU.
.venv/bin/python bench/gpu_acceptance.py --dry-run > /dev/null
exec .venv/bin/python -m pytest -n 2 --dist loadscope "$@"
