"""``rlhf-megatron``: the command-line front door.

Role: dispatches ``rlhf-megatron <subcommand> [args]`` to the module that implements the
subcommand. ``SUBCOMMANDS`` maps a name to ``"package.module:function"``; the module is
imported only when its subcommand runs, so a command's heavy imports (torch, Ray, vLLM)
never slow down another, and a subcommand whose package is missing fails alone.

Adding a subcommand (e.g. ``convert`` or ``launch``): write ``def main(argv: list[str]) -> int``
in your module (parse ``argv`` with argparse, return the exit status) and add one line to
``SUBCOMMANDS``::

    "convert": Subcommand("rlhf_megatron.convert:main", "HF <-> Megatron checkpoints"),

or call ``register_subcommand`` from code that runs before ``main``.

Boundaries: no logic of its own beyond ``plan`` (a thin wrapper over ``planning.memory``).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["SUBCOMMANDS", "Subcommand", "main", "plan_main", "register_subcommand", "report_warnings"]


@dataclass(frozen=True)
class Subcommand:
    """Where a subcommand lives: ``target`` is ``"module:function"``, the function takes the
    arguments after the subcommand name and returns an exit status."""

    target: str
    help: str

    def load(self) -> Callable[[list[str]], int]:
        module, _, function = self.target.partition(":")
        return getattr(importlib.import_module(module), function)


SUBCOMMANDS: dict[str, Subcommand] = {
    "train": Subcommand("rlhf_megatron.train:main", "load and validate a config, save it, and train"),
    "sft": Subcommand(
        "rlhf_megatron.sft:main", "supervised fine-tuning on the Megatron engine (verl's SFT keys)"
    ),
    "rm": Subcommand("rlhf_megatron.rm:main", "reward-model training on preference pairs (Bradley-Terry)"),
    "plan": Subcommand(
        "rlhf_megatron.cli:plan_main", "estimate per-GPU memory of a config; exit 1 if it does not fit"
    ),
    "launch": Subcommand(
        "rlhf_megatron.launch:main", "start Ray and the driver on Slurm, Kubernetes or this machine"
    ),
    "convert": Subcommand(
        "rlhf_megatron.convert:main",
        "HF <-> megatron-core checkpoints, LoRA exports (hf-to-mcore, mcore-to-hf, lora-to-peft, lora-to-hf)",
    ),
}


def register_subcommand(name: str, target: str, help: str) -> None:
    """Add a subcommand; a name that is already taken by another target is an error."""
    existing = SUBCOMMANDS.get(name)
    if existing is not None and existing.target != target:
        raise ValueError(f"subcommand {name!r} is already registered to {existing.target}")
    SUBCOMMANDS[name] = Subcommand(target, help)


def report_warnings(caught: Sequence[warnings.WarningMessage]) -> None:
    """Print warnings recorded while loading a config as plain ``warning:`` lines."""
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = ["usage: rlhf-megatron <subcommand> [args]", "", "subcommands:"]
    lines += [f"  {name:<{width}}  {cmd.help}" for name, cmd in SUBCOMMANDS.items()]
    lines += ["", "`rlhf-megatron <subcommand> --help` shows a subcommand's arguments."]
    return "\n".join(lines)


def plan_main(argv: list[str]) -> int:
    """``rlhf-megatron plan CONFIG [key=value ...] [--auto]``: print the memory plan of a config
    (with ``--auto`` or ``auto`` layout keys, first the ranking of the layouts that fit)."""
    from rlhf_megatron.config import ConfigError
    from rlhf_megatron.planning import load_config
    from rlhf_megatron.planning.auto_layout import format_search
    from rlhf_megatron.planning.memory import format_plan, plan_memory

    parser = argparse.ArgumentParser(prog="rlhf-megatron plan", description=plan_main.__doc__)
    parser.add_argument("config", help="preset file (path, or name under configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.nnodes=2")
    parser.add_argument("--gpu-memory-gb", type=float, default=None, help="override trainer.gpu_memory_gb")
    parser.add_argument("--world-size", type=int, default=None, help="override nnodes x n_gpus_per_node")
    parser.add_argument(
        "--auto",
        action="store_true",
        help="parallelism=auto: rank every layout that fits (predicted step time, peak memory), then plan the chosen one",
    )
    args = parser.parse_intermixed_args(argv)
    overrides = [*args.overrides, *(["parallelism=auto"] if args.auto else [])]
    if args.gpu_memory_gb is not None:  # the search must see the memory the plan is made for
        overrides.append(f"trainer.gpu_memory_gb={args.gpu_memory_gb}")
    searches = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = load_config(args.config, overrides, world_size=args.world_size, on_search=searches.append)
            plan = plan_memory(cfg, gpu_memory_gb=args.gpu_memory_gb, world_size=args.world_size)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    report_warnings(caught)
    if searches:
        print(format_search(searches[0], limit=None if args.auto else 2) + "\n")
    print(format_plan(plan, title=" ".join([args.config, *args.overrides])))
    return 0 if plan.fits else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point: ``rlhf-megatron <subcommand> [args]``."""
    from rlhf_megatron.platform import quiet_cpu_fallback_warnings

    quiet_cpu_fallback_warnings()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    command = SUBCOMMANDS.get(name)
    if command is None:
        close = difflib.get_close_matches(name, list(SUBCOMMANDS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"rlhf-megatron: unknown subcommand {name!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    status = command.load()(rest)
    if argv is None and name == "train":  # the process is this command's: leave as `python -m` does
        from rlhf_megatron.train import exit_process

        exit_process(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
