"""``rlhf-megatron launch local``: a Ray head on this machine, the driver, then Ray stops.

Role: single-machine runs (a laptop, one GPU box, CI) without a scheduler; the quickstart
uses it. The Ray head runs inside this process (``ray.init``). The driver runs as a child
process that finds the head through ``RAY_ADDRESS``, exactly as on Slurm and Kubernetes,
so the trainer has one way to find its cluster. When the driver exits, or when this
process gets Ctrl-C or SIGTERM, the driver is stopped and Ray shut down. Only the Ray
processes this run started are stopped; another Ray on the same machine is left alone.

Boundaries: one machine. Several machines go through ``launch slurm`` or ``launch k8s``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import signal
import subprocess
import sys
from contextlib import contextmanager

from rlhf_megatron.launch.common import (
    LaunchError,
    RunSpec,
    add_common_args,
    driver_env,
    load_run,
    parse_launch_args,
)

__all__ = ["main", "run_local"]

_DRIVER_STOP_S = 30.0


@contextmanager
def _ray_auth_env():
    """Give this run's Ray a fresh token, in the environment only.

    Ray >= 2.5x turns token auth on for a new local cluster (setting RAY_AUTH_MODE=token
    itself) and, finding no token, writes one to ~/.ray/auth_token. A per-run token in
    RAY_AUTH_TOKEN avoids that file and reaches the driver through its inherited
    environment. RAY_AUTH_MODE is left to Ray: set before ``import ray``, its cached
    config would miss it. Set RAY_AUTH_* yourself to choose otherwise.
    """
    added = {}
    wanted = os.environ.get("RAY_AUTH_MODE", "token") == "token"
    if wanted and not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        added["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _raise_exit(signum, _frame):
    raise SystemExit(128 + signum)


def _run_driver(command: list[str], env: dict[str, str]) -> int:
    proc = subprocess.Popen(command, env=env)
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:  # we are leaving early (Ctrl-C, SIGTERM): stop the driver first
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=_DRIVER_STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_local(spec: RunSpec, command: list[str], num_cpus: int | None, num_gpus: int | None) -> int:
    """Start a local Ray head, run ``command`` against it, shut Ray down; the driver's status."""
    import ray

    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        with _ray_auth_env():
            # address="local": always a new head, never an existing cluster found on the machine.
            ctx = ray.init(
                address="local",
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                include_dashboard=False,
                logging_level="WARNING",
            )
            try:
                env = {**os.environ, **driver_env(spec, ctx.address_info["gcs_address"])}
                # The driver uses this Python environment's `python` and `rlhf-megatron`.
                env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
                print(
                    f"[rlhf-megatron] local Ray head at {env['RAY_ADDRESS']}; driver: {shlex.join(command)}",
                    flush=True,
                )
                return _run_driver(command, env)
            finally:
                ray.shutdown()
    finally:
        signal.signal(signal.SIGTERM, previous)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlhf-megatron launch local",
        description="Run on this machine: start Ray, run the trainer, stop Ray.",
        epilog="Config overrides go after `--`, e.g. -- trainer.total_training_steps=1",
    )
    add_common_args(parser, multi_node=False)
    parser.add_argument(
        "--num-cpus", type=int, help="CPUs Ray may use (default: ray_init.num_cpus, else all)"
    )
    parser.add_argument(
        "--num-gpus",
        type=int,
        help="GPUs Ray may use; 0 runs in CPU mode (default: Ray counts them; CPU mode when trainer.device=cpu)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_launch_args(build_parser(), sys.argv[1:] if argv is None else argv)
    if args.num_cpus is not None and args.num_cpus < 1:
        raise LaunchError(
            f"--num-cpus must be at least 1 (got {args.num_cpus}); leave it out to use every CPU"
        )
    if args.num_gpus is not None and args.num_gpus < 0:
        raise LaunchError(
            f"--num-gpus must be 0 or more (got {args.num_gpus}); pass --num-gpus 0 for CPU mode"
        )
    # One machine. The GPU count goes to the trainer only when given: otherwise the config
    # keeps its own n_gpus_per_node and Ray finds the GPUs by itself.
    spec = load_run(args.config, overrides, nodes=1, gpus_per_node=args.num_gpus)
    num_cpus = args.num_cpus if args.num_cpus is not None else spec.cfg.ray_init.num_cpus
    num_gpus = args.num_gpus if args.num_gpus is not None else (0 if spec.shape.cpu_mode else None)
    command = ["bash", "-c", args.driver_cmd] if args.driver_cmd else spec.train_command()
    return run_local(spec, command, num_cpus, num_gpus)


if __name__ == "__main__":
    sys.exit(main())
