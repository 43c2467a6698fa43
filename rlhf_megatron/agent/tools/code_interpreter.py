"""``code_interpreter(code)``: run model-written Python in the local sandbox (verl's sandbox_fusion tool).

verl's ``SandboxFusionTool`` posts the code to a remote SandboxFusion server; this tool runs it on
the rollout machine through ``sandbox.run_python`` (its own process, no network, CPU / memory /
output / wall-clock limits, a fresh directory, nothing left behind). A verl tool config ports by
changing ``class_name``; the tool name and schema are the same (``code_interpreter``, one string
parameter ``code``), and so are the config keys ``default_timeout``, ``memory_limit_mb`` and
``num_workers``. ``sandbox_fusion_url`` and verl's rate-limit keys are ignored with a warning.

Errors are counted: code that fails (an exception, a limit, a refused fork or socket) makes the
call raise ``ToolError``, which ``run_tool_call`` turns into an ``Error: ...`` response (the
message, then the output and traceback) with status ``error``; the agent loop counts that status
in ``tool_errors``. Code past its wall-clock or CPU limit raises ``ToolTimeout`` instead: status
``timeout``, counted in ``tool_timeouts`` like a call that outlives the loop's ``tool_timeout_s``
(keep ``default_timeout`` below that, so the sandbox's own message reaches the model).

Boundaries: ``run_python`` blocks, so calls run on a thread pool of ``num_workers`` threads owned
by the tool: at most that many sandboxes at once, whatever number of trajectories call it, and a
call cancelled while queued (the loop's timeout) never starts.

No weaker sandbox without asking: the tool will not be built where one of the sandbox's kernel
layers (``sandbox.REQUIRED_LAYERS``: network namespace, disk quota, Landlock, seccomp) is missing,
unless ``allow_missing_layers`` names it; the error names the layer and that key.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
from typing import Any
from uuid import uuid4

from rlhf_megatron.agent.base import BaseTool
from rlhf_megatron.agent.errors import ToolConfigError, ToolError, ToolTimeout
from rlhf_megatron.agent.sandbox import (
    REQUIRED_LAYERS,
    SandboxResult,
    missing_layers,
    run_python,
    sandbox_layers,
)
from rlhf_megatron.agent.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["CodeInterpreterTool", "describe_layers", "format_result"]

logger = logging.getLogger(__name__)

#: Config keys and defaults. ``cpu_timeout`` defaults to ``default_timeout``.
DEFAULTS: dict[str, Any] = {
    "default_timeout": 10.0,  # wall-clock seconds per call
    "cpu_timeout": None,  # CPU seconds per call, over all threads
    "memory_limit_mb": 1024,  # address space; numpy alone takes about 150 MB
    "max_output_bytes": 16 * 1024,  # stdout and stderr together; the rest is cut
    "disk_limit_mb": 64,  # everything the code writes in one call (files and directories)
    "num_workers": 10,  # sandboxes running at once (verl's default)
    "site_packages": True,  # importable and readable: this environment's (true), none, or a list
    "allow_missing_layers": [],  # sandbox layers the tool may run without (REQUIRED_LAYERS)
}
#: Why each required layer matters, for the refusal message.
_LAYER_STAKES = {
    "netns": "the code could reach the network",
    "disk_quota": "the code could fill the disk",
    "landlock": "the code could read the data, checkpoints and other files on this machine",
    "seccomp": "the code could start processes that outlive the call, and open sockets",
}
NO_OUTPUT = "(no output; print() what you want to see)"


class CodeInterpreterTool(BaseTool):
    """Runs each call's ``code`` in a fresh sandboxed interpreter and answers with what it printed.

    ``create(ground_truth=..., files=...)``: ``ground_truth`` is kept as verl's tool keeps it (the
    answer is scored by the reward function; ``calc_reward`` is 0); ``files`` (relative path ->
    text or bytes) are put in the working directory of every call of that trajectory.
    """

    default_tool_schema = {
        "type": "function",
        "function": {
            "name": "code_interpreter",
            "description": (
                "Run Python 3 code and return what it prints (stdout and stderr). Each call starts a fresh "
                "interpreter without network access: variables do not carry over, so print the results "
                "you need."
            ),
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The Python code to run."}},
                "required": ["code"],
            },
        },
    }

    def __init__(self, config: dict | None, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema)
        settings = {**DEFAULTS, **{k: v for k, v in self.config.items() if k in DEFAULTS}}
        if settings["cpu_timeout"] is None:
            settings["cpu_timeout"] = settings["default_timeout"]
        for key in ("default_timeout", "cpu_timeout", "memory_limit_mb", "disk_limit_mb", "num_workers"):
            _check_positive(key, settings[key])
        if not isinstance(settings["max_output_bytes"], int) or settings["max_output_bytes"] < 1:
            raise ToolConfigError(
                f"config.max_output_bytes must be a positive integer, got {settings['max_output_bytes']!r}"
            )
        language = self.config.get("default_language", "python")
        if language != "python":
            raise ToolConfigError(f"config.default_language is {language!r}; this tool runs only python.")
        unknown = sorted(set(self.config) - set(DEFAULTS) - {"type", "default_language"})
        if unknown:
            logger.warning(
                "%s: ignoring config keys %s (the code runs in the local sandbox); known keys: %s",
                self.name,
                ", ".join(unknown),
                ", ".join(DEFAULTS),
            )
        self.timeout_s = float(settings["default_timeout"])
        self.cpu_s = float(settings["cpu_timeout"])
        self.memory_mb = int(settings["memory_limit_mb"])
        self.max_output_bytes = int(settings["max_output_bytes"])
        self.max_disk_bytes = int(settings["disk_limit_mb"] * 1024 * 1024)
        self.num_workers = int(settings["num_workers"])
        self.site_packages = _site_packages(settings["site_packages"])
        self.layers = _check_layers(settings["allow_missing_layers"])
        logger.info("%s: %s", self.name, describe_layers(self.layers))
        self._executor = concurrent.futures.ThreadPoolExecutor(self.num_workers, thread_name_prefix=self.name)
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(
        self,
        instance_id: str | None = None,
        ground_truth: Any = None,
        files: dict | None = None,
        **kwargs: Any,
    ) -> tuple[str, ToolResponse]:
        instance_id = instance_id if instance_id is not None else str(uuid4())
        nested = kwargs.get("create_kwargs") or {}  # verl's agent loop may pass them nested
        self._instances[instance_id] = {
            "ground_truth": ground_truth if ground_truth is not None else nested.get("ground_truth"),
            "files": dict(files if files is not None else nested.get("files") or {}),
        }
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code", "")
        if not isinstance(code, str) or not code.strip():
            raise ToolError("code_interpreter: the code is empty; pass the Python source as 'code'.")
        files = self._instances.get(instance_id, {}).get("files") or None
        run = functools.partial(
            run_python,
            code,
            timeout_s=self.timeout_s,
            cpu_s=self.cpu_s,
            memory_mb=self.memory_mb,
            max_output_bytes=self.max_output_bytes,
            files=files,
            max_disk_bytes=self.max_disk_bytes,
            site_packages=self.site_packages,
        )
        result = await asyncio.get_running_loop().run_in_executor(self._executor, run)
        text = format_result(result)
        if result.status in ("timeout", "cpu_limit"):
            raise ToolTimeout(text)  # status "timeout": the loop counts it in tool_timeouts
        if not result.ok:
            raise ToolError(text)  # status "error": the loop counts it in tool_errors
        return ToolResponse(text=text), 0.0, {"status": result.status, "duration_s": result.duration_s}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)

    def close(self) -> None:
        """Wait for the sandboxes still running (each ends within its limits) and stop the threads."""
        self._executor.shutdown(wait=True, cancel_futures=True)


def format_result(result: SandboxResult) -> str:
    """The response text: the output (stdout, then stderr), after the error message if the run failed."""
    output = (result.stdout + result.stderr).rstrip("\n")
    if result.ok:
        return output or NO_OUTPUT
    return f"{result.message}\n{output}" if output else result.message


def describe_layers(layers: dict[str, object]) -> str:
    """One line: which sandbox layers hold, e.g. ``sandbox layers: netns, disk_quota, landlock
    (ABI 7), seccomp, rlimits, audit_hook; missing: none``."""
    held = [
        f"landlock (ABI {layers['landlock']})" if name == "landlock" else name
        for name in (*REQUIRED_LAYERS, "rlimits", "audit_hook")
        if layers.get(name)
    ]
    missing = missing_layers(layers)
    return f"sandbox layers: {', '.join(held)}; missing: {', '.join(missing) or 'none'}"


def _check_layers(allowed: Any) -> dict[str, object]:
    """The layers that hold here; refuses (``ToolConfigError``) when a required one is missing and
    ``allow_missing_layers`` does not name it."""
    if not isinstance(allowed, list | tuple) or not all(isinstance(a, str) for a in allowed):
        raise ToolConfigError(
            f"config.allow_missing_layers must be a list of layer names ({', '.join(REQUIRED_LAYERS)}), "
            f"got {allowed!r}"
        )
    unknown = sorted(set(allowed) - set(REQUIRED_LAYERS))
    if unknown:
        raise ToolConfigError(
            f"config.allow_missing_layers: unknown layer(s) {', '.join(unknown)}; "
            f"the layers are {', '.join(REQUIRED_LAYERS)}"
        )
    try:
        layers = sandbox_layers()
    except (OSError, RuntimeError) as err:
        raise ToolConfigError(f"the sandbox cannot start on this machine: {err}") from err
    refused = [name for name in missing_layers(layers) if name not in allowed]
    if refused:
        stakes = "; ".join(f"without {name}, {_LAYER_STAKES[name]}" for name in refused)
        raise ToolConfigError(
            f"the sandbox's {', '.join(refused)} layer{'s are' if len(refused) > 1 else ' is'} not "
            f"available on this machine ({stakes}). Model-written code would run in a weaker sandbox; "
            f"to accept that, set config.allow_missing_layers: [{', '.join(refused)}] in the tool "
            "config (sandbox.py says what each layer needs: Landlock Linux >= 5.13, seccomp x86_64 "
            "or aarch64, the namespaces root or unprivileged user namespaces)."
        )
    return layers


def _site_packages(value: Any) -> bool | list[str]:
    if isinstance(value, bool):
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        missing = [v for v in value if not os.path.isdir(v)]
        if missing:
            raise ToolConfigError(f"config.site_packages: not a directory: {', '.join(missing)}")
        return list(value)
    raise ToolConfigError(
        f"config.site_packages must be true (this environment's), false or a list of directories, got {value!r}"
    )


def _check_positive(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ToolConfigError(f"config.{key} must be a positive number, got {value!r}")
