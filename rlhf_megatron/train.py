"""``python -m rlhf_megatron.train [--config FILE] [key=value ...]`` (also ``rlhf-megatron train``).

Role: the training entry point. It loads the config (schema defaults <- preset <- dotted
overrides), validates it before any process starts, prints the resolved config, saves it
atomically as ``<trainer.default_local_dir>/resolved_config.yaml`` and hands it to
``rlhf_megatron.trainer.run_training``. ``--dry-run`` stops after validation and printing
and writes nothing.

Boundaries: no training logic; the trainer package is imported only when training starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import NoReturn

from omegaconf import DictConfig, OmegaConf

from rlhf_megatron.config import ConfigError, save_resolved_config
from rlhf_megatron.planning import load_config

__all__ = [
    "TrainerUnavailableError",
    "build_parser",
    "exit_process",
    "load_and_print",
    "main",
    "start_training",
]


class TrainerUnavailableError(RuntimeError):
    """``rlhf_megatron.trainer.run_training`` cannot be imported, so training cannot start."""


def build_parser(prog: str = "python -m rlhf_megatron.train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train with PPO/GRPO. Config = schema defaults <- --config preset <- key=value overrides.",
    )
    parser.add_argument(
        "-c",
        "--config",
        "--config-name",
        dest="config",
        default=None,
        help="preset YAML (a path, or a name under configs/, e.g. quickstart_cpu)",
    )
    parser.add_argument(
        "--dry-run",
        "--validate-only",
        dest="dry_run",
        action="store_true",
        help="validate and print the resolved config, then exit without saving or training",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="number of processes, when it differs from trainer.nnodes x trainer.n_gpus_per_node",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="verl-style overrides: a.b=c, +a.b=c, trainer.logger=['console'], x=${data.max_response_length}",
    )
    return parser


def start_training(cfg: DictConfig) -> None:
    """Import the trainer and run it; ``TrainerUnavailableError`` if it cannot be imported."""
    run_training: Callable[[DictConfig], object]
    try:
        from rlhf_megatron.trainer import run_training
    except ImportError as exc:
        raise TrainerUnavailableError(
            f"cannot start training: rlhf_megatron.trainer.run_training is not available ({exc}). "
            "The config is valid; `--dry-run` checks a config without training."
        ) from exc
    run_training(cfg)


def load_and_print(load: Callable[[], DictConfig]) -> DictConfig | None:
    """Run ``load``; print its warnings to stderr and the resolved config to stdout, or its
    ``ConfigError`` to stderr and return None."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = load()
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return None
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    print(OmegaConf.to_yaml(cfg), end="")
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    from rlhf_megatron.platform import quiet_cpu_fallback_warnings

    quiet_cpu_fallback_warnings()
    args = build_parser().parse_intermixed_args(argv)
    cfg = load_and_print(lambda: load_config(args.config, args.overrides, world_size=args.world_size))
    if cfg is None:
        return 2
    if args.dry_run:
        print("dry run: the config is valid; training not started", file=sys.stderr)
        return 0
    path = save_resolved_config(cfg)
    print(f"resolved config saved to {path}", file=sys.stderr)
    start_training(cfg)
    return 0


def exit_process(status: int) -> NoReturn:
    """End the ``rlhf-megatron train`` process: flush, then leave without the interpreter's teardown.

    After a run, freeing the torch, vLLM and megatron-core modules and their objects costs ~1.6 s
    of CPU and does nothing the run needs: by then the trainer has closed its loggers, reward
    pools and worker groups and left Ray. Only for a process that ``main`` ran in; a run that
    raised never gets here (Python prints the traceback and exits as usual)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_process(main())
