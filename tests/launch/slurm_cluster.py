"""A real Slurm cluster on this host for the launcher tests: munged, slurmctld, two slurmd.

Debian's slurm-wlm 22.05 runs several slurmd daemons on one host. Each gets its own node
name (``slurmd -N node2``), port and spool directory, and all share ``NodeHostname``
(Slurm's multiple-slurmd setup). So a 2-node job runs here with ``srun -w node2`` reaching
a separate daemon, ``SLURMD_NODENAME`` set per node, and steps tracked per node. No GPUs are
configured and nothing uses cgroups (``proctrack/linuxproc``, ``task/none``). The
config, the munge key, state, spool, logs and pid files all live in one temp dir, and the
daemons are stopped by pid. Nothing outside the temp dir is touched.

Needs root (slurmd starts job steps as the submitting user) and the packages
(``bash scripts/install_slurm.sh``).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

COMMANDS = (
    "munged",
    "mungekey",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scontrol",
    "sinfo",
    "squeue",
    "scancel",
)
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
}


class SlurmStartError(RuntimeError):
    """A daemon did not come up; the message carries the tail of its log."""


def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot run on this machine, or None if it can."""
    if os.geteuid() != 0:
        return "the real-Slurm test needs root (slurmd starts job steps as the submitting user)"
    missing = [c for c in COMMANDS if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]
    if missing:
        return (
            f"Slurm/munge not installed ({', '.join(missing)} missing); run `bash scripts/install_slurm.sh`"
        )
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 15) -> str:
    if not path.exists():
        return f"({path} does not exist)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


SLURM_CONF = """\
ClusterName=rlhftest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
FirstJobId={first_job_id}
{node_lines}
PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP
"""
# One line per node: its own slurmd port, all on this host.
NODE_LINE = (
    "NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 Port={port}"
)


@dataclass
class SlurmCluster:
    root: Path
    node_names: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Environment for the client commands (SLURM_CONF)."""

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def run(self, *args: str, check: bool = True) -> str:
        proc = subprocess.run(
            list(args), capture_output=True, text=True, env={**os.environ, **self.env}, timeout=60
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, NodeList, ...)."""
        fields: dict[str, str] = {}
        for word in self.run("scontrol", "show", "job", "--oneliner", job_id).split():
            key, sep, value = word.partition("=")
            if sep:
                fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: str, timeout_s: float) -> dict[str, str]:
        """Wait for the job to reach a final state; its ``scontrol`` fields."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if info.get("JobState") in TERMINAL_STATES:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} still {info.get('JobState')} after {timeout_s:.0f} s: {info}"
                )
            time.sleep(1.0)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{_tail(p)}" for p in sorted((self.root / "log").glob("*.log")))

    def _pid(self, pid_file: Path) -> int | None:
        try:
            return int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        """Cancel what is left, then stop the slurmd daemons, slurmctld and munged by pid."""
        try:
            self.run("scancel", "--quiet", "--user", "root", check=False)
            deadline = time.monotonic() + 20
            while self.run("squeue", "-h", check=False).strip() and time.monotonic() < deadline:
                time.sleep(1)
        except (OSError, subprocess.SubprocessError):
            pass
        run = self.root / "run"
        # The node daemons together, then the controller, then munge, which both still use.
        for group in (sorted(run.glob("slurmd.*.pid")), [run / "slurmctld.pid"], [run / "munged.pid"]):
            _terminate([pid for pid in map(self._pid, group) if pid is not None])


def _terminate(pids: list[int], timeout_s: float = 10.0) -> None:
    """SIGTERM to all, wait for all, SIGKILL what is left."""
    alive = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            alive.append(pid)
    deadline = time.monotonic() + timeout_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in alive if _exists(pid)]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _start(cmd: list[str], what: str, log: Path) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise SlurmStartError(
            f"{what} did not start ({proc.returncode}): {proc.stderr.strip()}\n{_tail(log)}"
        )


def start_cluster(
    root: Path, nodes: int = 2, cpus_per_node: int = 2, timeout_s: float = 60.0
) -> SlurmCluster:
    """munged + slurmctld + one slurmd per node, all under ``root``; waits until the nodes are idle."""
    for sub in ("state", "spool", "log", "run"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    munge_dir = root / "munge"
    munge_dir.mkdir(mode=0o755, exist_ok=True)  # munged wants its socket directory traversable
    key = munge_dir / "munge.key"
    subprocess.run(["mungekey", "--create", "--force", f"--keyfile={key}", "--bits=1024"], check=True)
    key.chmod(0o600)
    socket_path = munge_dir / "munge.socket"
    cluster = SlurmCluster(root=root, node_names=[f"node{i}" for i in range(1, nodes + 1)])
    cluster.env = {"SLURM_CONF": str(cluster.conf)}
    try:
        _start(
            [
                "munged",
                "--force",
                f"--key-file={key}",
                f"--socket={socket_path}",
                f"--pid-file={root}/run/munged.pid",
                f"--log-file={root}/log/munged.log",
                f"--seed-file={munge_dir}/munged.seed",
            ],
            "munged",
            root / "log" / "munged.log",
        )
        node_lines = [
            NODE_LINE.format(name=n, cpus=cpus_per_node, port=_free_port()) for n in cluster.node_names
        ]
        cluster.conf.write_text(
            SLURM_CONF.format(
                root=root,
                ctld_port=_free_port(),
                munge_socket=socket_path,
                # Job ids (and so each job's Ray temp dir) differ between test runs.
                first_job_id=random.randint(100_000, 900_000),
                node_lines="\n".join(node_lines),
                nodes=",".join(cluster.node_names),
            )
        )
        _start(["slurmctld", "-f", str(cluster.conf)], "slurmctld", root / "log" / "slurmctld.log")
        for name in cluster.node_names:
            _start(
                ["slurmd", "-f", str(cluster.conf), "-N", name],
                f"slurmd {name}",
                root / "log" / f"slurmd.{name}.log",
            )
        _wait_idle(cluster, timeout_s)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_idle(cluster: SlurmCluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
        if all(states.get(n) == "idle" for n in cluster.node_names):
            return
        time.sleep(0.5)
    raise SlurmStartError(f"Slurm nodes not idle after {timeout_s:.0f} s: {states}\n{cluster.logs()}")
