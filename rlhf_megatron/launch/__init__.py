"""Launchers: from a config to a running Ray cluster with the driver on it.

Role: ``rlhf-megatron launch {slurm,k8s,local}``. Each launcher checks its arguments and
the run config (with the cluster shape applied) before anything is queued, then:

- ``slurm`` (``slurm.py``): renders ``launchers/slurm/ray_job.sbatch`` and submits it; the
  job starts Ray on every node, waits for them, runs the driver, tears Ray down.
- ``k8s`` (``k8s.py``): prints KubeRay ``RayJob``/``RayCluster`` manifests and a
  checkpoint PVC as one multi-document YAML.
- ``local`` (``local.py``): starts a Ray head on this machine, runs the driver, stops Ray.

``wait.py`` (wait for N Ray nodes) and ``probe.py`` (a smoke driver that runs a task on
every node) run inside jobs. The shared argument and config handling is ``common.py``.

Boundaries: the launchers start the driver as a command (``rlhf-megatron train ...``),
never import the trainer. Ray is imported only by the modules that run it.
"""

from __future__ import annotations

import sys

from rlhf_megatron.config import ConfigError
from rlhf_megatron.launch.common import LaunchError

__all__ = ["LAUNCHERS", "LaunchError", "main"]

LAUNCHERS = {
    "slurm": "Ray on a Slurm allocation (sbatch)",
    "k8s": "KubeRay RayJob/RayCluster manifests (kubectl apply -f)",
    "local": "this machine, no scheduler (CPU or GPU)",
}

_USAGE = "usage: rlhf-megatron launch {" + ",".join(LAUNCHERS) + "} --config FILE [options] [-- overrides...]"


def _help() -> str:
    rows = "\n".join(f"  {name:<6} {what}" for name, what in LAUNCHERS.items())
    return f"{_USAGE}\n\nlaunchers:\n{rows}\n\n`rlhf-megatron launch NAME --help` lists a launcher's options."


def main(argv: list[str] | None = None) -> int:
    """``rlhf-megatron launch NAME ...``: dispatch to the launcher; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_help())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in LAUNCHERS:
        print(
            f"{_USAGE}\nrlhf-megatron launch: error: unknown launcher {name!r}; choose one of: "
            f"{', '.join(LAUNCHERS)}",
            file=sys.stderr,
        )
        return 2
    # Imported on use: `launch k8s` needs neither Ray nor Slurm.
    if name == "slurm":
        from rlhf_megatron.launch.slurm import main as run
    elif name == "k8s":
        from rlhf_megatron.launch.k8s import main as run
    else:
        from rlhf_megatron.launch.local import main as run
    try:
        return run(rest)
    except (LaunchError, ConfigError) as exc:
        print(f"rlhf-megatron launch {name}: error: {exc}", file=sys.stderr)
        return 2
