#!/usr/bin/env bash
# Sets up .venv (idempotent) and runs the linter, the formatter's check and the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
# The suite runs on RLHF_TEST_WORKERS pytest-xdist workers (default 2, this machine's cores; 0 runs
# it in this process) and ends with the 25 slowest tests and setups and the time by kind.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# Debian's slurm-wlm + munge for the real-Slurm launcher tests (skips quietly where apt can't run).
bash scripts/install_slurm.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline} TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check rlhf_megatron tests tools launchers scripts
.venv/bin/ruff format --check rlhf_megatron tests tools launchers scripts
set +e
WORKERS=${RLHF_TEST_WORKERS:-2}
# Whole files to whichever worker is free, longest first (tests/durations.json; tests/conftest.py).
if [ "$WORKERS" -gt 0 ]; then PARALLEL=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder); else PARALLEL=(-p no:xdist); fi
.venv/bin/python -m pytest "${PARALLEL[@]}" --durations=25 "$@"
rc=$?
set -e
# pytest exits 5 when nothing was collected: that is a failure here, not a pass.
if [ "$rc" -eq 5 ]; then echo "no tests ran" >&2; exit 1; fi
exit "$rc"
