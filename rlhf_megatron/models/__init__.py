"""megatron-core models from Hugging Face checkpoints: build, load, run, save, and the HF⇄mcore spec.

Modules (each importable on its own):

- ``arch``: ``ModelArch``, the typed reading of an HF ``config.json``.
- ``spec`` / ``spec_rules``: the declarative HF⇄mcore rule tables (one per
  family) and their pure conversion engine (names, TP partition dims and
  slices, QKV/gate-up/padding layouts, routed experts). The weight converter
  builds on it.
- ``stages``: pipeline/virtual-pipeline layer offsets, local ⇄ global names,
  which stage owns a parameter (a vision tower: the first), which expert-parallel
  rank owns an expert.
- ``builder``: ``ParallelConfig`` and ``build_gpt_model`` (TE layers on GPU,
  local layers on CPU; scalar head for critics and reward models; the
  vision-language wrapper for Qwen2-VL / Qwen2.5-VL).
- ``vision`` / ``vision_language`` / ``multimodal``: the vision tower on
  megatron layers, the wrapper that writes image embeddings into the language
  model's input (and ``freeze_vision_tower``), and the per-row bookkeeping of
  ``pixel_values`` / ``image_grid_thw``.
- ``moe``: mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral) on megatron's
  MoE layers: config, per-layer specs, the load-balancing loss tracker and the
  per-layer expert load, and fixes for megatron's MoE path without transformer-engine.
- ``heads``: the replicated one-output head.
- ``forward``: masks, forward-only passes (M-RoPE positions and images for
  vision-language models), vocab-parallel log-probs/entropy.
- ``hf_io``: sliced reads of HF safetensors, streaming shard writer.
- ``loader``: ``load_hf_weights``, each rank reading only its slices.
- ``checkpoint``: megatron dist-checkpoints with our metadata; per-tensor reads.
- ``tiny``: tiny random HF checkpoints for tests and the quickstart.

Only this package and ``platform/`` touch ``megatron.core.parallel_state``.
``spec``, ``spec_rules``, ``stages``, ``multimodal`` and ``hf_io`` import no megatron and run
without processes.
"""

from rlhf_megatron.planning.model_arch import (
    SUPPORTED_ARCHITECTURES,
    ModelArch,
    MoEArch,
    RopeScaling,
    UnsupportedModelError,
    VisionArch,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelArch",
    "MoEArch",
    "RopeScaling",
    "UnsupportedModelError",
    "VisionArch",
]
