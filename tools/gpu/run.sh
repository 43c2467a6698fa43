#!/usr/bin/env bash
# The GPU measurement (issue #20) in one go, on a machine with one CUDA GPU and PyTorch but no
# megatron-core (and no network): installs the carried wheels, then runs tools/gpu/measure.py,
# which runs the gpu-marked tests and writes ONE JSON file.
#
#   bash tools/gpu/run.sh wheels              # here, with network: fetch the wheels into .whl/
#   bash tools/gpu/run.sh OUT.json [ARGS...]  # there, from the repository root (ARGS go to measure.py)
#   bash tools/gpu/run.sh --mfu OUT.json [ARGS...]  # there: tools/gpu/mfu.py instead (issue #38)
#
# The wheels (~3.7 MB): megatron-core 0.16.1 (cp312), omegaconf 2.3.1, antlr4-python3-runtime
# 4.9.3 (built here from its sdist, pure Python), tensordict 0.15.3 and pyvers 0.2.3 (the Batch).
# Everything else the engine imports (torch, transformers, safetensors, pyarrow, numpy, pyyaml,
# pytest) was already on the GPU image.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=.whl
PY=${PYTHON:-python3}

if [[ "${1:-}" == "wheels" ]]; then
    mkdir -p "$WHEELS"
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$WHEELS" \
        megatron-core==0.16.1 omegaconf==2.3.1 tensordict==0.15.3 pyvers==0.2.3
    "$PY" -m pip wheel --no-deps -w "$WHEELS" antlr4-python3-runtime==4.9.3
    ls -la "$WHEELS"
    exit 0
fi

SCRIPT=tools/gpu/measure.py
if [[ "${1:-}" == "--mfu" ]]; then
    SCRIPT=tools/gpu/mfu.py
    shift
fi
OUT_JSON=${1:?usage: bash tools/gpu/run.sh [--mfu] OUT.json [script args] | bash tools/gpu/run.sh wheels}
shift
SITE=$(mktemp -d /tmp/gpu_site.XXXXXX)
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi || true
exec "$PY" "$SCRIPT" --out "$OUT_JSON" "$@"
