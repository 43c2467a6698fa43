"""megatron-core models from Hugging Face checkpoints: build, load, run, save, and the HF⇄mcore spec.

Modules (each importable on its own):

- ``arch``: ``ModelArch``, the typed reading of an HF ``config.json``.
- ``spec``: the declarative HF⇄mcore parameter spec and its pure conversion
  engine (names, TP partition dims and slices, QKV/gate-up/vocabulary
  layouts). The weight converter builds on it.
- ``stages``: pipeline/virtual-pipeline layer offsets, local ⇄ global names.
- ``builder``: ``ParallelConfig`` and ``build_gpt_model`` (TE layers on GPU,
  local layers on CPU; scalar head for critics and reward models).
- ``heads``: the replicated one-output head.
- ``forward``: masks, forward-only passes, vocab-parallel log-probs/entropy.
- ``hf_io``: sliced reads of HF safetensors, streaming shard writer.
- ``loader``: ``load_hf_weights``, each rank reading only its slices.
- ``checkpoint``: megatron dist-checkpoints with our metadata; per-tensor reads.
- ``tiny``: tiny random HF checkpoints for tests and the quickstart.

Only this package and ``platform/`` touch ``megatron.core.parallel_state``.
``arch``, ``spec``, ``stages`` and ``hf_io`` import no megatron and run without processes.
"""

from rlhf_megatron.config.model_arch import (
    SUPPORTED_ARCHITECTURES,
    ModelArch,
    RopeScaling,
    UnsupportedModelError,
)

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelArch", "RopeScaling", "UnsupportedModelError"]
