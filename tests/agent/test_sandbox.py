"""run_python: hostile code ends as a status and a message, quickly, and leaves nothing behind.

Every test runs with the sandbox's temporary directory pointed at its own ``tmp_path`` and checks,
afterwards, that the directory is empty, that this process has no new child and no new open file
descriptor (``_no_leftovers``). Tests of a kernel layer on its own (past the audit hook) skip
where ``sandbox_layers()`` says the layer is missing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from sandbox_checks import sandboxes_in

from rlhf_megatron.agent.sandbox import STATUSES, SandboxResult, run_python, sandbox_layers

PROCESSES = "starting processes is not allowed in this sandbox"


@pytest.fixture(autouse=True)
def sandbox_tmp(tmp_path, monkeypatch):
    """The sandboxes' temporary directory for this test; checks nothing is left afterwards."""
    with sandboxes_in(tmp_path, monkeypatch) as root:
        yield root


def _assert_gone(result: SandboxResult) -> None:
    """The sandbox's process group is empty (its leader was the sandbox process)."""
    with pytest.raises(ProcessLookupError):
        os.killpg(result.pid, 0)


def _layer(name: str):
    return sandbox_layers()[name]


needs_landlock = pytest.mark.skipif(
    not _layer("landlock"), reason="Landlock is not available on this kernel (needs Linux >= 5.13)"
)
needs_seccomp = pytest.mark.skipif(
    not _layer("seccomp"), reason="no seccomp filter on this machine (x86_64 and aarch64 only)"
)


# --- code that works ------------------------------------------------------------------------------


def test_stdin_files_and_working_directory():
    code = textwrap.dedent(
        """
        import os, tempfile
        name = input()
        rows = open("data/x.csv").read().split()
        with open("out.txt", "w") as f:          # the working directory is writable
            f.write("written")
        with tempfile.NamedTemporaryFile() as t:  # so is TMPDIR
            t.write(b"x")
        print(name, sum(int(r) for r in rows), open("out.txt").read(), os.getcwd() == os.environ["HOME"])
        """
    )
    result = run_python(code, stdin="alice\n", files={"data/x.csv": "1\n2\n39\n"})
    assert result.status == "ok" and result.ok
    assert result.stdout == "alice 42 written True\n"
    assert result.stderr == "" and result.message == "" and result.exit_code == 0
    _assert_gone(result)


def test_results_are_deterministic():
    # Hash randomisation is off (PYTHONHASHSEED=0): hashes and set order repeat from run to run.
    code = "print(hash('abc'), list({'x', 'y', 'z', 'w'}), sorted({3: 1, 1: 2}))"
    first, second = run_python(code), run_python(code)
    assert first.status == second.status == "ok"
    assert first.stdout == second.stdout


def test_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "hunter2")
    result = run_python("import os; print(sorted(os.environ))")
    assert result.status == "ok"
    assert "SANDBOX_TEST_SECRET" not in result.stdout and "hunter2" not in result.stdout
    assert "'HOME'" in result.stdout and "'PYTHONHASHSEED'" in result.stdout


def test_site_packages_are_importable():
    pytest.importorskip("numpy")
    result = run_python("import numpy as np; print(int(np.arange(10).sum()))")
    assert (result.status, result.stdout) == ("ok", "45\n")
    assert run_python("import numpy", site_packages=False).status == "error"


def test_uncaught_exception_reads_like_python():
    result = run_python("x = 1\nraise ValueError('boom')\n")
    assert result.status == "error" and result.exit_code == 1
    assert result.message == "Error: the code exited with status 1."
    assert 'File "<code>", line 2, in <module>' in result.stderr
    assert result.stderr.endswith("ValueError: boom\n")
    assert "<string>" not in result.stderr  # the bootstrap's frames are not shown


@pytest.mark.parametrize(
    "code, status, exit_code", [("import sys; sys.exit(3)", "error", 3), ("raise SystemExit", "ok", 0)]
)
def test_exit_status(code, status, exit_code):
    result = run_python(code)
    assert (result.status, result.exit_code) == (status, exit_code)


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match="code must be a str"):
        run_python(b"print(1)")
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        run_python("pass", timeout_s=0)
    for name in ("../x", "/etc/x", "a/../../x", ""):
        with pytest.raises(ValueError, match="not a relative path inside the working directory"):
            run_python("pass", files={name: "x"})


def test_concurrent_runs():
    results: list[SandboxResult] = [None] * 8  # type: ignore[list-item]

    def run(i: int) -> None:
        results[i] = run_python(f"print(input() * {i})", stdin="ab")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout for r in results] == [f"{'ab' * i}\n" for i in range(8)]
    assert len({r.pid for r in results}) == 8


def test_layers_report():
    layers = sandbox_layers()
    assert set(layers) == {
        "rlimits",
        "netns",
        "disk_quota",
        "no_new_privs",
        "landlock",
        "seccomp",
        "audit_hook",
    }
    assert layers["rlimits"] is True and layers["audit_hook"] is True


# --- time, memory and output ----------------------------------------------------------------------


def test_infinite_loop_hits_the_cpu_limit():
    result = run_python("while True:\n    pass\n", cpu_s=1, timeout_s=10)
    assert result.status == "cpu_limit" and result.exit_code == -signal.SIGXCPU
    assert result.message == "Error: the code used its 1 s of CPU time and was stopped."
    assert result.duration_s < 5
    _assert_gone(result)


def test_sleeping_forever_hits_the_wall_clock():
    result = run_python("print('started')\nimport time\ntime.sleep(600)\n", timeout_s=0.5)
    assert result.status == "timeout" and result.exit_code == -signal.SIGKILL
    assert result.message == "Error: the code ran past its 0.5 s time limit and was stopped."
    assert result.stdout == "started\n"  # what was printed before the deadline is kept
    assert 0.5 <= result.duration_s < 3
    _assert_gone(result)


@pytest.mark.parametrize(
    "code",
    [
        "x = bytearray(10 * 1024**3)",  # 10 GB at once
        "chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 1024**2))",  # growing
    ],
    ids=["10GB", "growing"],
)
def test_memory_bombs_hit_the_memory_limit(code):
    result = run_python(code, memory_mb=256)
    assert result.status == "memory_limit" and result.exit_code == 1
    assert result.message == "Error: the code ran out of memory (limit 256 MB)."
    assert "MemoryError" in result.stderr
    assert result.duration_s < 5
    _assert_gone(result)


@pytest.mark.parametrize(
    "code", ["while True:\n    print('x' * 1000)", "print('x' * 10**7)"], ids=["stream", "one-write"]
)
def test_huge_output_is_cut(code):
    result = run_python(code, max_output_bytes=10_000)
    assert result.status == "output_limit"
    assert (
        result.message == "Error: the output passed 10000 bytes; it was cut there and the code was stopped."
    )
    assert len(result.stdout) + len(result.stderr) <= 10_000
    assert result.stdout.startswith("x" * 1000)
    assert result.duration_s < 5
    _assert_gone(result)


def test_thread_bomb_ends_in_an_error():
    code = "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()"
    result = run_python(code, timeout_s=10)
    assert result.status == "error"
    assert "can't start new thread" in result.stderr
    assert result.duration_s < 5
    _assert_gone(result)


def test_a_crash_is_reported_as_killed():
    result = run_python("import faulthandler\nfaulthandler.disable()\nfaulthandler._sigsegv()")
    assert result.status == "killed" and result.exit_code == -signal.SIGSEGV
    assert result.message == "Error: the code was killed by SIGSEGV."


def test_killing_its_own_group_is_reported_as_killed():
    result = run_python("import os, signal\nos.killpg(0, signal.SIGKILL)")
    assert result.status == "killed" and result.message == "Error: the code was killed by SIGKILL."
    _assert_gone(result)


# --- processes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, message",
    [
        ("import os\nos.fork()", PROCESSES),
        ("import os\nwhile True:\n    os.fork()", PROCESSES),  # a fork bomb
        ("import subprocess\nsubprocess.run(['echo', 'hi'])", PROCESSES),
        ("import os\nos.system('echo hi')", PROCESSES),
        ("import os\nos.execv('/bin/echo', ['echo', 'hi'])", PROCESSES),
        ("import multiprocessing as mp\np = mp.Process(target=print)\np.start()\np.join()", PROCESSES),
        # Its semaphore (in /dev/shm) is refused before it gets to fork, where Landlock holds.
        (
            "import concurrent.futures as cf\nwith cf.ProcessPoolExecutor(2) as ex:\n    list(ex.map(abs, [-1]))",
            "",
        ),
    ],
    ids=["fork", "fork-bomb", "subprocess", "os.system", "exec", "multiprocessing", "process-pool"],
)
def test_processes_are_refused(code, message):
    result = run_python(code)
    assert result.status == "error" and result.exit_code == 1
    assert f"PermissionError: {message}" in result.stderr
    assert "hi" not in result.stdout
    assert result.duration_s < 5
    _assert_gone(result)


@needs_seccomp
def test_fork_past_the_audit_hook_is_stopped_by_seccomp():
    # _posixsubprocess.fork_exec raises no audit event: only the seccomp filter stands here.
    code = textwrap.dedent(
        """
        import _posixsubprocess, os
        r, w = os.pipe()
        try:
            _posixsubprocess.fork_exec([b"/bin/true"], [b"/bin/true"], True, (w,), None, None,
                -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None, False)
        except OSError as e:
            print("refused", e.errno)
        """
    )
    result = run_python(code)
    assert (result.status, result.stdout) == ("ok", "refused 1\n")  # EPERM


# --- files ----------------------------------------------------------------------------------------


@pytest.fixture
def outside(tmp_path):
    """A directory outside the sandbox with one file the code must not change."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "keep.txt").write_text("original")
    yield path
    assert sorted(p.name for p in path.iterdir()) == ["keep.txt"]
    assert (path / "keep.txt").read_text() == "original"


@pytest.mark.parametrize(
    "code, message",
    [
        ("open({out!r} + '/evil', 'w').write('x')", "writing outside the working directory is not allowed"),
        (
            "open({out!r} + '/keep.txt', 'a').write('x')",
            "writing outside the working directory is not allowed",
        ),
        (
            "import os\nos.remove({out!r} + '/keep.txt')",
            "os.remove outside the working directory is not allowed",
        ),
        ("import os\nos.rename({out!r} + '/keep.txt', 'stolen')", "os.rename outside the working directory"),
        (
            "import shutil\nshutil.rmtree({out!r})",
            "shutil.rmtree outside the working directory is not allowed",
        ),
        ("import os\nos.mkdir({out!r} + '/d')", "os.mkdir outside the working directory is not allowed"),
        ("import os\nos.chmod({out!r} + '/keep.txt', 0o777)", "changing file permissions"),
        # A relative path that climbs out of the working directory.
        (
            "import os\nrel = os.path.relpath({out!r}, os.getcwd())\nopen(rel + '/evil', 'w')",
            "writing outside",
        ),
        # Symlinks: to the outside directory, and a relative one that climbs out.
        ("import os\nos.symlink({out!r}, 'link')\nopen('link/evil', 'w')", "a symlink pointing outside"),
        ("import os\nos.symlink('../../../outside', 'link')", "a symlink pointing outside"),
    ],
    ids=[
        "create",
        "append",
        "remove",
        "rename",
        "rmtree",
        "mkdir",
        "chmod",
        "dotdot",
        "symlink",
        "symlink-dotdot",
    ],
)
def test_writes_outside_are_refused(outside, code, message):
    result = run_python(code.format(out=str(outside)))
    assert result.status == "error", result
    assert message in result.stderr
    _assert_gone(result)


@needs_landlock
@pytest.mark.parametrize(
    "code",
    [
        # The audit hook resolves open()'s path against the working directory, not dir_fd.
        "import os\nfd = os.open({out!r}, os.O_RDONLY)\nos.open('evil', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
        "import os\nfd = os.open({out!r}, os.O_RDONLY)\nos.open('keep.txt', os.O_WRONLY | os.O_TRUNC, dir_fd=fd)",
        # Symlinks the hook checks lexically (each points inside), chained to climb out: u is the
        # working directory, x the directory below `outside`'s parent on the way up (at most four
        # levels above the working directory, lexically still inside), so x/../outside is `outside`.
        textwrap.dedent(
            """
            import os
            up = len(os.path.relpath(os.getcwd(), os.path.dirname({out!r})).split("/")) - 1
            assert up <= 4, up
            os.makedirs("d1/d2/d3")
            os.symlink("../../..", "d1/d2/d3/u")
            os.symlink("d1/d2/d3/u" + "/.." * up, "x")
            assert os.path.realpath("x/../outside") == {out!r}
            open("x/../outside/evil", "w")
            """
        ),
    ],
    ids=["create-dir_fd", "truncate-dir_fd", "symlink-chain"],
)
def test_writes_past_the_audit_hook_are_stopped_by_landlock(outside, code):
    result = run_python(code.format(out=str(outside)))
    assert result.status == "error"
    assert "PermissionError: [Errno 13] Permission denied" in result.stderr


def test_files_the_code_writes_are_bounded():
    result = run_python("open('big', 'wb').write(b'x' * 2_000_000)", max_file_bytes=1_000_000)
    assert result.status == "error" and "File too large" in result.stderr


# --- network, secrets, signals --------------------------------------------------------------------


@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.socket()",
        "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
        "import socket\nsocket.socket(socket.AF_UNIX)",
        "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)",
    ],
    ids=["socket", "tcp", "unix", "urllib"],
)
def test_network_is_refused(code):
    result = run_python(code)
    assert result.status == "error"
    assert "network access is not allowed in this sandbox" in result.stderr
    assert result.duration_s < 5


def test_ctypes_is_refused():
    result = run_python("import ctypes\nctypes.CDLL(None).fork()")
    assert result.status == "error" and "ctypes is not allowed in this sandbox" in result.stderr


@needs_landlock
def test_the_parents_environment_cannot_be_read(monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "hunter2")
    result = run_python("import os\nprint(open(f'/proc/{os.getppid()}/environ', 'rb').read())")
    assert result.status == "error" and "Permission denied" in result.stderr
    assert "hunter2" not in result.stdout + result.stderr


def test_the_parent_cannot_be_signalled():
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(True))
    try:
        result = run_python("import os, signal\nos.kill(os.getppid(), signal.SIGUSR1)")
        time.sleep(0.05)  # a signal that got through would have been handled by now
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert result.status == "error"
    assert "signalling other processes is not allowed in this sandbox" in result.stderr
    assert received == []


def test_the_sandbox_dies_with_its_parent(tmp_path):
    """PR_SET_PDEATHSIG: a trainer killed mid-call takes its sandbox with it."""
    script = tmp_path / "parent.py"
    script.write_text(
        "from rlhf_megatron.agent.sandbox import run_python\n"
        "run_python('import time; time.sleep(600)', timeout_s=600)\n"
    )
    parent_tmp = tmp_path / "parent-tmp"
    parent_tmp.mkdir()
    parent = subprocess.Popen([sys.executable, str(script)], env={**os.environ, "TMPDIR": str(parent_tmp)})
    try:
        sandbox = _wait_for_child(parent.pid, timeout_s=20)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5
    while _alive(sandbox) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(sandbox)
    # A parent killed by SIGKILL cannot remove its sandbox's directory; the next process that runs
    # a sandbox there removes it first.
    base = parent_tmp / f"rlhf-sandboxes-{os.getuid()}"
    [left] = base.iterdir()
    assert left.name.startswith(f"{parent.pid}-") and sorted(p.name[:5] for p in left.iterdir()) == [
        "boots",
        "call-",
    ]
    subprocess.run(
        [sys.executable, "-c", "from rlhf_megatron.agent.sandbox import run_python; run_python('pass')"],
        env={**os.environ, "TMPDIR": str(parent_tmp)},
        check=True,
        timeout=60,
    )
    assert list(base.iterdir()) == []  # swept, and the second process removed its own at exit


def _wait_for_child(pid: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                            return int(entry)
                except (OSError, IndexError, ValueError):
                    continue
        time.sleep(0.05)
    raise AssertionError(f"process {pid} started no sandbox within {timeout_s} s")


def _alive(pid: int) -> bool:
    """Running, not a zombie (the sandbox's zombie is init's to reap once its parent is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_statuses_are_documented():
    assert set(STATUSES) == {
        "ok",
        "error",
        "timeout",
        "cpu_limit",
        "memory_limit",
        "output_limit",
        "disk_limit",
        "killed",
    }
