"""The PPO/GRPO trainer: driver loop, metrics, validation, checkpoints, loggers.

``run_training(cfg)`` is the entry point ``rlhf-megatron train`` calls.
"""

from rlhf_megatron.trainer.run import run_training

__all__ = ["run_training"]
