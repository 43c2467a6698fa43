"""What every launcher shares: argument checks, the run config, the driver command, the env.

Role: a launcher turns (config file, overrides, cluster shape) into processes somewhere.
This module does the parts that don't depend on where. It loads and validates the run
config *with the launcher's shape applied*, so a bad config fails on the login node
instead of after an hour in the queue. It builds the driver command line and picks the
environment variables that travel to the job.

The cluster shape: ``--nodes N --gpus-per-node G`` become ``trainer.nnodes=N
trainer.n_gpus_per_node=G`` on the driver's command line. ``G = 0`` means CPU mode: the
driver gets ``trainer.device=cpu`` and keeps the config's ``trainer.n_gpus_per_node``,
which in CPU mode counts processes per node.

Boundaries: no scheduler knowledge, and nothing here starts a process.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from rlhf_megatron.config import ConfigError
from rlhf_megatron.config.presets import find_preset
from rlhf_megatron.planning import load_config

__all__ = [
    "ClusterShape",
    "LaunchError",
    "RunSpec",
    "add_common_args",
    "auto_resume_overrides",
    "is_auto_resume",
    "check_env_assignments",
    "driver_env",
    "load_run",
    "parse_launch_args",
    "passthrough_env",
]

# Environment that a multi-node job needs on every node: NCCL/gloo tuning, wandb, the
# Hugging Face caches, vLLM switches. Matched by prefix or exact name.
PASSTHROUGH_PREFIXES = ("NCCL_", "TORCH_NCCL_", "WANDB_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "VLLM_")
PASSTHROUGH_NAMES = ("GLOO_SOCKET_IFNAME", "TOKENIZERS_PARALLELISM", "CUDA_DEVICE_MAX_CONNECTIONS")
# Values of these are never written into a generated file; they travel only through the
# scheduler's environment export.
_SECRET_PARTS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class LaunchError(ValueError):
    """A bad launcher argument. The message names the argument and says what to change."""


@dataclass(frozen=True)
class ClusterShape:
    """How many machines and accelerators the job gets."""

    nodes: int
    """Machines, each running one Ray node; the first also runs the Ray head and the driver."""

    gpus_per_node: int
    """GPUs per machine; 0 runs in CPU mode."""

    @property
    def cpu_mode(self) -> bool:
        return self.gpus_per_node == 0

    def trainer_overrides(self) -> list[str]:
        """The overrides that tell the trainer this shape (appended after the user's)."""
        if self.cpu_mode:
            return [f"trainer.nnodes={self.nodes}", "trainer.device=cpu"]
        return [f"trainer.nnodes={self.nodes}", f"trainer.n_gpus_per_node={self.gpus_per_node}"]


@dataclass(frozen=True)
class RunSpec:
    """A run the launcher has checked: the config as given plus the resolved result."""

    config_file: str
    """The ``--config`` argument exactly as given; the driver resolves it again where it runs."""

    overrides: tuple[str, ...]
    """The user's dotted overrides, in order."""

    shape: ClusterShape
    cfg: DictConfig
    """The resolved, validated config with the shape applied."""

    @property
    def train_overrides(self) -> list[str]:
        return [*self.overrides, *self.shape.trainer_overrides()]

    def train_command(self) -> list[str]:
        """``rlhf-megatron train --config FILE overrides... trainer.nnodes=N ...``"""
        return ["rlhf-megatron", "train", "--config", self.config_file, *self.train_overrides]

    @property
    def run_dir(self) -> Path:
        """``trainer.default_local_dir``, absolute (relative paths are taken from the cwd)."""
        return Path(self.cfg.trainer.default_local_dir).expanduser().absolute()

    @property
    def job_name(self) -> str:
        return str(self.cfg.trainer.experiment_name)


def parse_launch_args(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[argparse.Namespace, list[str]]:
    """Parse ``[args..., "--", overrides...]``. Without ``--``, bare ``key=value`` words
    among the args count as overrides too (verl's habit); any other stray word is an error."""
    argv = list(argv)
    overrides: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1 :]
    args, extras = parser.parse_known_args(argv)
    stray = [w for w in extras if w.startswith("-") or "=" not in w]
    if stray:
        parser.error(
            f"unrecognized arguments: {' '.join(stray)} (config overrides look like key=value, "
            "e.g. trainer.total_epochs=3; put them after `--`)"
        )
    return args, [*extras, *overrides]


def add_common_args(parser: argparse.ArgumentParser, *, multi_node: bool) -> None:
    """The arguments every launcher takes: ``--config``, the shape, ``--driver-cmd``."""
    parser.add_argument(
        "--config", required=True, help="run config: a YAML file or a preset name in configs/"
    )
    if multi_node:
        parser.add_argument(
            "--nodes",
            type=int,
            default=None,
            help="machines in the job (default: the config's trainer.nnodes)",
        )
        parser.add_argument(
            "--gpus-per-node",
            type=int,
            default=None,
            help="GPUs per machine; 0 runs in CPU mode "
            "(default: the config's trainer.n_gpus_per_node, or 0 when trainer.device=cpu)",
        )
    parser.add_argument(
        "--driver-cmd",
        default=None,
        help="shell command to run instead of `rlhf-megatron train ...` (it finds the cluster "
        "through RAY_ADDRESS), e.g. 'python -m rlhf_megatron.launch.probe --nodes 2'",
    )


def _check_config_file(config_file: str) -> None:
    try:
        find_preset(config_file)
    except ConfigError as exc:
        raise LaunchError(f"--config: {exc.errors[0]}; pass an existing YAML file or a preset name") from None


def default_shape(cfg: DictConfig) -> ClusterShape:
    """The shape a config asks for by itself."""
    gpus = 0 if cfg.trainer.device == "cpu" else int(cfg.trainer.n_gpus_per_node)
    return ClusterShape(nodes=int(cfg.trainer.nnodes), gpus_per_node=gpus)


def check_shape(nodes: int | None, gpus_per_node: int | None) -> None:
    """Reject impossible shapes before loading anything."""
    if nodes is not None and nodes < 1:
        raise LaunchError(f"--nodes must be at least 1 (got {nodes}); pass --nodes 1 for a single machine")
    if gpus_per_node is not None and gpus_per_node < 0:
        raise LaunchError(
            f"--gpus-per-node must be 0 or more (got {gpus_per_node}); pass --gpus-per-node 0 for CPU mode"
        )


def load_run(
    config_file: str,
    overrides: Sequence[str],
    nodes: int | None = None,
    gpus_per_node: int | None = None,
) -> RunSpec:
    """Check the arguments, then load and validate the config with the shape applied.

    ``nodes``/``gpus_per_node`` left as None come from the config. Raises ``LaunchError``
    for a bad argument and ``ConfigError`` (every problem at once) for a bad config.
    """
    check_shape(nodes, gpus_per_node)
    _check_config_file(config_file)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        base = load_config(config_file, overrides, validate=False)
        fallback = default_shape(base)
        shape = ClusterShape(
            nodes=fallback.nodes if nodes is None else nodes,
            gpus_per_node=fallback.gpus_per_node if gpus_per_node is None else gpus_per_node,
        )
        cfg = load_config(config_file, [*overrides, *shape.trainer_overrides()])
    # Once each, as plain lines (both loads warn about the same ignored keys).
    for message in dict.fromkeys(str(w.message) for w in caught):
        print(f"warning: {message}", file=sys.stderr)
    return RunSpec(config_file=config_file, overrides=tuple(overrides), shape=shape, cfg=cfg)


def auto_resume_overrides(spec: RunSpec) -> list[str]:
    """``["trainer.resume_mode=auto"]`` when the run resumes by itself, else ``[]``.

    A scheduler that restarts a job (a Slurm requeue, a RayJob retry) reruns the same command,
    so the command says ``auto`` out loud: resume from the newest complete checkpoint in the
    run directory. A run that chose otherwise (``disable``, ``resume_path``, a checkpoint
    path) keeps its choice; the launcher decides what a restart of it does.
    """
    trainer = spec.cfg.trainer
    return ["trainer.resume_mode=auto"] if is_auto_resume(trainer) else []


def is_auto_resume(trainer: DictConfig) -> bool:
    """True when ``trainer`` resumes from its run directory's newest checkpoint by itself."""
    return trainer.resume_mode == "auto" and not trainer.get("resume_from_path")


def is_secret(name: str) -> bool:
    return any(part in name.upper() for part in _SECRET_PARTS)


def passthrough_env(environ: Mapping[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """(values safe to write into a job file, names of secrets to pass only by export).

    Both are sorted, so generated files don't change with the environment's order.
    """
    environ = os.environ if environ is None else environ
    picked = sorted(
        name for name in environ if name.startswith(PASSTHROUGH_PREFIXES) or name in PASSTHROUGH_NAMES
    )
    values = {name: environ[name] for name in picked if not is_secret(name)}
    secrets = [name for name in picked if is_secret(name)]
    return values, secrets


def check_env_assignments(items: Sequence[str], flag: str = "--env") -> dict[str, str]:
    """``["A=1", "B=x"]`` -> ``{"A": "1", "B": "x"}``; a LaunchError names a malformed item."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.fullmatch(name):
            raise LaunchError(
                f"{flag} {item!r}: expected NAME=VALUE with NAME a shell variable name, e.g. NCCL_DEBUG=INFO"
            )
        out[name] = value
    return out


def driver_env(spec: RunSpec, ray_address: str) -> dict[str, str]:
    """Variables the driver process gets on top of its inherited environment."""
    return {
        "RAY_ADDRESS": ray_address,
        "RLHF_MEGATRON_NNODES": str(spec.shape.nodes),
        "RLHF_MEGATRON_GPUS_PER_NODE": str(spec.shape.gpus_per_node),
        "RLHF_MEGATRON_RUN_DIR": str(spec.run_dir),
    }
