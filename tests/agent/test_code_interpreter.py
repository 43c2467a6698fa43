"""CodeInterpreterTool through ``run_tool_call``, as the agent loop calls it.

Hostile code must come back as an ``Error: ...`` response with status ``error`` (the loop adds
that status to ``tool_errors``; code out of time gets ``timeout``, added to ``tool_timeouts``),
quickly, leaving no process, directory or file descriptor behind; the tool's thread pool bounds
how many sandboxes run at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path

import pytest
from sandbox_checks import sandboxes_in

from rlhf_megatron.agent import OpenAIFunctionCallSchema, ToolConfigError, load_tools, run_tool_call
from rlhf_megatron.agent.sandbox import sandbox_layers
from rlhf_megatron.agent.tools import CodeInterpreterTool
from rlhf_megatron.agent.tools import code_interpreter as code_interpreter_module

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tools" / "code_interpreter.yaml"


@pytest.fixture(autouse=True)
def sandbox_tmp(tmp_path, monkeypatch):
    """The sandboxes' temporary directory for this test; nothing may be left in it afterwards."""
    with sandboxes_in(tmp_path, monkeypatch) as root:
        yield root


# Layers this machine lacks (none as root on Linux >= 5.13, x86_64): the tests of the tool's
# behaviour accept them; tests/agent/test_sandbox_hostile.py tests the refusal itself.
MISSING = code_interpreter_module.missing_layers()
needs_every_layer = pytest.mark.skipif(bool(MISSING), reason=f"sandbox layers missing here: {MISSING}")


def _tool(**config) -> CodeInterpreterTool:
    base = {"type": "native", "default_timeout": 5, "memory_limit_mb": 512, "allow_missing_layers": MISSING}
    return CodeInterpreterTool({**base, **config})


def _call(code: str) -> OpenAIFunctionCallSchema:
    return OpenAIFunctionCallSchema(name="code_interpreter", arguments={"code": code})


async def _run(tool, code, instance_id="i", timeout_s=30.0):
    return await run_tool_call(tool, instance_id, _call(code), timeout_s=timeout_s)


def _once(tool, code, **kwargs):
    """One call on a fresh event loop; the tool's pool is drained before returning."""
    try:
        return asyncio.run(_run(tool, code, **kwargs))
    finally:
        tool.close()


# --- the tool and its config ----------------------------------------------------------------------


@needs_every_layer
def test_config_file_loads_through_load_tools():
    [tool] = load_tools(CONFIG)
    assert isinstance(tool, CodeInterpreterTool)
    assert tool.name == "code_interpreter"
    assert tool.tool_schema.function.parameters.required == ["code"]
    assert (tool.timeout_s, tool.cpu_s, tool.memory_mb, tool.max_output_bytes, tool.num_workers) == (
        10.0,
        10.0,
        1024,
        16384,
        10,
    )
    response, reward, metrics, status = _once(tool, "print(6 * 7)")
    assert (response.text, reward, status) == ("42", 0.0, "ok")
    assert metrics["status"] == "ok" and metrics["latency_s"] > 0


def test_defaults_without_config_or_schema():
    tool = CodeInterpreterTool({"allow_missing_layers": MISSING})
    assert tool.name == "code_interpreter" and tool.timeout_s == tool.cpu_s == 10.0
    assert tool.memory_mb == 1024 and tool.num_workers == 10
    tool.close()


@pytest.mark.parametrize(
    "config, message",
    [
        ({"memory_limit_mb": 0}, "config.memory_limit_mb must be a positive number, got 0"),
        ({"default_timeout": "10"}, "config.default_timeout must be a positive number, got '10'"),
        ({"num_workers": -1}, "config.num_workers must be a positive number"),
        ({"max_output_bytes": 0}, "config.max_output_bytes must be a positive integer"),
        ({"default_language": "cpp"}, "config.default_language is 'cpp'; this tool runs only python"),
    ],
)
def test_bad_config_is_refused_naming_the_file_and_entry(tmp_path, config, message):
    key, value = next(iter(config.items()))
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n  - class_name: rlhf_megatron.agent.tools.CodeInterpreterTool\n"
        f"    config: {{type: native, {key}: {value!r}}}\n"
    )
    with pytest.raises(ToolConfigError) as err:
        load_tools(path)
    assert f"{path}: tools[0]" in str(err.value) and message in str(err.value)


def test_verl_sandbox_fusion_keys_are_ignored_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        tool = CodeInterpreterTool(
            {"sandbox_fusion_url": "http://x/run_code", "rate_limit": 10, "allow_missing_layers": MISSING}
        )
    assert "ignoring config keys rate_limit, sandbox_fusion_url" in caplog.text
    tool.close()


# --- calls that work ------------------------------------------------------------------------------


def test_output_files_and_state_per_trajectory():
    tool = _tool()

    async def scenario():
        a, _ = await tool.create(ground_truth="7", files={"data.txt": "3 4"})
        b, _ = await tool.create(create_kwargs={"files": {"data.txt": "10 20"}})
        code = "print(sum(int(x) for x in open('data.txt').read().split()))"
        results = [await _run(tool, code, a), await _run(tool, code, b), await _run(tool, "x = 1", a)]
        rewards = await tool.calc_reward(a)
        await tool.release(a)
        return results, rewards, tool._instances.copy(), b

    try:
        results, reward, instances, b = asyncio.run(scenario())
    finally:
        tool.close()
    assert [(r.text, s) for r, _, _, s in results] == [
        ("7", "ok"),
        ("30", "ok"),
        ("(no output; print() what you want to see)", "ok"),
    ]
    assert reward == 0.0 and list(instances) == [b]


def test_stderr_is_shown_after_stdout():
    response, _, _, status = _once(_tool(), "import sys\nprint('out')\nprint('warn', file=sys.stderr)")
    assert (response.text, status) == ("out\nwarn", "ok")


# --- errors the loop counts -----------------------------------------------------------------------


def test_an_exception_is_an_error_with_its_traceback():
    response, reward, metrics, status = _once(_tool(), "print('before')\n1 / 0")
    assert status == "error" and reward is None
    text = response.text
    assert text.startswith(
        "Error: the code exited with status 1.\nbefore\nTraceback (most recent call last):"
    )
    assert 'File "<code>", line 2' in text and text.endswith("ZeroDivisionError: division by zero")


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({}, "Error: missing required argument 'code'"),
        ({"code": 42}, "Error: argument 'code' must be a string, got integer"),
        ({"code": "   "}, "Error: code_interpreter: the code is empty"),
    ],
)
def test_bad_arguments_are_errors(arguments, message):
    tool = _tool()
    call = OpenAIFunctionCallSchema(name="code_interpreter", arguments=arguments)
    response, _, _, status = asyncio.run(run_tool_call(tool, "i", call, timeout_s=5))
    tool.close()
    assert status == "error" and response.text.startswith(message)


HOSTILE = {
    "infinite-loop": ("while True:\n    pass", "Error: the code used its 1 s of CPU time and was stopped."),
    "sleep-forever": (
        "import time\ntime.sleep(600)",
        "Error: the code ran past its 1 s time limit and was stopped.",
    ),
    "10GB": ("x = bytearray(10 * 1024**3)", "Error: the code ran out of memory (limit 512 MB)."),
    "fork": ("import os\nos.fork()", "starting processes is not allowed in this sandbox"),
    "subprocess": (
        "import subprocess\nsubprocess.run(['ls'])",
        "starting processes is not allowed in this sandbox",
    ),
    "multiprocessing": (
        "import multiprocessing as mp\nmp.Process(target=print).start()",
        "starting processes is not allowed in this sandbox",
    ),
    "write-outside": ("open('/tmp/code-interpreter-evil', 'w')", "writing outside the working directory"),
    "dotdot": ("open('../../../code-interpreter-evil', 'w')", "writing outside the working directory"),
    "symlink": ("import os\nos.symlink('/tmp', 'l')\nopen('l/evil', 'w')", "a symlink pointing outside"),
    "socket": (
        "import socket\nsocket.create_connection(('127.0.0.1', 80))",
        "network access is not allowed in this sandbox",
    ),
    "huge-output": ("print('x' * 10**7)", "Error: the output passed 16384 bytes; it was cut there"),
    "kill-parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "signalling other processes"),
    "thread-bomb": (
        "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()",
        "can't start new thread",
    ),
}
if sandbox_layers()["landlock"]:
    HOSTILE["parent-environ"] = (
        "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())",
        "Permission denied",
    )


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_code_is_an_error_response(name):
    code, message = HOSTILE[name]
    # CPU and wall limits far apart, so a busy machine cannot turn one into the other.
    tool = (
        _tool(default_timeout=1, cpu_timeout=1)
        if name == "sleep-forever"
        else _tool(default_timeout=10, cpu_timeout=1)
    )
    started = time.monotonic()
    response, reward, metrics, status = _once(tool, code)
    # Running out of wall or CPU time counts as a timeout, everything else as an error.
    expected = "timeout" if name in ("infinite-loop", "sleep-forever") else "error"
    assert status == expected and reward is None and metrics["truncated"] is False
    assert response.text.startswith("Error: ") and message in response.text
    assert len(response.text) < 17_000  # the output cap, plus the message
    assert time.monotonic() - started < 8  # 1 CPU second, on a shared 2-core machine
    assert not os.path.exists("/tmp/code-interpreter-evil")


def test_the_loops_timeout_cancels_a_queued_call(monkeypatch):
    """A call past the loop's ``tool_timeout_s`` is a ``timeout``; if it was still waiting for a
    worker it never starts, and the one running finishes within the sandbox's own limit."""
    started = []
    real = code_interpreter_module.run_python
    monkeypatch.setattr(
        code_interpreter_module, "run_python", lambda code, **kw: started.append(code) or real(code, **kw)
    )
    tool = _tool(default_timeout=1, num_workers=1)

    async def scenario():
        return await asyncio.gather(
            _run(tool, "import time\ntime.sleep(600)", timeout_s=0.3),
            _run(tool, "print('queued')", timeout_s=0.3),
        )

    try:
        results = asyncio.run(scenario())
    finally:
        tool.close()
    assert [status for *_, status in results] == ["timeout", "timeout"]
    assert results[0][0].text == "Error: tool 'code_interpreter' timed out after 0.3 s"
    assert started == ["import time\ntime.sleep(600)"]


def test_sixteen_concurrent_calls_share_a_bounded_pool(monkeypatch):
    running, peak, lock = [0], [0], threading.Lock()
    real = code_interpreter_module.run_python

    def counting(code, **kwargs):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            return real(code, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(code_interpreter_module, "run_python", counting)
    tool = _tool(num_workers=4)
    hostile = [
        "import os\nos.fork()",
        "import socket\nsocket.socket()",
        "x = bytearray(10 * 1024**3)",
        "1 / 0",
    ]
    codes = [f"print({i} * {i})" if i % 2 == 0 else hostile[i // 2 % 4] for i in range(16)]

    async def scenario():
        return await asyncio.gather(*(_run(tool, code, instance_id=str(i)) for i, code in enumerate(codes)))

    started = time.monotonic()
    try:
        results = asyncio.run(scenario())
    finally:
        tool.close()
    elapsed = time.monotonic() - started
    for i, (response, _, _, status) in enumerate(results):
        if i % 2 == 0:
            assert (response.text, status) == (str(i * i), "ok")
        else:
            assert status == "error" and response.text.startswith("Error: ")
    assert peak[0] == 4  # never more sandboxes than num_workers
    assert elapsed < 15


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"disk_limit_mb": 0}, "config.disk_limit_mb must be a positive number"),
        ({"site_packages": "yes"}, "config.site_packages must be true"),
        (
            {"site_packages": ["/nonexistent/site"]},
            "config.site_packages: not a directory: /nonexistent/site",
        ),
        ({"allow_missing_layers": "landlock"}, "config.allow_missing_layers must be a list"),
    ],
    ids=["disk", "site-type", "site-missing", "layers-type"],
)
def test_sandbox_keys_are_checked(config, message):
    with pytest.raises(ToolConfigError, match=message):
        _tool(**config)


def test_disk_limit_and_site_packages_reach_the_sandbox():
    tool = _tool(disk_limit_mb=1, site_packages=False)
    try:
        big = _call("open('f', 'wb').write(b'x' * (4 << 20))")
        response, _, _, status = asyncio.run(run_tool_call(tool, "t", big, timeout_s=20))
        assert status == "error" and "filled its 1 MB of disk" in response.text
        response, _, _, status = asyncio.run(run_tool_call(tool, "t", _call("import numpy"), timeout_s=20))
        assert status == "error" and "No module named 'numpy'" in response.text
    finally:
        tool.close()


@needs_every_layer
def test_the_driver_prints_the_sandbox_layers_once_when_it_checks_the_tool_config(capsys):
    """Validation builds the tools on the driver before any worker starts; a code interpreter
    there prints which sandbox layers hold (what the run will use), on stderr."""
    from rlhf_megatron.config.schema_roles import MultiTurnConfig
    from rlhf_megatron.config.validate import _tool_config_problems

    assert _tool_config_problems(MultiTurnConfig(enable=True, tool_config_path=str(CONFIG))) == []
    err = capsys.readouterr().err
    assert err.count("code_interpreter: sandbox layers: ") == 1
    assert err.strip().endswith(f"missing: {', '.join(code_interpreter_module.missing_layers()) or 'none'}")
