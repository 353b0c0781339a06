#!/usr/bin/env bash
# Creates a venv and installs the orchestrator into it. Idempotent: a second run only checks.
#   bash scripts/setup.sh          # .venv: the package
#   bash scripts/setup.sh --dev    # .venv: plus the test tools
#   bash scripts/setup.sh --zoo    # .venv-zoo: the package, the test tools and the model zoo's
#                                  # libraries (timm, transformers, torchvision), for the zoo tests
# The zoo has its own venv because torchvision needs a torch it was built against, which is not
# the CPU build .venv takes (a CUDA build of ~6 GB that also runs on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=.venv extra="" torch_pins=("torch==2.13.0")
case "${1:-}" in
  "") ;;
  --dev) extra="[dev]" ;;
  --zoo)
    venv=.venv-zoo extra="[zoo,dev]"
    case "$(uname -m)" in
      x86_64) torch_pins=("torch==2.14.1" "torchvision==0.29.1") ;;
      aarch64 | arm64) torch_pins=("torch==2.9.1" "torchvision==0.24.1") ;;
      *) echo "setup: no torch/torchvision pair known for $(uname -m)" >&2; exit 2 ;;
    esac ;;
  *) echo "setup: unknown option ${1}: expected --dev or --zoo" >&2; exit 2 ;;
esac
[[ -x $venv/bin/python ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
# An unpinned torch pulls a multi-GB CUDA build; where none is installed yet, take the pinned
# build first (on these machines it comes from local disk). A GPU machine keeps its own torch.
modules=torch
[[ $venv == .venv-zoo ]] && modules=torch,torchvision
if ! "$venv/bin/python" -c "import $modules" 2>/dev/null; then
  "${pip[@]}" "${torch_pins[@]}"
fi
# The package is editable: code changes need no reinstall, only a changed pyproject.toml does.
stamp="$venv/.orchestrator-installed"
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1) ${extra}"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]]; then
  "${pip[@]}" -e ".${extra}"
  echo "$wanted" > "$stamp"
fi
echo "setup: $venv ready ($("$venv/bin/python" -c 'import torch, ray, mlflow; print(f"torch {torch.__version__}, ray {ray.__version__}, mlflow {mlflow.__version__}")'))"
