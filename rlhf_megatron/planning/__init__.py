"""Planning a run before anything starts: the model's architecture, the memory plan, the cost
model, the ``parallelism: auto`` search, and the validation that needs them.

Role: ``load_config`` (``load.py``) is the way a run's config comes into being: ``config/`` builds
it from the schema, presets and overrides, and this package searches ``auto`` layouts
(``auto_layout.py`` over the cost model, ``cost_model.py``, and the memory plan, ``memory.py`` and
``memory_lora.py``), reads each role's architecture (``model_arch.py``: a Hugging Face
``config.json`` as one typed ``ModelArch``; ``arch.py``: which one each role has, and its
parameter counts) and checks the rules that relate the layout to it (``validate.py``,
``validate_layout.py``, ``validate_lora.py``, ``lora_targets.py``). ``rlhf-megatron plan`` prints
the memory plan.

Boundaries: reads configs and ``config.json`` files; no process, device, Ray or vLLM.
``load_config`` and ``validate_config`` are imported on first use: a worker that imports
``planning.model_arch`` does not pay for the search, the planner and the cost model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf_megatron.planning.load import load_config
    from rlhf_megatron.planning.validate import validate_config

__all__ = ["load_config", "validate_config"]

_LAZY = {"load_config": "rlhf_megatron.planning.load", "validate_config": "rlhf_megatron.planning.validate"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
