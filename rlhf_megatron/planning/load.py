"""``load_config(file, overrides)``: the single way a run's config comes into being.

Role: the config as written (``config.loader.build_config``: defaults <- preset <- overrides,
every key and value checked against the schema), then the ``auto`` layout keys searched
(``auto_layout.resolve_auto``: the fastest predicted layout that fits), every rule across
sections checked (``validate.validate_config``) and the derived values filled in
(``config.normalize.normalize_config``).

Boundaries: nothing here starts processes or touches devices.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import DictConfig

from rlhf_megatron.config.loader import build_config
from rlhf_megatron.config.normalize import normalize_config
from rlhf_megatron.planning.auto_layout import format_search, resolve_auto
from rlhf_megatron.planning.validate import validate_config

__all__ = ["load_config"]


def load_config(
    config_file: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    world_size: int | None = None,
    validate: bool = True,
    on_search: Callable[[Any], None] | None = None,
) -> DictConfig:
    """Build the run config: defaults <- ``config_file`` (and its ``base`` chain) <- ``overrides``.

    Returns a structured (``RunConfig``), resolved DictConfig. With ``validate`` (the
    default) it has also passed ``validate_config(cfg, world_size)`` and been normalised.
    Layout keys set to ``auto`` (or left unset under ``parallelism: auto``) are searched first
    (``auto_layout.resolve_auto``); ``on_search`` receives the ranked ``LayoutSearch`` (the default
    prints the choice and the runner-up to stderr).
    Raises ``ConfigError`` listing every problem found.
    """
    cfg, auto_keys, followers = build_config(config_file, overrides)
    if auto_keys:
        search = resolve_auto(cfg, auto_keys, world_size=world_size, followers=followers)
        if on_search is None:
            print(format_search(search), file=sys.stderr)
        else:
            on_search(search)
    if validate:
        validate_config(cfg, world_size=world_size)
        normalize_config(cfg, world_size=world_size)
    return cfg
