"""Multimodal inputs of a micro-batch: which images belong to which row, and where their embeddings go.

A batch's images travel as two tensors concatenated over the rows in row order
(what the HF processor returns for each row, stacked): ``pixel_values``
``[num_patches, C·T·P·P]`` and ``image_grid_thw`` ``[num_images, 3]``. Their
first dimension is patches (images), not rows, so splitting a batch into
micro-batches goes through the image-token counts of the rows: row ``r`` owns
the next images whose merged-token counts (``t·h·w / m²``) add up to its number
of ``image_token_id`` tokens.

Every mismatch (a row whose image tokens do not add up to whole images, grids
left over, a patch count that disagrees with the grids) is a ``ValueError``
naming the row or the image, raised before any model runs.

Videos travel the same way in their own pair, ``pixel_values_videos`` and
``video_grid_thw`` (a video's grid has ``t`` temporal patches), and take the
video token's places; every function here takes ``kind="video"`` for them.

Boundaries: pure torch, no megatron; the model-side use is in ``vision_language.py``.
"""

from __future__ import annotations

import torch

__all__ = [
    "INPUT_NAMES",
    "RowImages",
    "check_pixel_values",
    "images_per_row",
    "scatter_image_embeddings",
    "select_rows",
]

INPUT_NAMES = {
    "image": ("pixel_values", "image_grid_thw"),
    "video": ("pixel_values_videos", "video_grid_thw"),
}
"""The forward's names for each kind's patches and grids (transformers' names)."""

RowImages = list[tuple[int, int]]
"""Per row, the half-open range ``[first, end)`` of its images in ``image_grid_thw``."""


def images_per_row(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    image_token_id: int,
    merge: int,
    kind: str = "image",
) -> RowImages:
    """``[B, S]`` token ids and ``[N, 3]`` grids -> which images each row owns (see module docstring).
    ``kind="video"``: the same for videos (``video_grid_thw`` and the video token)."""
    grids = [] if image_grid_thw is None else image_grid_thw.tolist()
    for i, (t, h, w) in enumerate(grids):
        if t < 1 or h % merge or w % merge:
            raise ValueError(
                f"{kind} {i}: {kind}_grid_thw {[t, h, w]} must have t >= 1 and h, w divisible by "
                f"spatial_merge_size {merge}"
            )
    tokens = [t * h * w // merge**2 for t, h, w in grids]
    counts = (input_ids == image_token_id).sum(-1).tolist()
    rows, image = [], 0
    for row, want in enumerate(counts):
        first, got = image, 0
        while got < want and image < len(tokens):
            got += tokens[image]
            image += 1
        if got != want:
            taken = [grids[i] for i in range(first, image)]
            raise ValueError(
                f"row {row}: {want} {kind} tokens (id {image_token_id}) but the {kind}_grid_thw entries it "
                f"would own, {taken}, make {got} (t x h x w / {merge}^2 each); every {kind} needs exactly its "
                "number of placeholder tokens, in row order"
            )
        rows.append((first, image))
    if image != len(tokens):
        raise ValueError(
            f"{kind}_grid_thw has {len(tokens)} {kind}s but the rows' {kind} tokens (id {image_token_id}) "
            f"account for only the first {image}"
        )
    return rows


def check_pixel_values(
    pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, patch_dim: int, kind: str = "image"
) -> None:
    """``pixel_values`` has one ``patch_dim``-wide row per patch of the grids, in image order
    (``kind="video"``: ``pixel_values_videos`` and ``video_grid_thw``)."""
    names = INPUT_NAMES[kind]
    patches = image_grid_thw.prod(-1).tolist()
    if pixel_values.dim() != 2 or pixel_values.shape[1] != patch_dim:
        raise ValueError(
            f"{names[0]} has shape {list(pixel_values.shape)}; expected [num_patches, {patch_dim}] "
            "(channels x temporal_patch_size x patch_size^2 values per patch)"
        )
    if pixel_values.shape[0] != sum(patches):
        raise ValueError(
            f"{names[0]} has {pixel_values.shape[0]} patches but {names[1]} implies {sum(patches)} "
            f"(per {kind}: {patches}); pass each row's {names[0]} and {names[1]} together, in row order"
        )


def select_rows(
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    row_images: RowImages,
    rows: range,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The ``pixel_values`` / ``image_grid_thw`` of rows ``rows`` (a micro-batch);
    ``(None, None)`` when those rows have no images."""
    if image_grid_thw is None or not rows:
        return None, None
    first, end = row_images[rows[0]][0], row_images[rows[-1]][1]
    if first == end:
        return None, None
    offsets = [0, *image_grid_thw.prod(-1).cumsum(0).tolist()]
    return pixel_values[offsets[first] : offsets[end]], image_grid_thw[first:end]


def scatter_image_embeddings(
    embeddings: torch.Tensor,
    input_ids: torch.Tensor,
    image_embeds: torch.Tensor,
    image_token_id: int,
    kind: str = "image",
) -> torch.Tensor:
    """Put the image embeddings at the image-token positions, in row-major order (HF's ``masked_scatter``).

    ``embeddings``: ``[S, B, H]`` (megatron's layout); ``input_ids``: ``[B, S]``;
    ``image_embeds``: ``[num_image_tokens, H]``. Differentiable in both. ``kind="video"``: a
    video's embeddings at the video token's positions.
    """
    mask = input_ids == image_token_id  # (B, S)
    if int(mask.sum()) != image_embeds.shape[0]:
        raise ValueError(
            f"the micro-batch has {int(mask.sum())} {kind} tokens but the vision tower produced "
            f"{image_embeds.shape[0]} {kind} embeddings"
        )
    bsh = embeddings.transpose(0, 1).masked_scatter(mask[..., None], image_embeds.to(embeddings.dtype))
    return bsh.transpose(0, 1).contiguous()  # (S, B, H)
