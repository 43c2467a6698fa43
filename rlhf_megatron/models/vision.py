"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision tower on megatron-core layers.

``VisionTransformer(vision, config, use_te)`` turns ``pixel_values``
``[num_patches, C·T·P·P]`` of some images (``grid_thw`` ``[num_images, 3]``)
into one embedding per merged token, ``[num_patches / m², out_hidden]``, in the
processor's token order: exactly the rows the language model's image tokens
receive.

- Patch embedding: HF's Conv3d has kernel = stride = (T, P, P) and no bias, so
  it is a linear map of each flattened patch; the weight keeps HF's 5-D shape.
  Replicated on every TP rank (small; its input is not split).
- Blocks: megatron ``TransformerLayer``s (local spec on CPU, transformer-engine
  on GPU) inside a ``TransformerBlock`` (for its layer-stacked checkpointing),
  called one by one with their own boolean attention mask: block-diagonal per
  frame for full-attention blocks, per window for windowed ones (Qwen2.5-VL).
  Heads and MLP columns split over TP; the MLP is padded to
  ``vision.padded_intermediate_size(tp)`` (zero rows/columns, exact). The tower
  runs unsplit along the sequence (no sequence or context parallelism): its
  sequence is the patches, of any length.
- Window order: Qwen2.5-VL groups the patches window by window (transformers'
  ``get_vision_window_index``) before the blocks and restores the image order
  after the merger; full-attention blocks see the same order, their segments
  (frames) stay contiguous in it.
- 2-D RoPE: per patch, rotary frequencies over ``head_dim / 4`` pairs for its
  row and as many for its column; passed to megatron as ``cat(freqs, freqs)``
  ``[S, 1, 1, head_dim]``, which megatron's non-interleaved
  ``apply_rotary_pos_emb`` applies as HF's ``rotate_half``.
- Merger: norm, then ``m²`` neighbouring patches side by side through
  fc1 -> GELU -> fc2: megatron's ``MLP`` (column-parallel fc1, row-parallel
  fc2), so its 45M parameters (Qwen2.5-VL-7B) and their optimizer state are
  split over TP like the blocks', with megatron's checkpoint sharding.
- Qwen3-VL adds a bias to the patch embedding, a learned square grid of
  position embeddings bilinearly resampled to each image's patch grid (HF's
  ``align_corners=True`` taps, summed in HF's order so the result is bitwise
  HF's) and added after the patch embedding, and DeepStack: after each block of
  ``deepstack_visual_indexes`` a merger of its own, whose norm comes after the
  ``m²`` patches are put side by side, makes LM-width features that the
  language model adds after its first layers (``forward_with_deepstack``).

Attention stays inside each frame (full-attention blocks) or window: a micro-batch's
patches form ``Segments``. Without transformer-engine the blocks' core attention is
``SegmentAttention``, which runs torch's fused attention on the segments of each length side
by side, so its cost grows with the sum of the segments' squares, not with the square of the
micro-batch's patch count. With transformer-engine the segments become a dense
``[1, 1, S, S]`` boolean mask (megatron's arbitrary mask), whose memory does grow with that
square.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.activations import quick_gelu
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_block import TransformerBlock

from rlhf_megatron.planning.model_arch import VisionArch

__all__ = [
    "SegmentAttention",
    "Segments",
    "VisionLayout",
    "VisionTransformer",
    "vision_layout",
    "vision_transformer_config",
]


def vision_transformer_config(vision: VisionArch, lm: TransformerConfig) -> TransformerConfig:
    """The tower's megatron config: its own sizes, the language model's TP size, dtype and init."""
    swiglu = vision.mlp == "swiglu"
    activation = {
        "swiglu": F.silu,
        "quick_gelu": quick_gelu,
        "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    }[vision.mlp]
    return TransformerConfig(
        num_layers=vision.depth,
        hidden_size=vision.hidden_size,
        num_attention_heads=vision.num_heads,
        num_query_groups=vision.num_heads,
        kv_channels=vision.head_dim,
        ffn_hidden_size=vision.padded_intermediate_size(lm.tensor_model_parallel_size),
        normalization="RMSNorm" if vision.norm == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=vision.norm_eps,
        gated_linear_unit=swiglu,
        activation_func=activation,
        add_bias_linear=True,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=lm.init_method_std,
        tensor_model_parallel_size=lm.tensor_model_parallel_size,
        # Whole on the first pipeline stage, unsplit along its (patch) sequence.
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        sequence_parallel=False,
        params_dtype=lm.params_dtype,
        pipeline_dtype=lm.params_dtype,
        bf16=lm.bf16,
        fp16=lm.fp16,
        use_cpu_initialization=lm.use_cpu_initialization,
        perform_initialization=lm.perform_initialization,
    )


# -- patch order, masks, rotary positions (pure torch) ------------------------------------


class Segments:
    """Consecutive runs of a sequence that attend only within themselves (frames or windows)."""

    def __init__(self, lengths: list[int], device=None):
        self.lengths = tuple(int(n) for n in lengths)
        self.device = device
        self._groups: list[tuple[int, torch.Tensor]] | None = None

    def mask(self) -> torch.Tensor:
        """``[1, 1, S, S]`` bool, True = masked: each segment attends to itself."""
        segment = torch.repeat_interleave(
            torch.arange(len(self.lengths), device=self.device),
            torch.tensor(self.lengths, device=self.device),
        )
        return (segment[:, None] != segment[None, :])[None, None]

    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """``(length, index [n, length])`` for each segment length: where its ``n`` segments lie."""
        if self._groups is None:
            starts = torch.tensor((0, *self.lengths[:-1])).cumsum(0).tolist()
            by_length: dict[int, list[int]] = {}
            for start, n in zip(starts, self.lengths):
                by_length.setdefault(n, []).append(start)
            self._groups = [
                (n, (torch.tensor(first)[:, None] + torch.arange(n)).to(self.device))
                for n, first in by_length.items()
            ]
        return self._groups


@dataclass
class VisionLayout:
    """How the blocks see a set of images: patch order, attention segments, rotary frequencies."""

    order: torch.Tensor | None
    """``[S]`` patch permutation into window order (None: processor order, Qwen2-VL)."""
    restore: torch.Tensor | None
    """``[S / m²]`` the merged tokens' way back from window order to the processor's."""
    full: Segments
    """Each frame of each image attends to itself (in block order)."""
    window: Segments | None
    """Each window attends to itself (None without windows)."""
    rotary: torch.Tensor
    """``[S, 1, 1, head_dim]`` rotary angles in block order."""
    taps: tuple[torch.Tensor, torch.Tensor] | None = None
    """Qwen3-VL's learned positions resampled to each image: ``[S, 4]`` rows of the ``side x side``
    table and their bilinear weights, in the processor's (merge-unit) order; None without them."""


def _rotary(positions: torch.Tensor, vision: VisionArch) -> torch.Tensor:
    """``[S, 2]`` (row, column) -> ``[S, 1, 1, head_dim]`` angles: row pairs, column pairs, repeated."""
    half = vision.head_dim // 2
    inv_freq = 1.0 / (vision.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
    freqs = (positions[..., None].float() * inv_freq.to(positions.device)).flatten(1)  # (S, head_dim / 2)
    return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]


def _windows(t: int, gh: int, gw: int, win: int, offset: int) -> tuple[list[torch.Tensor], list[int]]:
    """Merged-token indices of one image, window by window (row-major windows of ``win x win``
    merged tokens per frame, row-major inside), and each window's size."""
    index = torch.arange(t * gh * gw).reshape(t, gh, gw) + offset
    blocks = [
        index[ti, y : y + win, x : x + win].flatten()
        for ti in range(t)
        for y in range(0, gh, win)
        for x in range(0, gw, win)
    ]
    return blocks, [b.numel() for b in blocks]


def vision_layout(grid_thw: torch.Tensor, vision: VisionArch, device=None) -> VisionLayout:
    """The ``VisionLayout`` of images with grids ``[num_images, 3]`` (as transformers computes it)."""
    m = vision.spatial_merge_size
    unit, win = m * m, vision.window_tokens
    positions, extents, frames, windows, window_sizes, offset = [], [], [], [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // m, w // m
        # Patches arrive merge-unit by merge-unit: (gh, gw, m, m) order.
        rows = torch.arange(h)[:, None].expand(h, w).reshape(gh, m, gw, m).transpose(1, 2).flatten()
        cols = torch.arange(w)[None, :].expand(h, w).reshape(gh, m, gw, m).transpose(1, 2).flatten()
        positions.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
        extents.append(torch.tensor([h, w]).expand(t * h * w, 2))  # each patch's image rows, columns
        frames += [h * w] * t
        if win is not None:
            blocks, block_sizes = _windows(t, gh, gw, win, offset)
            windows += blocks
            window_sizes += [s * unit for s in block_sizes]
        offset += t * gh * gw
    position = torch.cat(positions).to(device)
    taps = None
    if vision.num_position_embeddings is not None:
        taps = _position_taps(
            position, torch.cat(extents).to(device), math.isqrt(vision.num_position_embeddings)
        )
    order = restore = window = None
    if win is not None:
        merged = torch.cat(windows).to(device)  # (S / m²,) window order
        order = (merged[:, None] * unit + torch.arange(unit, device=device)).flatten()
        restore = torch.argsort(merged)
        position = position[order]
        window = Segments(window_sizes, device)
    return VisionLayout(order, restore, Segments(frames, device), window, _rotary(position, vision), taps)


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (``align_corners=True``) of target positions ``index`` on axes of length
    ``size`` into a ``side``-long source axis: ``[N, 2]`` source indices and weights."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def _position_taps(
    position: torch.Tensor, size: torch.Tensor, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps into a ``side x side`` table for patches at ``position`` ``[S, 2]`` (row,
    column) of images of ``size`` ``[S, 2]`` (rows, columns): ``[S, 4]`` table rows and weights,
    in transformers' order (row taps outer, column taps inner)."""
    row_taps, row_weights = _axis_taps(position[:, 0], size[:, 0], side)
    col_taps, col_weights = _axis_taps(position[:, 1], size[:, 1], side)
    index = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weight = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return index, weight


# -- modules ------------------------------------------------------------------------------


class SegmentAttention(DotProductAttention):
    """megatron's core attention over ``Segments`` (given as ``attention_mask``): torch's fused
    attention on the segments of each length side by side, no mask; the result is what the
    unfused attention computes with the segments' block-diagonal mask, up to float rounding."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Segments,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """``[S, 1, heads, d]`` query, key and value (this TP rank's heads) -> ``[S, 1, heads * d]``."""
        if not isinstance(attention_mask, Segments) or query.shape[1] != 1:
            raise TypeError("SegmentAttention takes one sequence ([S, 1, heads, d]) and its Segments")
        q, k, v = query[:, 0], key[:, 0], value[:, 0]  # (S, heads, d)
        out = q.new_empty(q.shape)
        for _, index in attention_mask.groups():
            # (n, length, heads, d) -> (n, heads, length, d): each segment a batch entry
            qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))
            context = F.scaled_dot_product_attention(qs, ks, vs, scale=self.softmax_scale)
            out = out.index_put((index.flatten(),), context.transpose(1, 2).flatten(0, 1))
        return out.reshape(q.shape[0], 1, self.hidden_size_per_partition)


def _replicated(shape, config: TransformerConfig, generator: torch.Generator | None) -> torch.nn.Parameter:
    """A parameter every TP rank holds whole, drawn from ``generator`` (the same on every rank)."""
    # Where megatron puts its own parameters: the GPU unless it initialises on CPU.
    device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
    param = torch.nn.Parameter(torch.empty(shape, dtype=config.params_dtype, device=device))
    if config.perform_initialization:
        with torch.no_grad():
            param.copy_(torch.randn(shape, generator=generator) * config.init_method_std)
    return param


class PatchEmbed(torch.nn.Module):
    """HF's Conv3d over (T, P, P) patches as a linear map; weight ``[hidden, C, T, P, P]``, and
    Qwen3-VL's bias."""

    def __init__(self, vision: VisionArch, config: TransformerConfig, seed: int = 0):
        super().__init__()
        shape = (
            vision.hidden_size,
            vision.in_channels,
            vision.temporal_patch_size,
            vision.patch_size,
            vision.patch_size,
        )
        # Replicated over TP: the same values on every rank, not from megatron's per-rank stream.
        g = torch.Generator().manual_seed(seed)
        self.weight = _replicated(shape, config, g)
        self.bias = _replicated((vision.hidden_size,), config, g) if vision.patch_bias else None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return F.linear(pixel_values.to(self.weight.dtype), self.weight.flatten(1), self.bias)  # (S, hidden)


def _specs(vision: VisionArch, use_te: bool):
    """(block layer spec, norm class, column-parallel linear, row-parallel linear) for this device."""
    if use_te:
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear,
            TENorm,
            TERowParallelLinear,
        )
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec()
        spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.arbitrary
        return spec, TENorm, TEColumnParallelLinear, TERowParallelLinear
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    rms = vision.norm == "rmsnorm"
    spec = get_gpt_layer_local_spec(normalization="RMSNorm" if rms else "LayerNorm")
    # Bidirectional attention inside each frame/window: the Segments we pass are the whole story.
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.padding
    spec.submodules.self_attention.submodules.core_attention = SegmentAttention
    return spec, LocalSpecProvider().layer_norm(rms_norm=rms), ColumnParallelLinear, RowParallelLinear


# Config fields the merger shares with the blocks (sizes and activation are its own).
_INHERITED = (
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "normalization",
    "layernorm_epsilon",
    "add_bias_linear",
    "hidden_dropout",
    "attention_dropout",
    "init_method_std",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "sequence_parallel",
    "params_dtype",
    "pipeline_dtype",
    "bf16",
    "fp16",
    "use_cpu_initialization",
    "perform_initialization",
)


class PatchMerger(MegatronModule):
    """Norm, then ``m²`` neighbouring patches side by side through fc1 -> GELU -> fc2 (megatron's MLP).

    ``postshuffle``: the norm comes after the patches are put side by side, over all ``m²`` of
    them (Qwen3-VL's DeepStack mergers)."""

    def __init__(self, vision: VisionArch, config: TransformerConfig, norm, column, row, postshuffle=False):
        super().__init__(config=config)
        self.merged = vision.merged_hidden_size
        self.postshuffle = postshuffle
        width = self.merged if postshuffle else vision.hidden_size
        self.ln_q = build_module(norm, config=config, hidden_size=width, eps=vision.norm_eps)
        mlp_config = TransformerConfig(
            **{
                **{f: getattr(config, f) for f in _INHERITED},
                "hidden_size": vision.out_hidden_size,
                "ffn_hidden_size": self.merged,
                "num_layers": 1,
                "gated_linear_unit": False,
                "activation_func": F.gelu,  # exact (erf) GELU, as torch.nn.GELU()
            }
        )
        self.mlp = MLP(mlp_config, MLPSubmodules(linear_fc1=column, linear_fc2=row), input_size=self.merged)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        if self.postshuffle:
            x = self.ln_q(patches.reshape(-1, 1, self.merged))
        else:
            x = self.ln_q(patches).reshape(-1, 1, self.merged)  # (S / m², 1, m² hidden)
        out, bias = self.mlp(x)
        return (out if bias is None else out + bias)[:, 0]  # (S / m², out_hidden)


class MergerList(MegatronModule):
    """The DeepStack mergers as children ``0``, ``1``, ...: a megatron module, so that megatron's
    ``sharded_state_dict`` reaches their TP-split linears (a ``torch.nn.ModuleList`` would be
    saved as if replicated)."""

    def __init__(self, config: TransformerConfig, mergers: list[PatchMerger]):
        super().__init__(config=config)
        for i, merger in enumerate(mergers):
            self.add_module(str(i), merger)

    def __getitem__(self, i: int) -> PatchMerger:
        return self._modules[str(i)]

    def __len__(self) -> int:
        return len(self._modules)


class VisionTransformer(MegatronModule):
    """Patch embedding, ``depth`` blocks and the merger (see the module docstring)."""

    def __init__(self, vision: VisionArch, config: TransformerConfig, use_te: bool, seed: int = 0):
        super().__init__(config=config)
        self.vision = vision
        spec, norm, column, row = _specs(vision, use_te)
        self.dense_masks = use_te  # transformer-engine's attention takes a mask, not Segments
        self.patch_embed = PatchEmbed(vision, config, seed)
        self.pos_embed = None
        if vision.num_position_embeddings is not None:
            g = torch.Generator().manual_seed(seed + 1)
            self.pos_embed = _replicated((vision.num_position_embeddings, vision.hidden_size), config, g)
        self.decoder = TransformerBlock(
            config, spec, post_layer_norm=False, pre_process=True, post_process=False
        )
        self.merger = PatchMerger(vision, config, norm, column, row)
        self.deepstack_mergers = MergerList(
            config,
            [
                PatchMerger(vision, config, norm, column, row, postshuffle=True)
                for _ in vision.deepstack_visual_indexes
            ],
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``[S, C·T·P·P]`` patches of images ``[N, 3]`` -> ``[S / m², out_hidden]`` merged tokens."""
        return self.forward_with_deepstack(pixel_values, grid_thw)[0]

    def forward_with_deepstack(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The merged tokens and, in ``deepstack_visual_indexes`` order, the DeepStack features
        (each ``[S / m², out_hidden]``, the same token order; none without DeepStack)."""
        layout = vision_layout(grid_thw, self.vision, pixel_values.device)
        hidden = self.patch_embed(pixel_values)  # (S, hidden)
        if self.pos_embed is not None:
            index, weight = layout.taps
            hidden = hidden + (self.pos_embed[index] * weight[:, :, None]).sum(1).to(hidden.dtype)
        if layout.order is not None:
            hidden = hidden[layout.order]
        hidden = hidden[:, None]  # (S, 1, hidden): megatron's [s, b, h]
        deepstack = []
        masks = {}  # dense masks, built once per kind
        for block, layer in enumerate(self.decoder.layers):
            full = self.vision.full_attention(block) or layout.window is None
            segments = layout.full if full else layout.window
            if self.dense_masks:
                if full not in masks:
                    masks[full] = segments.mask()
                segments = masks[full]
            hidden, _ = layer(hidden, attention_mask=segments, rotary_pos_emb=layout.rotary)
            if block in self.vision.deepstack_visual_indexes:
                which = self.vision.deepstack_visual_indexes.index(block)
                deepstack.append(self.deepstack_mergers[which](hidden[:, 0]))
        merged = self.merger(hidden[:, 0])
        if layout.restore is not None:
            merged, deepstack = merged[layout.restore], [d[layout.restore] for d in deepstack]
        return merged, deepstack
