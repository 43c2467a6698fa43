"""Run model-written Python in a locked-down child process: ``run_python(code) -> SandboxResult``.

Role
----
RL with a code tool (verl's sandbox_fusion tool, ReTool) runs whatever the policy writes, on the
rollout machines, thousands of times a step. The code is hostile by assumption: infinite loops,
fork bombs, 10 GB allocations, 10 MB prints, deleting or rewriting files (the grader, the data),
opening sockets, reading the training answers or the trainer's secrets, killing the trainer.
``run_python`` runs one snippet in a fresh interpreter and returns its output and a status; whatever the snippet does,
the call returns within ``timeout_s`` (+ about 0.1 s), leaves no process and no file behind, and
never raises for what the code did. Stdlib only (``ctypes`` for the kernel interfaces).

How one run goes
----------------
The parent makes a fresh directory ``<tmp>/rlhf-sandboxes-<uid>/<pid>-<start>/call-XXXX`` (one
directory per process, under one per user; the first call of a process removes what processes
that are gone left there, so a trainer killed with SIGKILL leaves nothing once the next run has
started) with ``work/`` (the code's working directory, ``HOME`` and ``TMPDIR``, holding
``files``), the code, its stdin and its parameters beside it. It starts ``sys.executable -s -S -B``
on the bootstrap (``sandbox_child.py``, compiled once per process to a marshal file) in a new
session, so the code's process group can be killed as one, with a minimal environment (``PATH``,
``LANG``, ``HOME``, ``TMPDIR``, ``PYTHONHASHSEED=0``, ``OMP_NUM_THREADS=1`` and the other
thread-count variables; nothing inherited, so no secrets) and ``umask 077``. The bootstrap hardens
the process (below) before compiling the code, then runs it as ``__main__`` (the site-packages
the caller names are importable: numpy, sympy; ``.pth`` files are not processed). The parent
reads stdout and stderr as they come, kills the whole group (SIGKILL) at the wall deadline or
when the output passes ``max_output_bytes``, kills it again when the process ends (while the
unreaped leader still pins the group id, so no other group can be hit), reaps it, checks the
group is gone and removes the directory, without recursion (a tree of any depth goes).

Layers, and which one stops what (measured on Linux 6.18, x86_64, as root; ``sandbox_layers()``
reports what holds on a given machine; ``docs/guides/agents.md`` has the table, checked against
``tests/agent/test_sandbox_hostile.py``)
-----------------------------------------------------------------------------------------
1. rlimits (kernel, any user): ``RLIMIT_CPU`` (SIGXCPU at ``cpu_s`` rounded up, SIGKILL a second
   later), ``RLIMIT_AS`` (``memory_mb``: a big allocation fails at once with MemoryError),
   ``RLIMIT_FSIZE`` (``max_file_bytes`` per written file), ``RLIMIT_NOFILE`` 64, ``RLIMIT_CORE``,
   ``RLIMIT_RTPRIO`` and ``RLIMIT_MSGQUEUE`` 0. Where seccomp (5) is missing, a non-root user also
   gets ``RLIMIT_NPROC`` 0 (no processes, no threads); it does not bind root.
2. Network namespace (kernel): ``unshare(CLONE_NEWNET)`` (as root; a non-root user gets it inside
   a new user namespace where the kernel allows those): no interface but a loopback that is down.
3. Disk quota (kernel): a mount namespace of its own (made private, so nothing propagates back)
   with a tmpfs of ``max_disk_bytes`` and 16,384 inodes mounted over ``work/``, the parent's
   ``files`` copied in. Everything the code writes is bounded as a whole (status ``disk_limit``),
   never reaches the disk, and is gone with the process, whatever the tree looks like. Where it
   is missing, the parent measures ``work/`` afterwards and reports ``disk_limit`` past the limit.
4. Landlock (kernel >= 5.13, any user, root included): reading only the interpreter's standard
   library (not its ``site-packages``), the site-packages the caller names, the system's shared
   libraries (``/lib``, ``/usr/lib``, ... without their ``python*`` entries), a few ``/etc`` files
   the loader and the C library open, harmless devices and the CPU topology in ``/sys``, and the
   working directory (``read_allowlist()``). So not the checkout, the data (the answers), the
   checkpoints, the outputs, ``/tmp``, ``$HOME``, other sandboxes' directories, or ``/proc``
   (no ``/proc/<trainer>/environ``). Writing, creating, removing, renaming, linking and
   truncating only beneath the working directory (and writing ``/dev/null``), whatever path,
   ``..`` or symlink the code uses. ABI >= 4: TCP bind/connect denied; ABI >= 6: signals and
   abstract unix sockets scoped to the sandbox. A refused read is the model's PermissionError.
5. seccomp-BPF filter (kernel, any user, after ``PR_SET_NO_NEW_PRIVS``; x86_64 and aarch64):
   ``fork``/``vfork``/``clone`` without ``CLONE_THREAD``/``execve``/``execveat`` fail with EPERM
   (``clone3`` with ENOSYS so glibc falls back to ``clone``): threads work, processes cannot be
   made, so ``os.fork``, ``subprocess``, ``multiprocessing`` and ``os.system`` fail and nothing can
   outlive the call. Also EPERM: ``socket``/``socketpair`` (every family), ``kill``/``tgkill``
   other than to itself, ``ptrace``, ``process_vm_*``, pidfds, ``setrlimit``/``prlimit64`` (root
   could raise its hard limits), ``setsid``/``setpgid`` (the group stays killable),
   ``chmod``/``chown``/xattr setters (Landlock does not cover them), mounts, namespaces,
   ``chroot``, ``bpf``, ``perf_event_open``, ``io_uring``, ``userfaultfd``, keyrings, modules,
   ``kexec``, ``reboot``, clock setting, ``open_by_handle_at``, ``mknod``, scheduling and priority
   changes. Other architectures' and x32 system calls kill the process. Binds root too.
6. Audit hook (Python level, installed before the code runs; cannot be removed): refuses, with a
   ``PermissionError`` that names the rule, starting processes, ``socket.*``, ``ctypes.*`` (libc
   calls past the hook), ``sys.settrace``/``setprofile`` and ``gc.get_referrers`` and friends,
   ``resource.setrlimit``, ``chmod``/``chown``, signals to other processes, writing, removing,
   renaming, linking or making directories outside the work directory (paths normalised
   lexically, symlink targets checked), and replacing its own functions' code. Its tables are
   immutable (a traceback through the hook reaches its frame, so they are mapping proxies,
   frozensets and tuples). It turns most refusals into clear messages for the model; it is not a
   boundary by itself (``os.open(..., dir_fd=...)`` gets past its path checks), which is why
   layers 3-5 stand behind it.
7. The parent: wall-clock deadline, output cap, process-group kill, reaping, removal of the
   directory; ``PR_SET_PDEATHSIG`` kills the sandbox if the thread that started it dies.

``REQUIRED_LAYERS`` (2-5) are what ``CodeInterpreterTool`` will not run without unless its tool
config's ``allow_missing_layers`` names the missing ones: on a kernel without Landlock the code
could read the answers, without seccomp start processes, without the namespaces reach the
network or fill the disk. ``run_python`` itself runs with whatever holds.

What it does NOT protect against
--------------------------------
- Reading what the allowlist grants: the standard library and the named site-packages (keep data
  out of them) and file metadata anywhere (``os.stat`` and ``os.path.exists`` are not reads to
  Landlock): the code can learn that a path exists, not what it holds.
- Memory is address space (``RLIMIT_AS``), not resident memory; ``memory_mb`` must cover the
  interpreter (about 30 MB, about 150 MB once numpy is imported). The tmpfs (``max_disk_bytes``)
  is memory too, for the length of the call.
- CPU: one sandbox can use every core with threads until ``cpu_s`` (counted over all threads).
- Kernel bugs; side channels; the model learning to print what the grader wants.

Behaviour the code sees: ``chmod`` (so ``shutil.copy``/``copy2``/``copytree``; ``copyfile``
works) fails with PermissionError; reading outside its directory fails with PermissionError;
``/proc`` cannot be read; threads work; stdout is line-buffered, so what was printed before a
timeout is kept; tracebacks name the file ``<code>``.

Cost: ``print(1)`` through ``run_python`` is about 30 ms on a 2-core machine (``python -S -c
pass`` alone is 12 ms, importing ctypes for the kernel interfaces 7 ms; ``tools/bench_agent.py
--sandbox-only`` measures it); ``import numpy`` in the code adds about 50 ms.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import logging
import marshal
import math
import os
import selectors
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from rlhf_megatron.agent import sandbox_child
from rlhf_megatron.agent.sandbox_dirs import read_allowlist, read_rules, remove_tree, sandbox_parent

__all__ = [
    "REQUIRED_LAYERS",
    "STATUSES",
    "SandboxResult",
    "missing_layers",
    "read_allowlist",
    "run_python",
    "sandbox_layers",
    "sandbox_parent",
]

logger = logging.getLogger(__name__)

#: Every value of ``SandboxResult.status``.
STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "disk_limit", "killed")
#: The kernel layers the code interpreter will not run without unless its tool config says so
#: (``allow_missing_layers``); ``sandbox_layers()`` says which hold on a machine.
REQUIRED_LAYERS = ("netns", "disk_quota", "landlock", "seccomp")

# The bootstrap exits with these codes after a MemoryError and when the code filled its disk quota
# (the code could exit with them too; it only mislabels its own run).
_MEMORY_EXIT = 86
_DISK_EXIT = 87
# Files and directories the code may have at once in its tmpfs (a 1,100-deep tree is 1,100).
_DISK_INODES = 16384
_BOOT_LOCK = threading.Lock()
_MAX_OPEN_FILES = 64
# After the process ends (or is killed), how long its pipes may take to drain.
_DRAIN_S = 1.0
_CHILD_ENV = {
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONHASHSEED": "0",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    # glibc reserves 64 MB of address space per malloc arena; threads would eat RLIMIT_AS.
    "MALLOC_ARENA_MAX": "2",
    "MPLBACKEND": "Agg",
}


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one run.

    ``status`` is one of ``STATUSES``: ``ok`` (exit 0), ``error`` (nonzero exit, an uncaught
    exception), ``timeout`` (wall clock), ``cpu_limit``, ``memory_limit`` (a MemoryError),
    ``output_limit`` (stdout + stderr passed ``max_output_bytes``; the output is cut there),
    ``killed`` (ended by a signal nobody here sent, e.g. SIGSEGV). ``exit_code`` is the process's
    (``-N`` for signal N, as ``Popen.returncode``; 1 for ``memory_limit``). ``message`` is one
    line for the model, empty when ``ok``. ``pid`` was the process and its process group id.
    """

    stdout: str
    stderr: str
    exit_code: int
    status: str
    duration_s: float
    message: str = ""
    pid: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_python(
    code: str,
    *,
    stdin: str | bytes = "",
    timeout_s: float = 5.0,
    cpu_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 64 * 1024,
    files: dict[str, bytes | str] | None = None,
    max_file_bytes: int = 16 * 1024 * 1024,
    max_disk_bytes: int = 64 * 1024 * 1024,
    site_packages: bool | list[str] | tuple[str, ...] = True,
) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter (see the module docstring) and return its result.

    ``stdin`` is the code's standard input. ``files`` maps relative paths (``data/x.csv``) to
    contents put in the working directory first. ``timeout_s`` is wall-clock, ``cpu_s`` CPU time
    (rounded up to whole seconds), ``memory_mb`` address space, ``max_output_bytes`` stdout and
    stderr together, ``max_file_bytes`` each file the code writes, ``max_disk_bytes`` everything
    it writes (``files`` included). ``site_packages``: True makes this environment's packages
    importable (and readable), a list names the directories, False none. Thread-safe; blocking
    (call it through ``asyncio.to_thread`` from a coroutine). Raises ``ValueError``/``TypeError``
    for bad arguments and ``OSError`` when no process can be started; never for what the code does.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    _check_positive(
        timeout_s=timeout_s,
        cpu_s=cpu_s,
        memory_mb=memory_mb,
        max_file_bytes=max_file_bytes,
        max_disk_bytes=max_disk_bytes,
    )
    if max_output_bytes < 0:
        raise ValueError(f"max_output_bytes must be >= 0, got {max_output_bytes!r}")
    stdin_bytes = stdin.encode("utf-8") if isinstance(stdin, str) else bytes(stdin)
    site_dirs = _named_site_dirs(site_packages)
    limits = {
        "cpu_s": max(1, math.ceil(cpu_s)),
        "memory_bytes": int(memory_mb) * 1024 * 1024,
        "file_bytes": int(max_file_bytes),
        "disk_bytes": int(max_disk_bytes),
        "site_dirs": site_dirs,
        **read_rules(tuple(site_dirs)),
    }
    with _sandbox_dir() as root:
        workdir = os.path.join(root, "work")
        _write_files(workdir, files or {}, int(max_disk_bytes))
        params = _child_params(root, code, stdin_bytes, limits, report=False)
        result = _run_child(params, timeout_s, max_output_bytes)
        # Where the tmpfs quota is missing, the code wrote to the disk: measure it (and remove it).
        written = remove_tree(workdir)
    if written > max_disk_bytes and result.status in ("ok", "error"):
        message = f"Error: the code wrote more than its {_size(max_disk_bytes)} of files."
        return dataclasses.replace(result, status="disk_limit", message=message)
    return result


def missing_layers(layers: dict[str, object] | None = None) -> list[str]:
    """The ``REQUIRED_LAYERS`` that do not hold on this machine (``sandbox_layers()`` by default)."""
    layers = sandbox_layers() if layers is None else layers
    return [name for name in REQUIRED_LAYERS if not layers.get(name)]


@functools.lru_cache(maxsize=1)
def sandbox_layers() -> dict[str, object]:
    """Which isolation layers hold on this machine, as the bootstrap installed them:
    ``{"rlimits", "netns", "disk_quota", "no_new_privs", "landlock" (ABI version, 0 = none),
    "seccomp", "audit_hook"}``. Runs one empty sandbox (cached)."""
    limits = {
        "cpu_s": 5,
        "memory_bytes": 512 * 1024 * 1024,
        "file_bytes": 1024 * 1024,
        "disk_bytes": 1024 * 1024,
        "site_dirs": [],
        **read_rules(()),
    }
    with _sandbox_dir() as root:
        result = _run_child(_child_params(root, "", b"", limits, report=True), 10.0, 64 * 1024)
    if result.status != "ok":
        raise RuntimeError(f"the sandbox probe failed ({result.status}): {result.stderr[-2000:]}")
    return ast.literal_eval(result.stdout.splitlines()[0])


# --- helpers -----------------------------------------------------------------------------------


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")


def _write_files(workdir: str, files: dict[str, bytes | str], max_bytes: int) -> None:
    total = 0
    for name, content in files.items():
        if not isinstance(name, str):
            raise TypeError(f"files: names must be str, got {name!r}")
        parts = name.replace("\\", "/").split("/")
        if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"files: {name!r} is not a relative path inside the working directory")
        data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
        total += len(data)
        if total > max_bytes:
            raise ValueError(f"files: {total} bytes or more, past max_disk_bytes={max_bytes}")
        path = os.path.join(workdir, *parts)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


@functools.lru_cache(maxsize=1)
def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _named_site_dirs(site_packages: bool | list[str] | tuple[str, ...]) -> list[str]:
    if isinstance(site_packages, bool):
        return _site_dirs() if site_packages else []
    if not isinstance(site_packages, list | tuple) or not all(isinstance(d, str) for d in site_packages):
        raise TypeError(f"site_packages must be a bool or a list of directories, got {site_packages!r}")
    missing = [d for d in site_packages if not os.path.isdir(d)]
    if missing:
        raise ValueError(f"site_packages: not a directory: {', '.join(missing)}")
    return [os.path.realpath(d) for d in site_packages]


@contextlib.contextmanager
def _sandbox_dir() -> Iterator[str]:
    """A fresh ``call-XXXX`` under ``sandbox_parent()`` with an empty ``work/``, removed afterwards
    whatever happens (``_remove_tree`` never raises)."""
    root = tempfile.mkdtemp(prefix="call-", dir=sandbox_parent())
    try:
        os.mkdir(os.path.join(root, "work"), 0o700)
        yield root
    finally:
        remove_tree(root)


def _child_params(root: str, code: str, stdin: bytes, limits: dict, report: bool) -> dict:
    """Write the code and its stdin beside ``root/work``; the bootstrap's ``main`` argument (written
    beside them by ``_run_child``)."""
    code_path = os.path.join(root, "code.py")
    with open(code_path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(code)
    with open(os.path.join(root, "stdin"), "wb") as f:
        f.write(stdin)
    return {
        **limits,
        "workdir": os.path.join(root, "work"),
        "code_path": code_path,
        "stdin_path": os.path.join(root, "stdin"),
        "parent_pid": os.getpid(),
        "nofile": _MAX_OPEN_FILES,
        "memory_exit": _MEMORY_EXIT,
        "disk_exit": _DISK_EXIT,
        "disk_inodes": _DISK_INODES,
        "report": report,
    }


@functools.lru_cache(maxsize=1)
def _bootstrap_source() -> str:
    return inspect.getsource(sandbox_child)


@functools.lru_cache(maxsize=4)
def _bootstrap_code(parent: str) -> str:
    """The bootstrap compiled once per process, as a marshal file in its sandbox directory:
    compiling 25 kB of source in every sandbox cost about 6 ms of each call. Only the parent
    writes there (the sandbox reads it before it is hardened, and can write nothing outside its
    working directory)."""
    path = os.path.join(parent, "bootstrap.marshal")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(marshal.dumps(compile(_bootstrap_source(), "<string>", "exec")))
    os.replace(tmp, path)
    return path


def _child_env(workdir: str) -> dict[str, str]:
    bindir = os.path.dirname(sys.executable)
    return {
        **_CHILD_ENV,
        "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "MPLCONFIGDIR": os.path.join(workdir, ".matplotlib"),
    }


def _run_child(params: dict, timeout_s: float, max_output_bytes: int) -> SandboxResult:
    """Start the bootstrap with ``params``, supervise it, leave nothing running."""
    params_path = os.path.join(os.path.dirname(params["workdir"]), "params.marshal")
    with open(params_path, "wb") as f:
        f.write(marshal.dumps(params))
    with _BOOT_LOCK:  # the first calls may come from several of the tool's threads at once
        boot = _bootstrap_code(sandbox_parent())
    loader = (
        "import marshal\n"
        f"with open({boot!r}, 'rb') as f: exec(marshal.loads(f.read()))\n"
        f"with open({params_path!r}, 'rb') as f: main(marshal.loads(f.read()))\n"
    )
    argv = [sys.executable, "-s", "-S", "-B", "-c", loader]
    started = time.monotonic()
    with open(params["stdin_path"], "rb") as stdin_file:
        proc = subprocess.Popen(
            argv,
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=params["workdir"],
            env=_child_env(params["workdir"]),
            start_new_session=True,
            close_fds=True,
            umask=0o077,
        )
    pid = proc.pid
    reaped = False
    try:
        out, err, reason = _supervise(proc, started + timeout_s, max_output_bytes)
        _kill_group(pid)  # the leader is not reaped yet, so the group id cannot have been reused
        _, wait_status, rusage = os.wait4(pid, 0)
        reaped = True
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
    finally:
        if not reaped:  # an exception in the parent: still leave nothing behind
            _kill_group(pid)
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            stream.close()
    duration = time.monotonic() - started
    _check_group_gone(pid)
    cpu_used = rusage.ru_utime + rusage.ru_stime
    status, exit_code, message = _classify(
        reason, proc.returncode, cpu_used, params, timeout_s, max_output_bytes
    )
    return SandboxResult(
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        exit_code=exit_code,
        status=status,
        duration_s=duration,
        message=message,
        pid=pid,
    )


def _classify(
    reason: str, rc: int, cpu_used: float, params: dict, timeout_s: float, max_output_bytes: int
) -> tuple[str, int, str]:
    """``(status, exit code, message for the model)`` of a finished run."""
    cpu_s = params["cpu_s"]
    if reason == "output_limit":
        return (
            reason,
            rc,
            f"Error: the output passed {max_output_bytes} bytes; it was cut there and the code was stopped.",
        )
    if reason == "timeout":
        return reason, rc, f"Error: the code ran past its {timeout_s:g} s time limit and was stopped."
    # SIGXCPU at the soft limit; SIGKILL at the hard one if the code ignored SIGXCPU.
    if rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and cpu_used >= cpu_s - 0.05):
        return "cpu_limit", rc, f"Error: the code used its {cpu_s} s of CPU time and was stopped."
    if rc == params["memory_exit"]:
        limit_mb = params["memory_bytes"] // (1024 * 1024)
        return "memory_limit", 1, f"Error: the code ran out of memory (limit {limit_mb} MB)."
    if rc == params["disk_exit"]:
        return (
            "disk_limit",
            1,
            f"Error: the code filled its {_size(params['disk_bytes'])} of disk (files and directories).",
        )
    if rc == 0:
        return "ok", 0, ""
    if rc > 0:
        return "error", rc, f"Error: the code exited with status {rc}."
    return "killed", rc, f"Error: the code was killed by {_signal_name(-rc)}."


def _supervise(proc: subprocess.Popen, deadline: float, max_output_bytes: int) -> tuple[bytes, bytes, str]:
    """Read the child's output until it exits, the deadline passes or the output passes the cap;
    returns (stdout, stderr, "exited" | "timeout" | "output_limit"). The child is not reaped."""
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    total = 0
    reason = ""
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        pidfd = _pidfd_open(proc.pid)
        if pidfd is not None:
            selector.register(pidfd, selectors.EVENT_READ)
        try:
            exited_at = None
            while True:
                now = time.monotonic()
                if exited_at is None and _has_exited(proc.pid):
                    # Kill what is left of the group (nothing, where the process layer holds)
                    # so the pipes close, then drain them.
                    exited_at = now
                    _kill_group(proc.pid)
                    if pidfd is not None:
                        selector.unregister(pidfd)
                if len(selector.get_map()) == 0 or (exited_at is not None and now > exited_at + _DRAIN_S):
                    reason = reason or "exited"
                    break
                if exited_at is None and now >= deadline:
                    reason = "timeout"
                    break
                wait = (deadline if exited_at is None else exited_at + _DRAIN_S) - now
                if pidfd is None and exited_at is None:
                    wait = min(wait, 0.02)
                for key, _ in selector.select(max(wait, 0.0)):
                    if key.fd == pidfd:
                        continue  # handled by _has_exited at the top of the loop
                    data = os.read(key.fd, 65536)
                    if not data:
                        selector.unregister(key.fd)
                        continue
                    room = max_output_bytes - total
                    buffers[key.fd] += data[:room]
                    total += len(data)
                    if total > max_output_bytes:
                        reason = "output_limit"
                if reason == "output_limit":
                    break
        finally:
            if pidfd is not None:
                os.close(pidfd)
    return bytes(buffers[out_fd]), bytes(buffers[err_fd]), reason


def _pidfd_open(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # Python without it, kernel < 5.3
        return None


def _has_exited(pid: int) -> bool:
    """Whether ``pid`` has ended, without reaping it (so its process group id stays reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _check_group_gone(pgid: int) -> None:
    """After the leader is reaped, nothing may be left in its group: kill stragglers (possible
    only where the process layer is missing) for up to a second, then warn."""
    deadline = time.monotonic() + 1.0
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        if time.monotonic() > deadline:  # killed orphans may wait for init to reap them
            logger.warning("sandbox: process group %d still has members after SIGKILL", pgid)
            return
        _kill_group(pgid)
        time.sleep(0.01)


def _size(n: int) -> str:
    return f"{n >> 20} MB" if n % (1 << 20) == 0 else f"{n} bytes"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
