#!/usr/bin/env bash
# Sets up .venv (idempotent) and runs the main job on this CPU machine.
#
# The end-to-end trainer (issue #9) is not in the tree yet; until it lands, the
# main job is the megatron-core smoke run: a tiny GPT trained at TP=2 over two
# gloo processes through the real megatron-core stack.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
exec .venv/bin/python tools/smoke_megatron_cpu.py "$@"
