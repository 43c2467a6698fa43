"""Finding and reading YAML presets, including ``base:`` layering.

Role: turns a preset name or path into the ordered list of YAML layers it stands for.
A preset may say ``base: other.yaml`` (or a list of files) to start from other presets;
bases are applied first, in order, then the preset itself. Chains are followed
recursively and a cycle is an error naming the chain. This replaces Hydra's ``defaults``
lists, which we do not support.

Lookup: a path is tried as given (relative to the working directory), then relative to the
repository's ``configs/`` directory; ``.yaml`` may be left off. A ``base`` is tried
relative to the file that names it, then relative to ``configs/``.

Boundaries: returns plain dicts; knows nothing of the schema. The loader merges them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlhf_megatron.config.errors import ConfigError

__all__ = ["CONFIGS_DIR", "BASE_KEY", "find_preset", "list_presets", "read_preset_layers"]

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
BASE_KEY = "base"


def _candidates(name: str | Path, relative_to: Path | None) -> list[Path]:
    path = Path(name).expanduser()
    if path.is_absolute():
        roots = [None]
    else:
        roots = [relative_to or Path.cwd(), CONFIGS_DIR]
    out = []
    for root in roots:
        p = path if root is None else root / path
        out.append(p)
        if p.suffix not in (".yaml", ".yml"):
            out.append(p.with_name(p.name + ".yaml"))
    return out


def find_preset(name: str | Path, relative_to: Path | None = None) -> Path:
    """The preset file ``name`` refers to; ConfigError listing the places tried otherwise."""
    tried = _candidates(name, relative_to)
    for path in tried:
        if path.is_file():
            return path.resolve()
    places = ", ".join(str(p) for p in tried)
    raise ConfigError(f"config file {str(name)!r} not found (looked at: {places}); see `ls {CONFIGS_DIR}`")


NOT_PRESETS = ("tools", "overlays")
"""Folders of ``configs/`` that hold other files than run configs (verl-format tool configs,
overlays that other presets layer on with ``base``)."""


def preset_stage(path: Path) -> str | None:
    """``sft`` or ``rm`` for a preset of a stage before RL (``python -m rlhf_megatron.sft`` / ``.rm``:
    named ``sft.yaml`` / ``*_sft.yaml`` or ``rm.yaml`` / ``*_rm.yaml``), None for an RL run's."""
    for stage in ("sft", "rm"):
        if path.stem == stage or path.stem.endswith(f"_{stage}"):
            return stage
    return None


def list_presets(stage: str | None = None) -> list[Path]:
    """The presets shipped in ``configs/`` for RL runs (``stage`` None) or for a stage (``sft``,
    ``rm``), sorted (not the tool configs of ``configs/tools/``)."""
    return sorted(
        p
        for p in CONFIGS_DIR.rglob("*.yaml")
        if p.relative_to(CONFIGS_DIR).parts[0] not in NOT_PRESETS and preset_stage(p) == stage
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as exc:  # yaml's and OmegaConf's parse errors share no base class
        raise ConfigError(f"{path}: cannot parse YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a preset must be a mapping of keys, got {type(data).__name__}")
    return data


def read_preset_layers(name: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``[(source_file, mapping), ...]`` in the order they apply: bases first, ``name`` last.

    The ``base`` key is removed from each mapping.
    """
    layers: list[tuple[str, dict[str, Any]]] = []

    def visit(path: Path, chain: tuple[Path, ...]) -> None:
        if path in chain:
            cycle = " -> ".join(p.name for p in (*chain, path))
            raise ConfigError(f"preset cycle through `base`: {cycle}; remove one of these `base` entries")
        data = _read_yaml(path)
        bases = data.pop(BASE_KEY, None)
        if bases is not None:
            if isinstance(bases, str):
                bases = [bases]
            if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
                raise ConfigError(
                    f"{path}: `base` must be a file name or a list of file names, got {bases!r}"
                )
            for base in bases:
                visit(find_preset(base, relative_to=path.parent), (*chain, path))
        layers.append((str(path), data))

    visit(find_preset(name), ())
    return layers
