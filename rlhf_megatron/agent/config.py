"""Tool and interaction configs in verl's YAML format, loaded into instances.

A tool config (``actor_rollout_ref.rollout.multi_turn.tool_config_path``)::

    tools:
      - class_name: pkg.module.MyTool          # or path/to/file.py:MyTool
        config: {type: native, ...}            # passed to the constructor
        tool_schema: {type: function, function: {name, description, parameters}}

An interaction config (``multi_turn.interaction_config_path``)::

    interaction:
      - name: gsm8k
        class_name: pkg.module.MyInteraction
        config: {}

Everything is checked before a rollout starts, and every refusal is a ``ToolConfigError`` that
names the file, the entry (index and name) and what to change. ``check_tools_kwargs`` checks a
data row's ``tools_kwargs`` against the configured tools the same way.

Boundaries: imports user classes and constructs them; never calls a tool. MCP tools are not
supported (verl starts a client per server; here a tool that talks to a server is a native tool).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf
from pydantic import ValidationError

from rlhf_megatron.agent.base import BaseInteraction, BaseTool
from rlhf_megatron.agent.errors import ToolConfigError
from rlhf_megatron.agent.schemas import OpenAIFunctionToolSchema

__all__ = [
    "TOOLS_KWARGS_KEYS",
    "ToolConfigError",
    "check_tools_kwargs",
    "import_class",
    "initialize_interactions_from_config",
    "initialize_tools_from_config",
    "load_interactions",
    "load_tools",
]

#: The keys a row's ``tools_kwargs[<tool name>]`` may have, one per tool method.
TOOLS_KWARGS_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")

_CLASS_NAME_FIX = 'set class_name to a dotted import path ("package.module.Class") or "path/to/file.py:Class"'


def load_tools(path: str | os.PathLike) -> list[BaseTool]:
    """Construct every tool of a verl-format tool config, in file order."""
    path = os.fspath(path)
    entries = _read_section(path, "tools", example="tools: [{class_name: ..., config: {type: native}}]")
    tools: list[BaseTool] = []
    first_index: dict[str, int] = {}
    for index, entry in enumerate(entries):
        tool = _build_tool(path, index, entry)
        if tool.name in first_index:
            raise ToolConfigError(
                f"{path}: tools[{index}] ({tool.name}): tool name '{tool.name}' is already used by "
                f"tools[{first_index[tool.name]}]; the model calls tools by name, so give each entry's "
                "tool_schema.function.name a different value."
            )
        first_index[tool.name] = index
        tools.append(tool)
    return tools


def load_interactions(path: str | os.PathLike) -> dict[str, BaseInteraction]:
    """Construct every interaction of a verl-format interaction config, by name."""
    path = os.fspath(path)
    entries = _read_section(path, "interaction", example="interaction: [{name: ..., class_name: ...}]")
    interactions: dict[str, BaseInteraction] = {}
    for index, entry in enumerate(entries):
        name, interaction = _build_interaction(path, index, entry)
        if name in interactions:
            raise ToolConfigError(
                f"{path}: interaction[{index}] ({name}): the name '{name}' is already used by an earlier "
                "entry; rows pick an interaction by name, so give each entry a different 'name'."
            )
        interactions[name] = interaction
    return interactions


# verl's names, so code ported from verl reads the same.
initialize_tools_from_config = load_tools
initialize_interactions_from_config = load_interactions


def check_tools_kwargs(tools_kwargs: Mapping | None, tool_names: Iterable[str], where: str) -> None:
    """Refuse a row's ``tools_kwargs`` that names an unconfigured tool or an unknown method key.

    ``where`` names the row in the message (e.g. ``"train_files row 12"``). ``None`` entries are
    allowed: a parquet struct column holds one for every tool a row does not use.
    """
    if tools_kwargs is None:
        return
    known = sorted(tool_names)
    if not isinstance(tools_kwargs, Mapping):
        raise ToolConfigError(
            f"{where}: tools_kwargs must be a mapping from tool name to "
            f"{{create_kwargs: ..., execute_kwargs: ...}}, got {type(tools_kwargs).__name__}."
        )
    for tool_name, entry in tools_kwargs.items():
        if tool_name not in known:
            raise ToolConfigError(
                f"{where}: tools_kwargs names tool '{tool_name}', which is not in the tool config; "
                f"configured tools: {', '.join(known) or '(none)'}. Rename the key or add the tool."
            )
        if entry is None:
            continue
        if not isinstance(entry, Mapping):
            raise ToolConfigError(
                f"{where}: tools_kwargs['{tool_name}'] must be a mapping with keys among "
                f"{', '.join(TOOLS_KWARGS_KEYS)}, got {type(entry).__name__}."
            )
        for key, value in entry.items():
            if key not in TOOLS_KWARGS_KEYS:
                raise ToolConfigError(
                    f"{where}: tools_kwargs['{tool_name}'] has key '{key}'; allowed keys: "
                    f"{', '.join(TOOLS_KWARGS_KEYS)} (each a mapping of keyword arguments)."
                )
            if value is not None and not isinstance(value, Mapping):
                raise ToolConfigError(
                    f"{where}: tools_kwargs['{tool_name}']['{key}'] must be a mapping of keyword "
                    f"arguments, got {type(value).__name__}."
                )


def import_class(class_name: str, base_dir: str | None = None) -> type:
    """Import ``package.module.Class``, or ``path/to/file.py:Class`` (also ``file.py.Class``).

    A relative file path is looked up from the working directory, then from ``base_dir`` (the
    config file's directory). Raises ImportError, AttributeError or TypeError with the reason.
    """
    obj, module = _import(class_name, base_dir)
    if not isinstance(obj, type):
        raise TypeError(
            f"'{class_name}' in module '{module.__name__}' is a {type(obj).__name__}, not a class"
        )
    return obj


def import_object(spec: str, base_dir: str | None = None) -> Any:
    """``import_class`` for any attribute (a function, say): ``package.module.name`` or
    ``path/to/file.py:name``."""
    return _import(spec, base_dir)[0]


def _import(spec: str, base_dir: str | None) -> tuple[Any, Any]:
    file_path, attr = _split_file_spec(spec)
    if file_path is not None:
        module = _load_file_module(_resolve_file(file_path, base_dir))
    else:
        module_name, _, attr = spec.rpartition(".")
        if not module_name:
            raise ImportError(f"'{spec}' has no module part")
        module = importlib.import_module(module_name)
    obj = getattr(module, attr, None)
    if obj is None:
        classes = sorted(k for k, v in vars(module).items() if isinstance(v, type) and not k.startswith("_"))
        raise AttributeError(f"module '{module.__name__}' has no '{attr}'; its classes: {', '.join(classes)}")
    return obj, module


def _split_file_spec(class_name: str) -> tuple[str | None, str]:
    """``(file path, class)`` for the file forms of class_name, ``(None, class_name)`` otherwise."""
    head, sep, tail = class_name.rpartition(":")
    if sep and head.endswith(".py"):
        return head, tail
    head, sep, tail = class_name.rpartition(".")
    if sep and head.endswith(".py"):
        return head, tail
    return None, class_name


def _resolve_file(file_path: str, base_dir: str | None) -> str:
    candidates = [file_path]
    if not os.path.isabs(file_path) and base_dir:
        candidates.append(os.path.join(base_dir, file_path))
    for candidate in candidates:
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise ImportError(f"file {file_path} does not exist (looked in: {', '.join(candidates)})")


def _load_file_module(path: str):
    # One module per file, named after its path: loading a file twice gives the same classes,
    # and two files with the same base name never collide.
    module_name = "_rlhf_megatron_agent_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # pickling and dataclasses look classes up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def _read_section(path: str, key: str, example: str) -> list[Any]:
    """The list under ``key`` of the YAML file at ``path``, interpolations resolved (as verl does)."""
    if not os.path.isfile(path):
        raise ToolConfigError(
            f"{path}: the {key} config file does not exist; fix the path in the run config."
        )
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:
        raise ToolConfigError(f"{path}: cannot be read as YAML: {type(err).__name__}: {err}") from err
    if not isinstance(loaded, DictConfig):
        raise ToolConfigError(
            f"{path}: the file must be a YAML mapping with a top-level '{key}' list ({example}), "
            f"got a {type(loaded).__name__}."
        )
    try:
        data = OmegaConf.to_container(loaded, resolve=True)
    except Exception as err:
        raise ToolConfigError(f"{path}: an interpolation (${{...}}) cannot be resolved: {err}") from err
    if key not in data:
        raise ToolConfigError(
            f"{path}: has no top-level '{key}' key (found: {', '.join(map(str, data)) or 'nothing'}); "
            f"write {example}."
        )
    if not isinstance(data[key], list):
        raise ToolConfigError(
            f"{path}: '{key}' must be a list of entries ({example}), got {type(data[key]).__name__}."
        )
    return data[key]


def _build_tool(path: str, index: int, entry: Any) -> BaseTool:
    where = f"{path}: tools[{index}]"
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}: each entry must be a mapping with class_name, config, tool_schema.")
    raw_schema = entry.get("tool_schema")
    label = _schema_name(raw_schema) or entry.get("class_name") or "?"
    where = f"{where} ({label})"
    class_name = entry.get("class_name")
    if not isinstance(class_name, str) or not class_name:
        raise ToolConfigError(f"{where}: class_name is missing; {_CLASS_NAME_FIX}.")
    config = _entry_config(where, entry)
    tool_type = str(config.get("type", "native")).lower()
    if tool_type == "mcp":
        raise ToolConfigError(
            f"{where}: config.type 'mcp': MCP tools are not supported; write a BaseTool subclass that "
            "calls the server and set config.type: native."
        )
    if tool_type != "native":
        raise ToolConfigError(
            f"{where}: config.type is '{config.get('type')}'; the only supported type is native."
        )
    schema = None
    if raw_schema is not None:
        try:
            schema = OpenAIFunctionToolSchema.model_validate(raw_schema)
        except ValidationError as err:
            raise ToolConfigError(
                f"{where}: tool_schema is not an OpenAI function schema ({_summarise(err)}); write "
                "{type: function, function: {name, description, parameters: {type: object, "
                "properties: {...}, required: [...]}}}."
            ) from err
    cls = _import_plugin(where, class_name, path, BaseTool, "verl.tools.base_tool")
    try:
        return cls(config=config, tool_schema=schema)
    except Exception as err:
        raise ToolConfigError(
            f"{where}: constructing {class_name} failed: {type(err).__name__}: {err}"
        ) from err


def _build_interaction(path: str, index: int, entry: Any) -> tuple[str, BaseInteraction]:
    where = f"{path}: interaction[{index}]"
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}: each entry must be a mapping with name, class_name, config.")
    class_name = entry.get("class_name")
    where = f"{where} ({entry.get('name') or class_name or '?'})"
    if not isinstance(class_name, str) or not class_name:
        raise ToolConfigError(f"{where}: class_name is missing; {_CLASS_NAME_FIX}.")
    config = _entry_config(where, entry)
    name = entry.get("name")
    if name is None:
        # verl's rule: the class name without an "Interaction" suffix, lower-cased.
        simple = class_name.replace(":", ".").rsplit(".", 1)[-1]
        name = (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()
    if not isinstance(name, str) or not name:
        raise ToolConfigError(f"{where}: name must be a non-empty string; rows select the interaction by it.")
    config["name"] = name
    cls = _import_plugin(where, class_name, path, BaseInteraction, "verl.interactions.base")
    try:
        return name, cls(config=config)
    except Exception as err:
        raise ToolConfigError(
            f"{where}: constructing {class_name} failed: {type(err).__name__}: {err}"
        ) from err


def _entry_config(where: str, entry: dict) -> dict:
    config = entry.get("config")
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ToolConfigError(
            f"{where}: config must be a mapping (e.g. {{type: native}}), got {type(config).__name__}."
        )
    return dict(config)


def _import_plugin(where: str, class_name: str, path: str, base: type, verl_module: str) -> type:
    """Import ``class_name`` and check it derives from ``base`` (or verl's class of that name)."""
    try:
        cls = import_class(class_name, base_dir=os.path.dirname(os.path.abspath(path)))
    except Exception as err:
        raise ToolConfigError(
            f"{where}: class_name '{class_name}' cannot be imported: {type(err).__name__}: {err}; "
            f"{_CLASS_NAME_FIX}, importable where the rollout runs."
        ) from err
    # verl's own base classes are accepted by name: if the class derives from one, verl was
    # importable, and the duck-typed protocol is the same. verl itself is never imported here.
    from_verl = any(k.__module__ == verl_module and k.__name__ == base.__name__ for k in cls.__mro__)
    if not (issubclass(cls, base) or from_verl):
        raise ToolConfigError(
            f"{where}: {class_name} is not a subclass of {base.__name__}; derive it from "
            f"rlhf_megatron.agent.{base.__name__} (from rlhf_megatron.agent import {base.__name__})."
        )
    return cls


def _schema_name(raw_schema: Any) -> str | None:
    if isinstance(raw_schema, dict) and isinstance(raw_schema.get("function"), dict):
        name = raw_schema["function"].get("name")
        return name if isinstance(name, str) else None
    return None


def _summarise(err: ValidationError) -> str:
    """pydantic's errors as ``loc: message`` pairs, the first few only."""
    parts = [f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in err.errors()[:4]]
    more = len(err.errors()) - len(parts)
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
