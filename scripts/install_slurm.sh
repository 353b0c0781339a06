#!/usr/bin/env bash
# Install SLURM (slurm-wlm) and munge from the distribution's packages, for the SLURM
# integration test (tests/test_slurm.py), which starts its own single-node cluster.
#
# Idempotent and never fatal: when the tools are already there, when we are not root, or
# when apt-get is missing, it says why it did nothing and exits 0, and the test then skips
# with the exact reason. Only the packages are installed; no daemon is started or enabled.
set -u

needed=(sbatch slurmctld slurmd munged)
missing=()
for tool in "${needed[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || missing+=("$tool")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "install_slurm: slurm-wlm and munge already installed"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install_slurm: not root, not installing (missing: ${missing[*]}); the SLURM test will skip"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_slurm: no apt-get on this machine (missing: ${missing[*]}); the SLURM test will skip"
    exit 0
fi

echo "install_slurm: installing slurm-wlm and munge (missing: ${missing[*]})"
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y --no-install-recommends slurm-wlm munge >/tmp/install_slurm.$$.log 2>&1; then
    # A stale package index is the usual cause; refresh it once and retry.
    apt-get update >>/tmp/install_slurm.$$.log 2>&1
    if ! apt-get install -y --no-install-recommends slurm-wlm munge >>/tmp/install_slurm.$$.log 2>&1; then
        echo "install_slurm: apt-get install failed (log: /tmp/install_slurm.$$.log); the SLURM test will skip"
        exit 0
    fi
fi
rm -f /tmp/install_slurm.$$.log
echo "install_slurm: installed $(dpkg-query -W -f='slurm-wlm ${Version}' slurm-wlm 2>/dev/null)"
