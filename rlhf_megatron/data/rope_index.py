"""M-RoPE position ids of Qwen2-VL / Qwen2.5-VL: three position streams (time, height, width).

Text tokens advance all three streams together, one position per token. An image's
``t x h x w`` merged patches (``h``, ``w`` counted after ``spatial_merge_size x
spatial_merge_size`` merging) take positions ``start + (ti, hi, wi)``, and the text after
it continues at ``start + max(t, h, w)``. This is transformers' ``get_rope_index`` for
images (the layout the Qwen2-VL processors produce: one run of image-pad tokens per
image), written against token ids instead of a model object so the dataset can compute
prompt positions and the trainer can extend them over responses.

Shapes: ``input_ids`` / ``attention_mask`` ``[B, S]``; ``image_grid_thw`` ``[N, 3]`` for
all images of the batch in row order; the result ``[B, 3, S]`` (batch first, like every
other ``Batch`` tensor; megatron-core wants ``[3, B, S]``, ``models/forward.py`` transposes).
Padding positions are 0.

Boundaries: pure torch, no model, no processor.
"""

from __future__ import annotations

import torch

__all__ = ["extend_positions", "get_rope_index", "image_token_counts"]


def image_token_counts(image_grid_thw: torch.Tensor, spatial_merge_size: int) -> torch.Tensor:
    """``[N]`` LM tokens per image: ``t * h * w / merge**2``."""
    return image_grid_thw.prod(-1) // (spatial_merge_size**2)


def get_rope_index(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    *,
    image_token_id: int,
    spatial_merge_size: int,
) -> torch.Tensor:
    """``[B, 3, S]`` M-RoPE positions (see the module docstring).

    Every maximal run of ``image_token_id`` among a row's valid tokens is one image and
    consumes the next row of ``image_grid_thw``. Raises ``ValueError`` naming the row when a
    run's length does not match its grid, or when images and grids do not pair up.
    """
    batch, seq = input_ids.shape
    out = torch.zeros(batch, 3, seq, dtype=torch.long)
    grids = list(image_grid_thw.tolist()) if image_grid_thw is not None else []
    next_grid = 0
    for row in range(batch):
        valid = attention_mask[row].bool()
        ids = input_ids[row][valid].tolist()
        pieces: list[torch.Tensor] = []
        pos, i = 0, 0
        while i < len(ids):
            j = i
            is_image = ids[i] == image_token_id
            while j < len(ids) and (ids[j] == image_token_id) == is_image:
                j += 1
            if not is_image:
                pieces.append(torch.arange(pos, pos + j - i).expand(3, -1))
                pos += j - i
            else:
                if next_grid >= len(grids):
                    raise ValueError(
                        f"row {row}: an image placeholder run of {j - i} tokens has no image_grid_thw entry "
                        f"({len(grids)} grid(s) for the batch)"
                    )
                t, h, w = grids[next_grid]
                next_grid += 1
                h, w = h // spatial_merge_size, w // spatial_merge_size
                if t * h * w != j - i:
                    raise ValueError(
                        f"row {row}: an image takes {j - i} placeholder tokens but its image_grid_thw "
                        f"{[t, h * spatial_merge_size, w * spatial_merge_size]} implies {t * h * w} "
                        f"(t x h x w / {spatial_merge_size}^2)"
                    )
                ti = torch.arange(t).view(-1, 1, 1).expand(t, h, w).flatten()
                hi = torch.arange(h).view(1, -1, 1).expand(t, h, w).flatten()
                wi = torch.arange(w).view(1, 1, -1).expand(t, h, w).flatten()
                pieces.append(torch.stack([ti, hi, wi]) + pos)
                pos += max(t, h, w)
            i = j
        if pieces:
            out[row, :, valid] = torch.cat(pieces, dim=1)
    if next_grid != len(grids):
        raise ValueError(
            f"{len(grids)} image_grid_thw entries but only {next_grid} image placeholder runs in the batch"
        )
    return out


def extend_positions(prompt_positions: torch.Tensor, length: int) -> torch.Tensor:
    """Positions of ``length`` tokens generated after each prompt: ``[B, S]`` or ``[B, 3, S]`` ->
    the same rank with ``S + length`` positions, continuing from each row's last position.

    Generated text advances every M-RoPE stream by one per token, exactly as
    ``get_rope_index`` would number it over the whole sequence (the prompt ends in text).
    """
    last = prompt_positions[..., -1:]
    steps = torch.arange(1, length + 1, dtype=prompt_positions.dtype)
    return torch.cat([prompt_positions, last + steps], dim=-1)
