"""Loading a run's config: schema defaults <- preset file(s) <- dotted overrides.

Role: ``build_config`` is the first step of the single way a config comes into being
(``planning.load_config``, which then searches ``auto`` layouts, validates across sections and
normalises). Layers are flattened to
dotted keys and checked against the schema key by key, so one error lists every unknown
key (with the nearest valid key), every wrongly typed value (a closed-choice key, an Enum
field, with its allowed values) and every broken interpolation at once. verl keys that
mean nothing with Megatron are dropped with one warning (see ``keys.IGNORED_KEYS``). The
result is a structured, resolved DictConfig.

Override syntax is verl's (Hydra's): ``a.b=c``, ``+a.b=c`` and ``++a.b=c`` (accepted the
same way: the schema decides what may exist), YAML values (``null``, ``True``, ``1e-6``,
``['wandb']``) and OmegaConf interpolations (``${data.max_response_length}``). An EasyR1
command line (``config=FILE``, ``worker.*`` keys) is translated by ``easyr1.py`` first.

Boundaries: no cross-field rules (``validate.py``), no derived values (``normalize.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tempfile
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError, OmegaConfBaseException

from rlhf_megatron.config.auto_keys import follower_keys, searchable_keys, take_auto
from rlhf_megatron.config.easyr1 import is_easyr1, translate_easyr1
from rlhf_megatron.config.errors import ConfigError
from rlhf_megatron.config.keys import (
    IGNORED_KEYS,
    RENAMED_KEYS,
    STAGE_IGNORED_KEYS,
    STAGE_RENAMED_KEYS,
    KeyInfo,
    find_ignored,
    schema_keys,
)
from rlhf_megatron.config.presets import read_preset_layers
from rlhf_megatron.config.schema import RunConfig

__all__ = [
    "COMMAND_LINE",
    "IgnoredKeysWarning",
    "RESOLVED_CONFIG_NAME",
    "build_config",
    "load_stage_config",
    "parse_overrides",
    "save_resolved_config",
]

COMMAND_LINE = "command line"
RESOLVED_CONFIG_NAME = "resolved_config.yaml"


class IgnoredKeysWarning(UserWarning):
    """verl keys that the Megatron backend does not use were given and dropped."""


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """``["a.b=1", "+c=['x']"]`` -> ``{"a.b": 1, "c": ["x"]}``; values parsed as YAML."""
    out: dict[str, Any] = {}
    errors = []
    for item in overrides:
        if item.startswith("~"):
            errors.append(f"{item!r}: deleting keys is not supported; set the key to null or leave it out")
            continue
        key, sep, raw = item.lstrip("+").partition("=")
        key = key.strip()
        if not sep or not key:
            errors.append(f"override {item!r} is not key=value (e.g. trainer.total_epochs=3)")
            continue
        # Hydra reads `key=` as the empty string; YAML would read it as null.
        out[key] = "" if raw == "" else OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]))["v"]
    if errors:
        raise ConfigError(errors)
    return out


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    """Nested mapping -> dotted leaves. Empty mappings stay leaves, so ``x: {}`` still sets x."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = value


ROUTER_REPLAY_KEY = "actor_rollout_ref.actor.router_replay"


class _Layers:
    """Flat view of all layers: later layers replace earlier values, and setting a key
    replaces everything below it (``model_arch: null`` drops a base's ``model_arch.*``)."""

    def __init__(self, schema: type = RunConfig) -> None:
        self.schema = schema
        """The root dataclass the keys belong to (``RunConfig``, or a stage's)."""
        self.values: dict[str, Any] = {}
        self.origin: dict[str, str] = {}
        self.ignored: dict[str, str] = {}  # key -> reason
        self.errors: list[str] = []

    def add(self, source: str, mapping: dict[str, Any]) -> None:
        flat: dict[str, Any] = {}
        for k, v in mapping.items():
            _flatten(v, str(k), flat)
        for key, value in flat.items():
            target = self._rename(key)
            if target != key and target in flat:
                if flat[target] != value:
                    self.errors.append(
                        f"{key}={value!r} and {target}={flat[target]!r} ({source}) set the same option "
                        f"differently; keep only {target}"
                    )
                continue  # the canonical spelling in the same layer wins
            self._set(target, value, source)

    def _rename(self, key: str) -> str:
        table = RENAMED_KEYS if self.schema is RunConfig else STAGE_RENAMED_KEYS
        for old, new in table.items():
            if key == old or key.startswith(old + "."):
                return new + key[len(old) :]
        return key

    def set(self, key: str, value: Any, source: str) -> None:
        """One dotted key from ``source`` (renamed spellings resolved)."""
        self._set(self._rename(key), value, source)

    def _set(self, key: str, value: Any, source: str) -> None:
        if key == ROUTER_REPLAY_KEY and isinstance(value, bool):  # the issue's / older verl's switch
            key, value = f"{key}.mode", "auto" if value else "disabled"
        info = schema_keys(self.schema)
        table = IGNORED_KEYS if self.schema is RunConfig else STAGE_IGNORED_KEYS
        ignored = find_ignored(key, table) if key not in info else None
        if ignored is not None:
            if ignored.inert is not None and value not in ignored.inert:
                allowed = " or ".join(repr(v) for v in ignored.inert)
                self.errors.append(
                    f"{key}={value!r} ({source}) is not supported by the Megatron backend "
                    f"({ignored.reason}); leave it out or set it to {allowed}"
                )
            else:
                self.ignored[key] = ignored.reason
            return
        problem = _unknown_key_problem(key, self.schema)
        if problem:
            self.errors.append(f"{problem} (set in {source})")
            return
        for existing in [k for k in self.values if k.startswith(key + ".")]:
            del self.values[existing], self.origin[existing]
        parts = key.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in self.values and not isinstance(self.values[parent], dict):
                del self.values[parent], self.origin[parent]
        self.values[key] = value
        self.origin[key] = source


def _unknown_key_problem(key: str, schema: type = RunConfig) -> str | None:
    """None when ``key`` may be set; otherwise a message naming the nearest valid key."""
    info = schema_keys(schema)
    if key in info:
        return None
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = info.get(".".join(parts[:i]))
        if parent is None:
            continue
        if parent.open_dict:
            return None
        if not parent.section:
            return f"{parent.key} is a value of type {parent.type_name}, not a section; {key} cannot be set"
        break
    if parts[0] == "defaults":
        return "Hydra `defaults` lists are not supported; layer presets with `base: other.yaml` instead"
    leaves = [k for k, v in info.items() if not v.section]
    matches = difflib.get_close_matches(key, leaves, n=3, cutoff=0.6)
    if not matches:
        return f"unknown key {key!r}; no similar key exists (the schema is rlhf_megatron/config/schema*.py)"
    others = f" (or: {', '.join(matches[1:])})" if len(matches) > 1 else ""
    return f"unknown key {key!r}; did you mean {matches[0]!r}?{others}"


def _apply(cfg: DictConfig, layers: _Layers) -> list[str]:
    """Write every flat value into the structured config; one message per rejected value."""
    info = schema_keys(layers.schema)
    errors = []
    for key, value in layers.values.items():
        source = layers.origin[key]
        parts = key.split(".")
        # An optional section or free-form dict (model_arch) is None until one of its keys is set.
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            meta = info.get(prefix)
            if not (meta and meta.optional and (meta.section or meta.open_dict)):
                continue
            if OmegaConf.select(cfg, prefix) is None:
                if i == len(parts) and value is None:
                    break
                empty = meta.section_type() if meta.section else {}
                OmegaConf.update(cfg, prefix, empty, merge=False)
        _add_typed_entries(cfg, parts)
        meta = info.get(key)
        if meta is not None and meta.section and value is not None and value != {}:
            errors.append(
                f"{key} is a section ({meta.type_name}); set its keys, e.g. {key}.<name>=... ({source})"
            )
            continue
        try:
            OmegaConf.update(cfg, key, value, merge=True)
        except OmegaConfBaseException as exc:
            errors.append(_rejected_value(key, value, source, meta, exc))
    return errors


def _add_typed_entries(cfg: DictConfig, parts: list[str]) -> None:
    """A dict of sections (``distillation.teacher_models``) gets the entry a key names as a section
    at its defaults before the key is written (OmegaConf would insert a plain dict and refuse it)."""
    for i in range(1, len(parts) - 1):
        node = OmegaConf.select(cfg, ".".join(parts[:i]))
        element = getattr(getattr(node, "_metadata", None), "element_type", None)
        if isinstance(node, DictConfig) and dataclasses.is_dataclass(element) and parts[i] not in node:
            node[parts[i]] = OmegaConf.structured(element)


_VALUE_HINTS = {
    ("actor_rollout_ref.rollout.name", "sglang"): (
        "sglang is not an engine of this project: set actor_rollout_ref.rollout.name=vllm "
        "(multi-turn tool rollouts run on vLLM too)"
    ),
}
"""What to do about a value other frameworks accept here (verl's multi-turn scripts set sglang)."""


def _rejected_value(key: str, value: Any, source: str, meta: KeyInfo | None, exc: Exception) -> str:
    """The message for a value OmegaConf refused: for a closed-choice key, the allowed values
    (OmegaConf's own "Invalid value ..., expected one of [...]" names neither key nor source)."""
    if meta is not None and meta.choices is not None:
        if not meta.list_of_choices:
            hint = _VALUE_HINTS.get((key, value))
            hint = f"; {hint}" if hint else ""
            return f"{key}={value!r} is not one of: {meta.choices_text()} ({source}){hint}"
        if isinstance(value, (list, tuple)):
            bad = [v for v in value if v not in meta.choices]
            if bad:
                return f"{key} has {bad}; allowed entries: {meta.choices_text()} ({source})"
    expected = meta.type_name if meta is not None else "a different type"
    reason = str(exc).splitlines()[0]
    return f"{key}={value!r} ({source}): expected {expected}; {reason}"


def _walk_leaves(value: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk_leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, value


def _resolve(cfg: DictConfig) -> list[str]:
    """Check mandatory values and interpolations key by key, then resolve in place."""
    raw = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    errors = []
    for key, value in _walk_leaves(raw):
        if value == "???":
            errors.append(f"{key} is required but not set")
        elif isinstance(value, str) and "${" in value:
            try:
                OmegaConf.select(cfg, key, throw_on_resolution_failure=True, throw_on_missing=True)
            except InterpolationKeyError as exc:
                errors.append(f"{key}={value}: {str(exc).splitlines()[0]}; point it at an existing key")
            except OmegaConfBaseException as exc:
                errors.append(f"{key}={value}: {str(exc).splitlines()[0]}")
    if not errors:
        OmegaConf.resolve(cfg)
    return errors


def _warn_ignored(ignored: dict[str, str]) -> None:
    if not ignored:
        return
    lines = "\n".join(f"  {key}  ({reason})" for key, reason in sorted(ignored.items()))
    warnings.warn(
        f"{len(ignored)} config key(s) have no effect with the Megatron backend and were ignored:\n{lines}",
        IgnoredKeysWarning,
        stacklevel=3,
    )


def build_config(
    config_file: str | os.PathLike | None = None, overrides: Sequence[str] = ()
) -> tuple[DictConfig, list[str], dict[str, list[str]]]:
    """The run config as written: defaults <- ``config_file`` (and its ``base`` chain) <-
    ``overrides``, structured (``RunConfig``) and resolved, every key and value checked against
    the schema, with the layout keys set to ``auto`` (or left unset under ``parallelism: auto``)
    at the schema's defaults. Returns ``(cfg, the keys the layout search fills in, the ref's and
    critic's keys that follow the searched actor keys)``. Raises ``ConfigError`` listing every
    problem found.

    ``planning.load_config`` is the whole way in (search, validation across sections and
    normalisation); this is its first step.
    """
    layers = _Layers()
    parsed = parse_overrides(overrides)
    if is_easyr1(parsed):
        if config_file is not None:
            raise ConfigError(
                [
                    f"--config {config_file} (this project's preset) and EasyR1's config=/worker.* keys cannot be mixed"
                ]
            )
        easy = translate_easyr1(parsed)
        for key, value in easy.values.items():
            layers.set(key, value, easy.origin[key])
        layers.ignored.update(easy.ignored)
        layers.errors += easy.errors
    else:
        if config_file is not None:
            for source, mapping in read_preset_layers(config_file):
                layers.add(source, mapping)
        layers.add(COMMAND_LINE, parsed)
    return _build_with_auto(layers)


def _build_with_auto(layers: _Layers) -> tuple[DictConfig, list[str], dict[str, list[str]]]:
    """``_build`` with the ``auto`` layout values taken out first (the schema's fields are ints):
    the config at the schema's defaults there, the keys ``parallelism: auto`` searches, and the
    ref's and critic's keys that follow the searched actor keys."""
    taken, errors = take_auto(layers.values)
    for key in taken:
        del layers.origin[key]
    layers.errors += errors
    set_keys = set(layers.values)
    cfg = _build(layers)
    keys = searchable_keys(cfg, taken, set_keys)
    return cfg, keys, follower_keys(keys, set_keys)


def _build(layers: _Layers) -> DictConfig:
    """The structured, resolved config of ``layers.schema`` with every layer written in; raises
    ``ConfigError`` listing the layers' and the values' problems; warns about ignored keys."""
    if layers.errors:
        raise ConfigError(layers.errors)
    cfg = OmegaConf.structured(layers.schema)
    errors = _apply(cfg, layers)
    errors += _resolve(cfg) if not errors else []
    if errors:
        raise ConfigError(errors)
    _warn_ignored(layers.ignored)
    return cfg


def load_stage_config(
    schema: type, config_file: str | os.PathLike | None = None, overrides: Sequence[str] = ()
) -> DictConfig:
    """A stage's config (``schema_stages.SFTConfig`` / ``RMConfig``): defaults <- ``config_file``
    (and its ``base`` chain) <- ``overrides``, key by key as ``build_config`` checks them, then
    each section's own ``validate``. Raises ``ConfigError`` listing every problem."""

    layers = _Layers(schema)
    if config_file is not None:
        for source, mapping in read_preset_layers(config_file):
            layers.add(source, mapping)
    layers.add(COMMAND_LINE, parse_overrides(overrides))
    cfg = _build(layers)
    errors = []
    typed = OmegaConf.to_object(cfg)
    for f in dataclasses.fields(typed):
        section = getattr(typed, f.name)
        if hasattr(section, "validate"):
            errors += section.validate(f.name)
    if errors:
        raise ConfigError(errors)
    return cfg


def save_resolved_config(cfg: DictConfig, run_dir: str | os.PathLike | None = None) -> Path:
    """Write ``cfg`` as YAML to ``<run_dir>/resolved_config.yaml`` atomically (temp file +
    rename, so a reader never sees half a file). ``run_dir`` defaults to
    ``trainer.default_local_dir``. Returns the path written."""
    directory = Path(run_dir if run_dir is not None else cfg.trainer.default_local_dir).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / RESOLVED_CONFIG_NAME
    fd, tmp = tempfile.mkstemp(prefix=f".{RESOLVED_CONFIG_NAME}.", dir=directory)
    try:
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the run dir is shared with readers
        with os.fdopen(fd, "w") as fh:
            fh.write(OmegaConf.to_yaml(cfg, resolve=True))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
