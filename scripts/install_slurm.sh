#!/usr/bin/env bash
# Install SLURM (slurm-wlm) and munge from Debian's packages, for tests/test_slurm.py, which
# starts its own single-node cluster (scripts/apt_install.sh: when it does nothing, and why).
set -u
source "$(dirname "$0")/apt_install.sh"
apt_install install_slurm "the SLURM test" 'have sbatch slurmctld slurmd munged' slurm-wlm munge
