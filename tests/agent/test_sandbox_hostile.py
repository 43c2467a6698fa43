"""The hostile suite: what model-written code and text try, and what the model gets back.

Each case is one thing a policy under RL could learn to do: read the training answers, another
trajectory's files, the checkout, ``/tmp`` or ``$HOME``; grow a tree 1,100 directories deep or
fill the disk; fork, thread, spawn or daemonise; open sockets; signal the trainer; load libc;
read the trainer's environment; tamper with the audit hook; or send tool calls that are nested
5,000 deep, carry 5,000-digit numbers, control characters or lone surrogates. Every case asserts
the status (or ``Error: ...`` text) the model gets, and the fixture asserts the host is untouched:
the answers file and the checkout unchanged, no sandbox directory, process or file descriptor
left. ``docs/guides/agents.md`` has the table of what each layer stops, checked against this
file. Cases of one kernel layer skip where ``sandbox_layers()`` says it is missing.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sandbox_checks import sandboxes_in

from rlhf_megatron.agent import ToolConfigError
from rlhf_megatron.agent.calls import MAX_CALL_CHARS, parse_hermes, run_tool_call
from rlhf_megatron.agent.loop import ToolAgentLoop, Trajectory
from rlhf_megatron.agent.sandbox import (
    REQUIRED_LAYERS,
    missing_layers,
    run_python,
    sandbox_layers,
    sandbox_parent,
)
from rlhf_megatron.agent.sandbox_dirs import remove_tree
from rlhf_megatron.agent.schemas import OpenAIFunctionCallSchema, OpenAIFunctionParsedSchema
from rlhf_megatron.agent.tools import CodeInterpreterTool
from rlhf_megatron.agent.tools import code_interpreter as code_interpreter_module
from rlhf_megatron.agent.tools.calculator import CalculatorTool
from rlhf_megatron.data.tokenizer import build_tiny_tokenizer

CHECKOUT = Path(__file__).resolve().parents[2]
LAYERS = sandbox_layers()
needs_landlock = pytest.mark.skipif(not LAYERS["landlock"], reason="Landlock is not available on this kernel")
needs_quota = pytest.mark.skipif(
    not LAYERS["disk_quota"], reason="no mount namespace here (needs root or user namespaces)"
)
DENIED = "PermissionError: [Errno 13] Permission denied"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def host(tmp_path, monkeypatch):
    """Paths the code must not read, and the checks that nothing on the host changed."""
    answers = tmp_path / "outputs" / "data" / "tool_mult" / "train.parquet"
    answers.parent.mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["82*57"], "ground_truth": ["4674"]}), answers)
    in_tmp = Path(tempfile.mkstemp(prefix="hostile-", dir="/tmp")[1])
    in_tmp.write_text("tmp secret 4674")
    in_home = Path(tempfile.mkstemp(prefix=".hostile-", dir=Path.home())[1])
    in_home.write_text("home secret 4674")
    watched = [answers, in_tmp, in_home, CHECKOUT / "README.md"]
    before = {p: (_digest(p), p.stat().st_mtime_ns) for p in watched}
    paths = {
        "answers": str(answers),
        "tmp": str(in_tmp),
        "home": str(in_home),
        "readme": str(CHECKOUT / "README.md"),
        "checkout": str(CHECKOUT),
        "data_dir": str(answers.parent),
    }
    try:
        with sandboxes_in(tmp_path, monkeypatch):
            yield paths
            assert {p: (_digest(p), p.stat().st_mtime_ns) for p in watched} == before, "a host file changed"
    finally:
        in_tmp.unlink()
        in_home.unlink()


# --- 1. reads: only the interpreter, the named site-packages and its own directory ---------------

READS = {
    "answers-open": "print(open({answers!r}, 'rb').read()[:8])",
    "answers-pyarrow": "import pyarrow.parquet as pq\nprint(pq.read_table({answers!r}).to_pylist())",
    "answers-dir-listing": "import os\nprint(os.listdir({data_dir!r}))",
    "checkout-file": "print(open({readme!r}).read()[:50])",
    "checkout-listing": "import os\nprint(os.listdir({checkout!r}))",
    "tmp-file": "print(open({tmp!r}).read())",
    "tmp-listing": "import os\nprint(os.listdir('/tmp'))",
    "home-file": "print(open({home!r}).read())",
    "home-listing": "import os\nprint(os.listdir('/root'))",
    "root-listing": "import os\nprint(os.listdir('/'))",
    "etc-passwd": "print(open('/etc/passwd').read())",
    "parent-environ": "import os\nprint(open(f'/proc/{{os.getppid()}}/environ', 'rb').read())",
    "parent-cmdline": "import os\nprint(open(f'/proc/{{os.getppid()}}/cmdline', 'rb').read())",
    "proc-self-root": "print(open('/proc/self/root' + {answers!r}, 'rb').read()[:8])",
    "hardlink-answers": "import os\nos.link({answers!r}, 'a.parquet')\nprint(open('a.parquet', 'rb').read()[:8])",
    "dir-fd-escape": "import os\nfd = os.open({data_dir!r}, os.O_RDONLY)\nprint(os.listdir(fd))",
    "pathlib-read": "import pathlib\nprint(pathlib.Path({tmp!r}).read_text())",
}


@needs_landlock
@pytest.mark.parametrize("code", list(READS.values()), ids=list(READS))
def test_reads_outside_the_work_directory_are_refused(host, code):
    result = run_python(code.format(**host))
    assert result.status == "error", result
    assert "Permission denied" in result.stderr or "not allowed in this sandbox" in result.stderr, (
        result.stderr
    )
    assert "4674" not in result.stdout and "secret" not in result.stdout


@needs_landlock
def test_reads_of_another_trajectory_are_refused(host):
    """A concurrent call's code, stdin and files (in another sandbox's directory) stay unreadable."""
    other: list = []
    first = threading.Thread(
        target=lambda: other.append(
            run_python("import time\ntime.sleep(3)", files={"answer.txt": "4674"}, timeout_s=10)
        )
    )
    first.start()
    try:
        deadline = time.monotonic() + 10
        calls = []
        while not calls and time.monotonic() < deadline:
            calls = [n for n in os.listdir(sandbox_parent()) if n.startswith("call-")]
            time.sleep(0.01)
        [call] = calls
        root = os.path.join(sandbox_parent(), call)
        code = textwrap.dedent(
            f"""
            import os
            for path in ({root + "/code.py"!r}, {root + "/work/answer.txt"!r}, {root + "/stdin"!r}):
                try:
                    print(open(path).read())
                except PermissionError as err:
                    print("refused", err.errno)
            os.listdir({sandbox_parent()!r})
            """
        )
        result = run_python(code)
    finally:
        first.join()
    assert result.stdout.split("\n")[:3] == ["refused 13"] * 3, result
    assert result.status == "error" and DENIED in result.stderr
    assert other[0].status == "ok"


def test_what_the_code_needs_stays_readable(host):
    """The standard library, the named site-packages and the call's own files."""
    code = textwrap.dedent(
        """
        import json, sqlite3, decimal, zoneinfo, time, os
        import numpy
        print(open('given.txt').read(), numpy.arange(4).sum(), os.cpu_count() > 0, time.localtime().tm_year > 2000)
        print(sorted(os.listdir('.')))
        """
    )
    result = run_python(code, files={"given.txt": "hello"})
    assert result.status == "ok", result.stderr
    assert result.stdout.splitlines() == ["hello 6 True True", "['given.txt']"]


@needs_landlock
def test_site_packages_not_named_are_unreadable(host):
    """The base interpreter's site-packages (this machine's global packages: pyenv's
    ``lib/python3.X/site-packages``, Debian's ``/usr/lib/python3/dist-packages``) is not named: it
    reads as empty (covered by an empty tmpfs), not at all (no mount namespace) or as absent (a
    directory under ``/usr/local/lib`` the sandbox's view leaves out)."""
    listed = subprocess.run(
        [sys._base_executable, "-c", "import site, sysconfig; print(*site.getsitepackages(), sep='\\n')"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    purelib = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})["purelib"]
    found = [Path(d) for d in [purelib, *listed] if Path(d).is_dir() and any(Path(d).iterdir())]
    found = [d for d in found if str(d) not in sys.path]
    if not found:
        pytest.skip(
            f"the base interpreter's site-packages ({[purelib, *listed]}) are empty or this environment's"
        )
    for base in found:
        code = (
            f"import os\ntry:\n    print(os.listdir({str(base)!r}))\n"
            "except PermissionError:\n    print('refused')\nexcept FileNotFoundError:\n    print('absent')"
        )
        result = run_python(code)
        assert result.status == "ok" and result.stdout in ("[]\n", "refused\n", "absent\n"), (base, result)


def test_site_packages_can_be_withheld(host):
    result = run_python("import numpy", site_packages=False)
    assert result.status == "error" and "ModuleNotFoundError" in result.stderr


# --- 2. the disk: deep trees, big writes, odd permissions ------------------------------------------

DEEP = "import os\nfor _ in range({n}):\n    os.mkdir({name!r})\n    os.chdir({name!r})\nopen('leaf', 'w').write('x')\nprint('deep')"


@pytest.mark.parametrize(
    "code",
    [
        DEEP.format(n=1100, name="d"),
        "import os\nos.mkdir('locked', 0)\nos.mkdir('ro', 0o500)\nopen('f', 'w').close()\nprint('deep')",
    ],
    ids=["1100-deep", "mode-0-and-read-only-dirs"],
)
def test_trees_are_results_and_leave_nothing(host, code):
    result = run_python(code)
    assert result.status == "ok" and result.stdout == "deep\n", result


def test_a_tree_past_path_max_is_a_result(host):
    """Past PATH_MAX the audit hook cannot tell where the code is, so it refuses (a result the
    model reads, not an exception in the trainer) and what was made is removed."""
    result = run_python(DEEP.format(n=40, name="n" * 255))
    assert result.status == "error", result
    assert "outside the working directory is not allowed" in result.stderr


@needs_quota
@pytest.mark.parametrize(
    "code",
    [
        "for i in range(20):\n    open(f'f{i}', 'wb').write(b'x' * (15 << 20))",
        "import os\nfor i in range(100000):\n    os.mkdir(f'd{i}')",
        "try:\n    open('a', 'wb').write(b'x' * (60 << 20))\n    open('b', 'wb').write(b'x' * (60 << 20))\n"
        "except OSError as e:\n    print('caught', e.errno)",
    ],
    ids=["many-big-files", "inode-exhaustion", "caught-and-ignored"],
)
def test_filling_the_disk_is_its_own_status(host, code):
    result = run_python(code, max_file_bytes=64 << 20, max_disk_bytes=64 << 20, timeout_s=30, cpu_s=30)
    assert result.status == "disk_limit", result
    assert result.message.startswith("Error: the code filled its 64 MB of disk")


def test_one_file_past_its_limit_is_an_error(host):
    result = run_python("open('f', 'wb').write(b'x' * (2 << 20))", max_file_bytes=1 << 20)
    assert result.status == "error" and "File too large" in result.stderr


def test_removal_never_recurses_nor_raises(tmp_path):
    """The parent's remover (the fallback where the tmpfs is missing, and the sweep) on a tree
    deeper than Python's recursion limit, with mode-0 and read-only directories and symlinks."""
    root = tmp_path / "tree"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY)
    try:
        for i in range(3000):
            os.mkdir("d", dir_fd=fd)
            if i % 500 == 0:
                os.symlink(str(tmp_path), "up", dir_fd=fd)  # must not be followed
                with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o400, dir_fd=fd), "w") as f:
                    f.write("x" * 100)
            new = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = new
    finally:
        os.close(fd)
    os.chmod(root / "d", 0o500)
    keep = tmp_path / "keep"
    keep.write_text("still here")
    assert remove_tree(str(root)) > 0
    assert not root.exists() and keep.read_text() == "still here"
    assert remove_tree(str(root)) == 0  # gone already: nothing, no exception


# --- 3. processes, network, signals, ctypes, the environment ----------------------------------------

CONTAINED = {
    "fork-bomb": ("import os\nwhile True:\n    os.fork()", "starting processes is not allowed"),
    "subprocess": ("import subprocess\nsubprocess.run(['sh', '-c', 'echo hi'])", "starting processes"),
    "double-fork-daemon": (
        "import os\nos.posix_spawn('/bin/sleep', ['sleep', '600'], {{}})",
        "starting processes",
    ),
    "multiprocessing": (
        "import multiprocessing as mp\np = mp.Process(target=print)\np.start()",
        "starting processes",
    ),
    "os-system": ("import os\nos.system('touch /tmp/pwned')", "starting processes"),
    "socket-loopback": (
        "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
        "network access is not allowed",
    ),
    "socket-unix": ("import socket\ns = socket.socket(socket.AF_UNIX)\ns.bind('s')", "network access"),
    "raw-_socket": ("import _socket\n_socket.socket()", "network access"),
    "signal-parent": (
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
        "signalling other processes",
    ),
    "signal-init": ("import os, signal\nos.kill(1, signal.SIGTERM)", "signalling other processes"),
    "ctypes-libc": ("import ctypes\nctypes.CDLL(None).fork()", "ctypes is not allowed"),
    "chmod": ("import os\nos.chmod('.', 0o777)", "changing file permissions"),
    "setrlimit": (
        "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
        "changing resource limits",
    ),
    "settrace": ("import sys\nsys.settrace(lambda *a: None)", "sys.settrace is not allowed"),
    "gc-walk": ("import gc\ngc.get_referrers(print)", "gc.get_referrers is not allowed"),
}


@pytest.mark.parametrize(("code", "message"), list(CONTAINED.values()), ids=list(CONTAINED))
def test_processes_network_signals_and_libc_are_refused(host, code, message):
    result = run_python(code.format(), timeout_s=10)
    assert result.status == "error", result
    assert message in result.stderr, result.stderr
    assert not os.path.exists("/tmp/pwned")


def test_a_thread_bomb_ends_as_an_error(host):
    # Silent threads: ones that print (say, ``target=input`` failing on the closed stdin) may reach
    # the output limit first, which is contained too but not what this test is about.
    code = "import threading\ne = threading.Event()\nwhile True:\n    threading.Thread(target=e.wait, daemon=True).start()"
    result = run_python(code)
    assert result.status in ("error", "memory_limit"), result
    assert result.status == "memory_limit" or "can't start new thread" in result.stderr, result


def test_the_trainers_secrets_are_not_in_the_environment(host, monkeypatch):
    for key in ("HF_TOKEN", "WANDB_API_KEY", "RAY_ADDRESS", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "hunter2")
    result = run_python("import os\nprint(sorted(os.environ))\nprint(os.environ)")
    assert result.status == "ok" and "hunter2" not in result.stdout
    assert "HF_TOKEN" not in result.stdout and "RAY_ADDRESS" not in result.stdout


# --- 4. tampering with the audit hook --------------------------------------------------------------

TAMPER = textwrap.dedent(
    """
    import os
    try:
        os.chmod('.', 0o777)
    except PermissionError as err:
        tb = err.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        frame = tb.tb_frame  # the audit hook's own frame
    names = frame.f_code.co_freevars
    print("hook frame reached:", "refused" in names and "writes" in names)
    for name, value in frame.f_locals.items():
        for attempt in ("clear", "popitem"):
            try:
                getattr(value, attempt)()
                print("cleared", name)
            except (AttributeError, TypeError, KeyError):
                pass
        if callable(value) and hasattr(value, "__code__"):
            try:
                value.__code__ = (lambda *a, **k: True).__code__
                print("replaced", name)
            except PermissionError as err:
                print("refused:", err)
    open({outside!r}, "w").write("pwned")
    """
)


def test_the_audit_hooks_tables_cannot_be_cleared(host):
    outside = os.path.join(host["data_dir"], "pwned.txt")
    result = run_python(TAMPER.format(outside=outside))
    assert "hook frame reached: True" in result.stdout, result
    assert "cleared" not in result.stdout and "replaced" not in result.stdout
    assert "changing the sandbox's own checks is not allowed" in result.stdout
    assert (
        result.status == "error" and "writing outside the working directory is not allowed" in result.stderr
    )
    assert not os.path.exists(outside)


def test_a_second_audit_hook_does_not_lift_the_first(host):
    result = run_python("import sys, os\nsys.addaudithook(lambda *a: None)\nos.chmod('.', 0o777)")
    assert result.status == "error" and "changing file permissions" in result.stderr


# --- 5. no weaker sandbox without asking --------------------------------------------------------------


@pytest.mark.parametrize("layer", REQUIRED_LAYERS)
def test_the_tool_refuses_a_missing_layer_unless_allowed(host, monkeypatch, layer):
    weaker = {**LAYERS, layer: 0 if layer == "landlock" else False}
    monkeypatch.setattr(code_interpreter_module, "sandbox_layers", lambda: weaker)
    with pytest.raises(ToolConfigError) as err:
        CodeInterpreterTool({"type": "native"})
    message = str(err.value)
    named = message.split("allow_missing_layers: [", 1)[1].split("]", 1)[0].split(", ")
    assert "not available on this machine" in message and layer in named  # the others this machine lacks
    tool = CodeInterpreterTool(
        {"type": "native", "allow_missing_layers": sorted({layer, *missing_layers(LAYERS)})}
    )
    assert layer in code_interpreter_module.describe_layers(tool.layers).split("missing: ")[1].split(", ")
    tool.close()


def test_an_unknown_layer_name_is_refused(host):
    with pytest.raises(ToolConfigError, match="unknown layer"):
        CodeInterpreterTool({"type": "native", "allow_missing_layers": ["landlok"]})


# --- 6. malformed tool calls: answered, never raised -------------------------------------------------

HOSTILE_CALLS = {
    "nested-5000": ("<tool_call>" + "[" * 5000 + "</tool_call>", "nested too deeply"),
    "nested-object-5000": ("<tool_call>" + '{"a":' * 5000 + "</tool_call>", "nested too deeply"),
    "nested-args-100": (
        '<tool_call>{"name": "calculator", "arguments": {"expression": '
        + "[" * 100
        + "]" * 100
        + "}}</tool_call>",
        "nested too deeply",
    ),
    "digits-5000": (
        '<tool_call>{"name": "calculator", "arguments": {"expression": ' + "9" * 5000 + "}}</tool_call>",
        "cannot be read",
    ),
    "huge": ("<tool_call>" + " " * (MAX_CALL_CHARS + 1) + "{}</tool_call>", "characters long"),
    "lone-surrogate": (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "\\ud800"}}</tool_call>',
        "lone surrogate",
    ),
    "control-in-json": (
        '<tool_call>{"name": "calc\x00ulator", "arguments": {}}</tool_call>',
        "not valid JSON",
    ),
    "unclosed": ('<tool_call>{"name": "calculator"', "no closing </tool_call>"),
}


@pytest.mark.parametrize(("text", "message"), list(HOSTILE_CALLS.values()), ids=list(HOSTILE_CALLS))
def test_hostile_tool_call_text_is_an_error_for_the_model(text, message):
    content, calls, errors = parse_hermes("before " + text + " after")
    assert calls == [] and len(errors) == 1 and errors[0].startswith("Error: tool call 1")
    assert message in errors[0], errors[0]
    assert len(errors[0]) < 400


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (OpenAIFunctionParsedSchema(name="calculator", arguments="[" * 5000), "are not a JSON object"),
        (
            OpenAIFunctionParsedSchema(name="calculator", arguments='{"expression": ' + "1" * 5000 + "}"),
            "not a JSON",
        ),
        (
            OpenAIFunctionCallSchema(name="no\x1bsuch\ud800tool", arguments={}),
            "unknown tool 'no\\x1bsuch\\ud800tool'",
        ),
        (
            OpenAIFunctionCallSchema(name="calculator", arguments={"expression": "1+" * 300_000 + "1"}),
            "Error:",
        ),
        (
            OpenAIFunctionCallSchema(name="calculator", arguments={"x\x00" * 1000: 1, "expression": "1"}),
            "unknown argument 'x\\x00",
        ),
    ],
    ids=["nested-5000", "digits-5000", "unknown-with-controls", "huge-expression", "control-arg-name"],
)
def test_run_tool_call_answers_hostile_arguments(call, message):
    tool = CalculatorTool({}, None)
    response, reward, _, status = asyncio.run(run_tool_call(tool, "i", call, timeout_s=5))
    assert status == "error" and reward is None
    assert message in response.text and response.text.startswith("Error:")
    assert len(response.text) < 400


def test_the_loop_counts_hostile_turns_and_finishes_the_batch():
    """Through ``ToolAgentLoop``: each hostile turn becomes an error response the model sees,
    counted in ``tool_errors`` (``tool_calls/error_rate``), and every sample reaches its end."""
    tok = build_tiny_tokenizer(["<tool_call>", "</tool_call>"])
    turns = [text for text, _ in HOSTILE_CALLS.values() if len(text) < 20_000]
    prompts = [
        tok.encode(f"<|user|>q{i}</s><|assistant|>", add_special_tokens=False) for i in range(len(turns))
    ]
    done = {i: False for i in range(len(turns))}

    def generate(requests):
        outs = []
        for ids, _, _ in requests:
            i = next(k for k, p in enumerate(prompts) if ids[: len(p)] == p)
            text = "the end" if done[i] else turns[i]
            done[i] = True
            new = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            outs.append((new, [-0.5] * len(new), "stop"))
        return outs

    loop = ToolAgentLoop(tok, [CalculatorTool({}, None)], {}, 60_000)
    trajectories = [
        Trajectory(prompt_ids=list(p), messages=[{"role": "user", "content": "q"}]) for p in prompts
    ]
    loop.run(trajectories, generate)
    assert [t.end for t in trajectories] == ["stop"] * len(turns)
    assert [(t.tool_calls, t.tool_errors) for t in trajectories] == [(1, 1)] * len(turns)
    for t in trajectories:
        tool_turn = tok.decode([i for i, m in zip(t.response_ids, t.response_mask) if m == 0])
        assert "<tool_response>Error: " in tool_turn


@needs_landlock
def test_reads_stay_refused_with_one_rule_per_entry(host, monkeypatch):
    """Where the left-out directories cannot be covered (no mount namespace, or a mount that
    fails), the bootstrap falls back to one Landlock rule per allowed entry: same answers."""
    from rlhf_megatron.agent import sandbox

    real = sandbox.read_rules

    def uncoverable(site_dirs):
        return {**real(site_dirs), "hide": ["/nonexistent/cannot-be-covered"]}

    monkeypatch.setattr(sandbox, "read_rules", uncoverable)
    for key in ("answers-open", "tmp-file", "checkout-listing"):
        result = run_python(READS[key].format(**host))
        assert result.status == "error" and "Permission denied" in result.stderr, (key, result)
    result = run_python("import os, numpy\nprint(numpy.ones(2).sum(), len(os.listdir('/usr/lib')) > 0)")
    assert result.status == "error" and "Permission denied: '/usr/lib'" in result.stderr  # entries only
    result = run_python("import numpy, json\nprint(numpy.ones(2).sum())")
    assert result.status == "ok" and result.stdout == "2.0\n", result
