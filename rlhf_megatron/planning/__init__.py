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
"""

from rlhf_megatron.planning.load import load_config
from rlhf_megatron.planning.validate import validate_config

__all__ = ["load_config", "validate_config"]
