"""``rlhf-megatron launch slurm``: render the Ray-on-Slurm batch script and submit it.

Role: fills ``launchers/slurm/ray_job.sbatch`` (the job logic lives there, in bash, where
a Slurm user can read it) with the job's settings, writes it to
``<run dir>/slurm/<experiment>.sbatch`` and runs ``sbatch`` on it. ``--dry-run`` prints the
script instead. The job's output, each node's Ray log and ``status-<jobid>`` (the driver's
exit code) land next to the script.

Restarts: the job is requeueable (``--requeue``; output appended, ``--open-mode=append``), so
Slurm runs it again after a node failure or ``scontrol requeue``, at most ``--max-requeues``
times. The driver runs through ``launch/restart.py``: a requeued run resumes from the
newest checkpoint the job wrote (see that module for the rule).

Rendering: the settings are bash assignments quoted with ``shlex.quote``, so no value can
break the script. The pass-through environment (NCCL_*, WANDB_*, HF_*, ...) is recorded
by value, except secrets (names with KEY/TOKEN/SECRET/PASSWORD): those reach the job only
through ``sbatch --export=ALL`` and are never written to disk.

Boundaries: no Ray import; the job itself needs Ray and this package on every node (in
the container image, or in the submitting Python environment on a shared filesystem).
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_megatron.launch.common import (
    PASSTHROUGH_NAMES,
    PASSTHROUGH_PREFIXES,
    LaunchError,
    RunSpec,
    add_common_args,
    auto_resume_overrides,
    check_env_assignments,
    load_run,
    parse_launch_args,
    passthrough_env,
)

__all__ = ["SlurmOptions", "main", "render_script", "submit"]

TEMPLATE = Path(__file__).resolve().parents[2] / "launchers" / "slurm" / "ray_job.sbatch"
CONTAINER_RUNTIMES = ("pyxis", "apptainer")
# Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or no limit.
_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE", re.IGNORECASE)
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


@dataclass
class SlurmOptions:
    """Everything about the job that is not the run config."""

    partition: str | None = None
    account: str | None = None
    time: str | None = None
    """Wall-clock limit in a Slurm format (``4:00:00``, ``2-00:00:00``)."""
    cpus_per_node: int | None = None
    """CPUs per node for Ray; None asks Slurm for whole nodes (``--exclusive``)."""
    container: str | None = None
    """Image: a pyxis/enroot name (``nvcr.io#nvidia/pytorch:...``) or an apptainer ``.sif``/URI."""
    container_runtime: str = "pyxis"
    """pyxis (``srun --container-image``) or apptainer (``apptainer exec``)."""
    container_mounts: list[str] = field(default_factory=list)
    """Extra ``SRC:DST`` mounts; the working, run and log directories are always mounted."""
    driver_cmd: str | None = None
    """Shell command run instead of ``rlhf-megatron train ...``."""
    join_timeout_s: int = 600
    """Seconds for all Ray nodes to join before the job fails."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra variables to export in the job (``--env NAME=VALUE``)."""
    ray_start_args: list[str] = field(default_factory=list)
    """Extra ``ray start`` options for every node."""
    sbatch_args: list[str] = field(default_factory=list)
    """Extra ``#SBATCH`` options, e.g. ``--qos=high`` or ``--mem=0``."""
    log_dir: Path | None = None
    """Where the script, the job output and the Ray logs go; None: ``<trainer.default_local_dir>/slurm``."""
    max_requeues: int = 3
    """Times Slurm may run the job again after a node failure or ``scontrol requeue``; 0 makes
    the job not requeueable (``--no-requeue``). A run past the bound exits 1 at once."""

    def check(self) -> None:
        """A LaunchError for the first bad option, naming it and what to change."""
        if self.container_runtime not in CONTAINER_RUNTIMES:
            raise LaunchError(
                f"--container-runtime {self.container_runtime!r} is not supported; use one of "
                f"{', '.join(CONTAINER_RUNTIMES)}"
            )
        if self.container is not None and not self.container.strip():
            raise LaunchError("--container is empty; pass an image name, or leave --container out")
        if self.container_mounts and self.container is None:
            raise LaunchError(
                "--container-mount needs --container IMAGE (without a container nothing is mounted)"
            )
        for flag, value in (("--partition", self.partition), ("--account", self.account)):
            if value is not None and not _NAME.fullmatch(value):
                raise LaunchError(
                    f"{flag} {value!r} is not a Slurm name (letters, digits, '_', '-', '.'); fix or leave it out"
                )
        if self.time is not None and not _TIME.fullmatch(self.time):
            raise LaunchError(
                f"--time {self.time!r} is not a Slurm time limit; use minutes, H:MM:SS or D-HH:MM:SS (e.g. 4:00:00)"
            )
        if self.cpus_per_node is not None and self.cpus_per_node < 1:
            raise LaunchError(
                f"--cpus-per-node must be at least 1 (got {self.cpus_per_node}); leave it out to take whole nodes"
            )
        if self.join_timeout_s < 1:
            raise LaunchError(
                f"--join-timeout must be a positive number of seconds (got {self.join_timeout_s})"
            )
        if self.max_requeues < 0:
            raise LaunchError(
                f"--max-requeues must be 0 or more (got {self.max_requeues}); 0 turns requeueing off"
            )


def _bash_array(name: str, words: list[str]) -> str:
    return f"{name}=(" + " ".join(shlex.quote(w) for w in words) + ")"


def _directives(spec: RunSpec, opts: SlurmOptions, log_dir: Path) -> list[str]:
    for what, path in (("the working directory", Path.cwd()), ("the log directory (--log-dir)", log_dir)):
        if any(c.isspace() for c in str(path)):
            raise LaunchError(
                f"{what} {str(path)!r} contains whitespace, which #SBATCH lines cannot hold; use another"
            )
    lines = [
        f"--job-name={_safe_name(spec.job_name)}",
        f"--nodes={spec.shape.nodes}",
        "--ntasks-per-node=1",
        f"--output={log_dir}/slurm-%j.out",
        # A requeued job runs again under the same id: append, so the first run's log survives.
        "--open-mode=append",
        "--requeue" if opts.max_requeues > 0 else "--no-requeue",
        f"--chdir={Path.cwd()}",
        # Secrets (WANDB_API_KEY, HF_TOKEN) travel this way only; see the module docstring.
        "--export=ALL",
    ]
    if spec.shape.gpus_per_node > 0:
        lines.append(f"--gpus-per-node={spec.shape.gpus_per_node}")
    # Without a CPU count, take whole nodes: Ray then sees every CPU of each machine.
    lines.append(f"--cpus-per-task={opts.cpus_per_node}" if opts.cpus_per_node else "--exclusive")
    for flag, value in (("partition", opts.partition), ("account", opts.account), ("time", opts.time)):
        if value is not None:
            lines.append(f"--{flag}={value}")
    lines += opts.sbatch_args
    return [f"#SBATCH {line}" for line in lines]


def _shared_dirs(spec: RunSpec, log_dir: Path) -> list[Path]:
    """Host directories a containerised step needs at the same path: the working directory,
    the run directory (checkpoints) and the log directory, minus those inside another."""
    dirs = [Path.cwd(), spec.run_dir, log_dir]
    return [d for i, d in enumerate(dirs) if not any(d.is_relative_to(o) for o in dirs[:i])]


def _container_args(spec: RunSpec, opts: SlurmOptions, log_dir: Path) -> tuple[list[str], list[str]]:
    """(extra srun options, command prefix) that run a step inside the container."""
    if opts.container is None:
        return [], []
    cwd = str(Path.cwd())
    mounts = [f"{d}:{d}" for d in _shared_dirs(spec, log_dir)] + opts.container_mounts
    if opts.container_runtime == "pyxis":
        # A named container is imported once per node and reused by the later steps.
        return [
            f"--container-image={opts.container}",
            "--container-name=rlhf-megatron",
            f"--container-mounts={','.join(mounts)}",
            f"--container-workdir={cwd}",
        ], []
    # --nv binds the host's NVIDIA driver and devices into the container.
    nv = ["--nv"] if spec.shape.gpus_per_node > 0 else []
    return [], ["apptainer", "exec", *nv, "--bind", ",".join(mounts), "--pwd", cwd, opts.container]


def _settings(spec: RunSpec, opts: SlurmOptions, log_dir: Path, environ: dict[str, str] | None) -> list[str]:
    if opts.driver_cmd:
        driver, restart = ["bash", "-c", opts.driver_cmd], []
    else:
        driver = spec.train_command() + auto_resume_overrides(spec)
        restart = ["python3", "-m", "rlhf_megatron.launch.restart", "--run-dir", str(spec.run_dir)]
    srun_args, exec_prefix = _container_args(spec, opts, log_dir)
    values, secrets = passthrough_env(environ)
    pattern = "^(" + "|".join([p + ".*" for p in PASSTHROUGH_PREFIXES] + list(PASSTHROUGH_NAMES)) + ")$"
    lines = [
        f"NNODES={spec.shape.nodes}",
        f"GPUS_PER_NODE={spec.shape.gpus_per_node}",
        f"CPUS_PER_NODE={opts.cpus_per_node or ''}",
        f"JOIN_TIMEOUT={opts.join_timeout_s}",
        f"MAX_REQUEUES={opts.max_requeues}",
        f"RUN_DIR={shlex.quote(str(spec.run_dir))}",
        f"LOG_DIR={shlex.quote(str(log_dir))}",
        f"PASSTHROUGH_PATTERN={shlex.quote(pattern)}",
        _bash_array("DRIVER_CMD", driver),
        # Empty with --driver-cmd: a custom driver reads SLURM_RESTART_COUNT itself.
        _bash_array("RESTART_CMD", restart),
        _bash_array("RAY_EXTRA_ARGS", opts.ray_start_args),
        _bash_array("CONTAINER_SRUN_ARGS", srun_args),
        _bash_array("CONTAINER_EXEC", exec_prefix),
    ]
    if opts.container is None:
        # No image: the nodes use the submitting Python environment (on a shared filesystem).
        lines.append(f'export PATH={shlex.quote(str(Path(sys.executable).parent))}:"$PATH"')
    exports = {**values, **opts.env}
    if exports:
        lines.append("# Pass-through environment, recorded at submission:")
        lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(exports.items())]
    if secrets:
        lines.append(f"# Not recorded (secrets; passed by sbatch --export=ALL): {' '.join(secrets)}")
    return lines


def render_script(spec: RunSpec, opts: SlurmOptions, environ: dict[str, str] | None = None) -> str:
    """The batch script for ``spec`` (deterministic for a given cwd, options and environment)."""
    opts.check()
    log_dir = _log_dir(spec, opts)
    text = TEMPLATE.read_text()
    text = text.replace("# @SBATCH_DIRECTIVES@", "\n".join(_directives(spec, opts, log_dir)))
    text = text.replace("# @SETTINGS@", "\n".join(_settings(spec, opts, log_dir, environ)))
    assert "@SBATCH_DIRECTIVES@" not in text and "@SETTINGS@" not in text, f"placeholders left in {TEMPLATE}"
    return text


def _log_dir(spec: RunSpec, opts: SlurmOptions) -> Path:
    return opts.log_dir.absolute() if opts.log_dir else spec.run_dir / "slurm"


def _safe_name(name: str) -> str:
    """A job/file name without spaces or slashes (experiment names may have them)."""
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", name).strip("_") or "rlhf-megatron"


def script_path(spec: RunSpec, opts: SlurmOptions) -> Path:
    return _log_dir(spec, opts) / f"{_safe_name(spec.job_name)}.sbatch"


def submit(spec: RunSpec, opts: SlurmOptions) -> str:
    """Write the script and ``sbatch`` it; returns the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise LaunchError(
            "sbatch not found on PATH; run this on a Slurm login node, or add --dry-run to see the script"
        )
    script = render_script(spec, opts)
    path = script_path(spec, opts)
    path.parent.mkdir(parents=True, exist_ok=True)
    spec.run_dir.mkdir(parents=True, exist_ok=True)  # a container mount needs it to exist
    path.write_text(script)
    proc = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise LaunchError(f"sbatch rejected {path}: {proc.stderr.strip() or proc.stdout.strip()}")
    # --parsable prints "jobid" or "jobid;cluster".
    return proc.stdout.strip().split(";")[0]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlhf-megatron launch slurm",
        description="Start a Ray cluster on a Slurm allocation and run the trainer on it.",
        epilog="Config overrides go after `--`, e.g. -- trainer.total_epochs=3 data.train_batch_size=256",
    )
    add_common_args(parser, multi_node=True)
    parser.add_argument("--partition", help="Slurm partition")
    parser.add_argument("--account", help="Slurm account to charge")
    parser.add_argument("--time", help="wall-clock limit, e.g. 4:00:00 or 2-00:00:00")
    parser.add_argument(
        "--cpus-per-node", type=int, help="CPUs per node for Ray (default: whole nodes, --exclusive)"
    )
    parser.add_argument("--container", metavar="IMAGE", help="run every step in this image")
    parser.add_argument(
        "--container-runtime",
        default="pyxis",
        help="pyxis (srun --container-image) or apptainer (apptainer exec)",
    )
    parser.add_argument(
        "--container-mount", action="append", default=[], metavar="SRC:DST", help="extra mount"
    )
    parser.add_argument("--join-timeout", type=int, default=600, help="seconds for all Ray nodes to join")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="export in the job")
    parser.add_argument("--ray-start-args", default="", help="extra `ray start` options for every node")
    parser.add_argument(
        "--sbatch-arg", action="append", default=[], metavar="OPT", help="extra #SBATCH option"
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        help="where the script, job output and Ray logs go (default: <trainer.default_local_dir>/slurm)",
    )
    parser.add_argument(
        "--max-requeues",
        type=int,
        default=3,
        help="times Slurm may rerun the job after a node failure or `scontrol requeue` (0: never); "
        "a rerun resumes from the job's last checkpoint",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the batch script; submit nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_launch_args(build_parser(), sys.argv[1:] if argv is None else argv)
    opts = SlurmOptions(
        partition=args.partition,
        account=args.account,
        time=args.time,
        cpus_per_node=args.cpus_per_node,
        container=args.container,
        container_runtime=args.container_runtime,
        container_mounts=args.container_mount,
        driver_cmd=args.driver_cmd,
        join_timeout_s=args.join_timeout,
        env=check_env_assignments(args.env),
        ray_start_args=shlex.split(args.ray_start_args),
        sbatch_args=args.sbatch_arg,
        log_dir=args.log_dir,
        max_requeues=args.max_requeues,
    )
    opts.check()  # before loading the config: argument mistakes are cheaper to report first
    spec = load_run(args.config, overrides, args.nodes, args.gpus_per_node)
    if args.dry_run:
        print(render_script(spec, opts), end="")
        return 0
    job_id = submit(spec, opts)
    log_dir = script_path(spec, opts).parent
    print(f"Submitted batch job {job_id}")
    print(f"  script: {script_path(spec, opts)}\n  output: {log_dir}/slurm-{job_id}.out", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
