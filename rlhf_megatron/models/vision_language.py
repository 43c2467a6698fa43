"""A vision-language model (Qwen2-VL, Qwen2.5-VL) as one megatron module per pipeline chunk.

``VisionLanguageModel`` holds ``language_model``, a plain megatron-core
``GPTModel`` with M-RoPE, and ``vision_model`` (``vision.py``) on the first
chunk of the first pipeline stage only. On that chunk it embeds the tokens,
runs the vision tower on the micro-batch's images and videos, writes their embeddings
into the ``image_token_id`` / ``video_token_id`` positions (row-major, as HF's ``masked_scatter``)
and hands the result to the language model as ``decoder_input``; on every
other chunk it is the language model.

Megatron's machinery sees an ordinary model chunk: DDP and the optimizers take
its parameters, the pipeline schedules call ``set_input_tensor`` (delegated),
``finalize_model_grads`` finds ``pre_process`` and the shared embedding, and
``sharded_state_dict`` composes the children's (``language_model.*``,
``vision_model.*``). Parameter names follow: ``language_model.decoder.layers.N.…``
and ``vision_model.decoder.layers.B.…`` (see ``spec_rules.py``).

Qwen3-VL's DeepStack features (one ``[S, B, H]`` tensor per level, zero away from the
visual tokens, split along S under SP) travel into the decoder as its ``context`` argument,
which megatron hands to every layer and keeps as a checkpoint input under full recomputation;
a forward hook on decoder layer ``i`` adds level ``i`` to that layer's output, as transformers
adds them after its first layers. The first chunk must therefore hold those layers.

``freeze_vision_tower`` turns the tower's gradients off; call it before
wrapping the chunks in megatron's DDP so neither DDP nor the optimizer holds
state for it. A frozen tower then runs without autograd.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule

from rlhf_megatron.models.multimodal import (
    INPUT_NAMES,
    check_pixel_values,
    images_per_row,
    scatter_image_embeddings,
)
from rlhf_megatron.models.vision import VisionTransformer
from rlhf_megatron.planning.model_arch import ModelArch

__all__ = ["VisionLanguageModel", "freeze_vision_tower", "vision_language_model"]


class VisionLanguageModel(MegatronModule):
    """One pipeline chunk of a vision-language model (see the module docstring)."""

    def __init__(self, arch: ModelArch, language_model: GPTModel, vision_model: VisionTransformer | None):
        super().__init__(config=language_model.config)
        if language_model.pre_process and vision_model is None:
            raise ValueError("the chunk that embeds the tokens (pre_process=True) needs the vision tower")
        self.language_model = language_model
        self.vision_model = vision_model
        self.image_token_id = arch.image_token_id
        self.video_token_id = arch.video_token_id
        self.tokens_per_second = arch.vision.tokens_per_second
        self.frames_apart = arch.vision.frames_apart
        self.spatial_merge_size = arch.vision.spatial_merge_size
        self.patch_dim = arch.vision.patch_dim
        # Read by megatron's schedules and finalize_model_grads (tied embeddings over stages).
        self.model_type = language_model.model_type
        self.pre_process = language_model.pre_process
        self.post_process = language_model.post_process
        self.share_embeddings_and_output_weights = language_model.share_embeddings_and_output_weights
        self.deepstack_levels = len(arch.vision.deepstack_visual_indexes)
        if self.deepstack_levels and self.pre_process:
            _hook_deepstack(language_model, self.deepstack_levels)

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.language_model.shared_embedding_or_output_weight()

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        **kwargs,
    ):
        """``input_ids`` ``[B, S]``, ``position_ids`` ``[3, B, S]`` (M-RoPE), ``attention_mask``
        ``[B, 1, S, S]`` bool; ``pixel_values`` / ``image_grid_thw``: the micro-batch's images in
        row order, ``pixel_values_videos`` / ``video_grid_thw`` its videos (first stage only).
        Returns what ``GPTModel`` returns."""
        if position_ids.dim() != 3 or position_ids.shape[0] != 3:
            raise ValueError(
                f"position_ids has shape {list(position_ids.shape)}; M-RoPE needs [3, B, S] "
                "(models.forward.model_forward converts the batch-first [B, 3, S])"
            )
        decoder_input = None
        if self.pre_process:
            decoder_input, deepstack = self._embed(
                input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
            )
            if deepstack is not None:
                kwargs["extra_block_kwargs"] = {
                    **(kwargs.get("extra_block_kwargs") or {}),
                    "context": deepstack,
                }
        return self.language_model(
            input_ids, position_ids, attention_mask, decoder_input=decoder_input, **kwargs
        )

    def _embed(
        self, input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[S, B, H]`` token embeddings with the images and videos written in, and the DeepStack
        features ``[levels, S, B, H]`` (None without DeepStack or visuals); split along S under SP."""
        embeddings = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # (S, B, H), full
        deepstack: list[torch.Tensor] = []  # filled once a kind of visual has DeepStack features
        embeddings = self._write_visuals(
            embeddings, deepstack, input_ids, pixel_values, image_grid_thw, "image"
        )
        if self.video_token_id is not None:
            embeddings = self._write_visuals(
                embeddings, deepstack, input_ids, pixel_values_videos, video_grid_thw, "video"
            )
        elif pixel_values_videos is not None:
            raise ValueError(
                "pixel_values_videos were given but the model's config.json names no video_token_id"
            )
        if self.config.sequence_parallel:
            # The language model was built not to scatter its embeddings; the images had to go in first.
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
            deepstack = [tensor_parallel.scatter_to_sequence_parallel_region(d) for d in deepstack]
        return embeddings, torch.stack(deepstack) if deepstack else None

    def _write_visuals(
        self, embeddings, deepstack: list[torch.Tensor], input_ids, pixels, grids, kind: str
    ) -> torch.Tensor:
        """``embeddings`` with the vision tower's output for ``pixels`` at the ``kind``'s token; the
        DeepStack features go into ``deepstack``'s levels likewise (zero tensors at first use)."""
        token = self.image_token_id if kind == "image" else self.video_token_id
        rows = images_per_row(input_ids, grids, token, self.spatial_merge_size, kind)
        present = bool(rows) and rows[-1][1] > 0
        if pixels is not None and pixels.shape[0] == 0:
            pixels = None  # an empty batch of images (videos) is none
        names = INPUT_NAMES[kind]
        if present != (pixels is not None):
            raise ValueError(
                f"the micro-batch has {kind} tokens and {names[1]} but no {names[0]}"
                if present
                else f"{names[0]} were given but no row has {kind} tokens (and {names[1]} is empty)"
            )
        if not present:
            return embeddings
        check_pixel_values(pixels, grids, self.patch_dim, kind)
        frozen = not any(p.requires_grad for p in self.vision_model.parameters())
        with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
            embeds, features = self.vision_model.forward_with_deepstack(pixels, grids)  # (tokens, H)
        if features and not deepstack:
            deepstack.extend(torch.zeros_like(embeddings) for _ in features)
        for level, feature in enumerate(features):
            deepstack[level] = scatter_image_embeddings(deepstack[level], input_ids, feature, token, kind)
        return scatter_image_embeddings(embeddings, input_ids, embeds, token, kind)


def _hook_deepstack(language_model: GPTModel, levels: int) -> None:
    """Add DeepStack level ``i`` (the decoder's ``context[i]``) to decoder layer ``i``'s output."""
    first = [layer for layer in language_model.decoder.layers if layer.layer_number - 1 < levels]
    if len(first) < levels:
        raise ValueError(
            f"the model adds DeepStack features after its first {levels} decoder layers, which must all "
            f"sit on the first pipeline chunk; it holds {len(language_model.decoder.layers)}: lower "
            "pipeline_model_parallel_size / virtual_pipeline_model_parallel_size or put more layers first"
        )
    for layer in first:
        layer.register_forward_hook(
            functools.partial(_add_deepstack, layer.layer_number - 1), with_kwargs=True
        )


def _add_deepstack(level: int, module, args, kwargs, output):
    context = kwargs.get("context")
    if context is None:
        return output
    hidden, context_out = output
    return hidden + context[level], context_out


def vision_language_model(chunk: torch.nn.Module) -> VisionLanguageModel | None:
    """The ``VisionLanguageModel`` inside megatron's wrappers (DDP, Float16Module), or None."""
    while not isinstance(chunk, VisionLanguageModel) and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk if isinstance(chunk, VisionLanguageModel) else None


def freeze_vision_tower(chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> int:
    """Stop gradients into the vision tower (patch embedding, blocks, merger) of every chunk holding it.

    Call before megatron's DDP wraps the chunks: DDP allocates gradient buffers, and the
    optimizer state, only for parameters that require grad. Returns how many tensors were frozen.
    """
    frozen = 0
    for chunk in chunks if isinstance(chunks, Sequence) else [chunks]:
        model = vision_language_model(chunk)
        if model is None:
            raise TypeError(
                f"freeze_vision_tower: {type(chunk).__name__} is not a vision-language model chunk"
            )
        if model.vision_model is not None:
            for p in model.vision_model.parameters():
                p.requires_grad_(False)
                frozen += 1
    return frozen
