"""rlhf_megatron: RL training of LLMs on megatron-core with vLLM rollout and Ray."""

__version__ = "0.1.0"
