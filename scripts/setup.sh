#!/usr/bin/env bash
# Creates .venv and installs the orchestrator into it. Idempotent: a second run only checks.
#   bash scripts/setup.sh          # the package
#   bash scripts/setup.sh --dev    # plus the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
[[ "${1:-}" == "--dev" ]] && extra="[dev]"
python=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
# An unpinned torch pulls a multi-GB CUDA build; where none is installed yet, take the pinned
# CPU build first (on these machines it comes from local disk). A GPU machine keeps its own torch.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" -e ".${extra}"
echo "setup: ready ($(.venv/bin/python -c 'import torch, ray, mlflow; print(f"torch {torch.__version__}, ray {ray.__version__}, mlflow {mlflow.__version__}")'))"
