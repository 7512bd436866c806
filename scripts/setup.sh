#!/usr/bin/env bash
# Set up rlsup in ./.venv on a fresh machine. Two sizes, one script (one place for the torch-first rule):
#   bash scripts/setup.sh --core  what `rlsup run` and `rlsup demo` need: CPU torch, then rlsup (editable) with its
#                                 core dependencies only (pyproject's [project] dependencies); no extras, no apt.
#                                 The README's first command.
#   bash scripts/setup.sh         everything the tests need: as root the system tools (scripts/install_system_deps.sh),
#                                 then the test, megatron, nvrx and trainers extras and verl. Run on a --core venv it
#                                 adds what is missing. The README's second command, and CI's (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  --core) MODE=core ;;
  "") MODE=full ;;
  *) echo "setup: unknown argument '$1' (usage: bash scripts/setup.sh [--core])" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
if [ "$MODE" = full ]; then
  # System tools the deploy tests use (promtool/Prometheus, SLURM+munge, systemd-analyze, fuse3); root + apt only.
  bash scripts/install_system_deps.sh
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip -q --disable-pip-version-check)
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
# pip's own errors and warnings are shown; the build backend's chatter (setuptools' notices about
# editable installs) and this mirror's "Location ... ignored" lines are not. A failed install
# prints its whole log and stops the set-up.
pip_install() {
  if ! "${PIP[@]}" install "$@" >"$LOG" 2>&1; then
    grep -v "^WARNING: Location" "$LOG" >&2
    echo "setup: pip install $* failed" >&2
    exit 1
  fi
  pip_notes <"$LOG"
}
# pip's ERROR/WARNING lines, each with the lines that belong to it (the resolver's "following dependency
# conflicts" are listed below its ERROR line: never a bare ERROR). Conflicts that are only verl's own
# pins (installed --no-deps on purpose, below) are one line saying so, not an error.
pip_notes() {
  awk '/^WARNING: Location/ { next }
       /^(ERROR|WARNING)/ { flush(); head = $0; n = 0; next }
       head != "" && /^[^ ]+ [^ ]+ (requires|has requirement) / { body[++n] = $0; ours = ours && $1 == "verl"; next }
       { flush() }
       function flush(   i) {
         if (head == "") return
         if (n > 0 && ours && head ~ /dependency resolver/)
           print "setup: pip notes verl 0.9.1'"'"'s own pins are unmet: harmless, verl is installed --no-deps for tests/thirdparty/test_recipe_verl_e2e.py only"
         else { print head; for (i = 1; i <= n; i++) print body[i] }
         head = ""; n = 0; ours = 1
       }
       BEGIN { ours = 1 }
       END { flush() }'
}
pip_install --upgrade pip
# CPU torch first, pinned, on its own (this machine's index serves the CPU build), so that no multi-GB CUDA build
# is downloaded to satisfy rlsup's torch>=2.4. Elsewhere install torch 2.13.0 from PyTorch's CPU (or your CUDA)
# index first: pip keeps an installed 2.13.0 (+cpu, +cu128 ...).
pip_install torch==2.13.0
if [ "$MODE" = core ]; then
  pip_install -e .
  .venv/bin/python -c "import torch, rlsup_format, supervisor, trainer_hooks; print('rlsup ready (core): torch', torch.__version__)"
  exit 0
fi
pip_install -e ".[test,megatron,nvrx,trainers]"
# verl 0.9.1 for tests/thirdparty/test_recipe_verl_e2e.py: --no-deps (its own deps pull vLLM/CUDA builds); only what
# importing verl.utils.checkpoint.fsdp_checkpoint_manager needs (verl/__init__ imports ray and tensordict).
# Its dependencies first, verl last: pip checks an install's dependents only when it resolves dependencies,
# so installing them after verl would list every pin of verl's this set-up leaves unmet.
pip_install ray==2.60.0 omegaconf==2.4.0 codetiming==1.4.0 orjson==3.13.0 pillow==13.0.0 pyvers==0.2.3 cloudpickle==3.1.2 && pip_install --no-deps verl==0.9.1 tensordict==0.15.3 peft==0.21.2
.venv/bin/python -c "import torch, rlsup_format, supervisor, trainer_hooks; print('rlsup ready: torch', torch.__version__)"
