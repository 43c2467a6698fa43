"""The stages before RL on the Megatron engine: supervised fine-tuning and reward-model training.

``python -m rlhf_megatron.sft`` / ``python -m rlhf_megatron.rm`` (``rlhf-megatron sft`` / ``rm``)
load a stage config (``config.schema_stages``), and ``driver.run_stage`` trains it with
``worker.StageWorker``; ``data`` reads and batches the rows.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["stage_main"]


def stage_main(kind: str, argv: Sequence[str] | None = None) -> int:
    """The command line of stage ``kind`` (``sft`` or ``rm``): ``[--config FILE] [--dry-run] key=value ...``."""
    from rlhf_megatron.config.loader import load_stage_config
    from rlhf_megatron.config.schema_stages import RMConfig, SFTConfig
    from rlhf_megatron.platform import quiet_cpu_fallback_warnings
    from rlhf_megatron.train import load_and_print

    quiet_cpu_fallback_warnings()
    what = {
        "sft": "supervised fine-tuning",
        "rm": "reward-model training (Bradley-Terry on preference pairs)",
    }
    parser = argparse.ArgumentParser(
        prog=f"python -m rlhf_megatron.{kind}",
        description=f"{what[kind]} on the Megatron engine. Config = schema defaults <- --config <- key=value.",
    )
    parser.add_argument("-c", "--config", default=None, help="preset YAML (a path, or a name under configs/)")
    parser.add_argument(
        "--dry-run", action="store_true", help="validate and print the resolved config, then exit"
    )
    parser.add_argument(
        "overrides", nargs="*", help="verl-style overrides: data.train_files=..., optim.lr=1e-5"
    )
    args = parser.parse_intermixed_args(argv)
    schema = SFTConfig if kind == "sft" else RMConfig
    cfg = load_and_print(lambda: load_stage_config(schema, args.config, args.overrides))
    if cfg is None:
        return 2
    if args.dry_run:
        print("dry run: the config is valid; training not started", file=sys.stderr)
        return 0
    from rlhf_megatron.stages.driver import run_stage

    run_stage(kind, cfg)
    return 0
