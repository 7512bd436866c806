#!/usr/bin/env bash
# Set up rlsup in ./.venv on a fresh machine: CPU torch first (so no multi-GB CUDA build is
# downloaded), then the package in editable mode with the test, megatron and nvrx extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# System tools the deploy tests use (promtool/Prometheus, SLURM+munge, systemd-analyze); root + apt only.
bash scripts/install_system_deps.sh
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip -q --disable-pip-version-check)
"${PIP[@]}" install --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
"${PIP[@]}" install torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
"${PIP[@]}" install -e ".[test,megatron,nvrx]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, supervisor, trainer_hooks; print('rlsup ready: torch', torch.__version__)"
