"""``python -m rlhf_megatron.sft [--config FILE] [key=value ...]`` (also ``rlhf-megatron sft``): see ``rlhf_megatron.stages``."""

from __future__ import annotations

from collections.abc import Sequence

from rlhf_megatron.stages import stage_main

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("sft", argv)


if __name__ == "__main__":
    from rlhf_megatron.train import exit_process

    exit_process(main())
