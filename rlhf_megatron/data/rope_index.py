"""M-RoPE position ids of Qwen2-VL / Qwen2.5-VL / Qwen3-VL: three position streams (time, height, width).

Text tokens advance all three streams together, one position per token. An image's
``t x h x w`` merged patches (``h``, ``w`` counted after ``spatial_merge_size x
spatial_merge_size`` merging) take positions ``start + (ti, hi, wi)``, and the text after
it continues one past the largest of them (``start + max(t, h, w)``). A video is the same
with its time stream scaled: Qwen2.5-VL places temporal patch ``ti`` at ``int(ti x
second_per_grid x tokens_per_second)``, so positions follow seconds, not frames. This is
transformers' ``get_rope_index`` (the layout the Qwen2-VL processors produce: one run of
pad tokens per image or video), numbered as vLLM numbers it, written against token ids
instead of a model object so the dataset can compute prompt positions and the trainer can
extend them over responses.

Qwen3-VL (``frames_apart``) lays a video out frame by frame: each temporal patch is its own run
of pad tokens, after a ``<t seconds>`` timestamp in text, and is numbered as a one-frame image
(time index 0, no scaling by seconds); a video grid ``(t, h, w)`` is consumed as ``t`` runs of
``(1, h, w)``. This is transformers' ``Qwen3VLModel.get_rope_index``, which splits the video
grids the same way.

Shapes: ``input_ids`` / ``attention_mask`` ``[B, S]``; ``image_grid_thw`` ``[N, 3]`` for
all images of the batch in row order (``video_grid_thw`` ``[V, 3]`` and ``second_per_grid_ts``
``[V]`` for its videos); the result ``[B, 3, S]`` (batch first, like every
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
    video_grid_thw: torch.Tensor | None = None,
    video_token_id: int | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    tokens_per_second: float | None = None,
    frames_apart: bool = False,
) -> torch.Tensor:
    """``[B, 3, S]`` M-RoPE positions (see the module docstring).

    Every maximal run of ``image_token_id`` among a row's valid tokens is one image and
    consumes the next row of ``image_grid_thw``; every run of ``video_token_id`` is one video
    and consumes the next row of ``video_grid_thw``. A video's temporal patch ``k`` sits at
    ``int(k * second_per_grid_ts[v] * tokens_per_second)`` (Qwen2.5-VL; with
    ``tokens_per_second`` None, at ``k``: Qwen2-VL). With ``frames_apart`` (Qwen3-VL) every
    run of ``video_token_id`` is one frame (temporal patch) of the current video instead, a
    one-frame image, and ``second_per_grid_ts`` / ``tokens_per_second`` are not used. Text
    after a visual run continues one past the largest position so far, as vLLM and Qwen's
    reference number it. Raises ``ValueError`` naming the row when a run's length does not
    match its grid, or when runs and grids do not pair up (a video's frames all in one row).
    """
    batch, seq = input_ids.shape
    out = torch.zeros(batch, 3, seq, dtype=torch.long)
    kinds = {image_token_id: _Visuals("image", image_grid_thw, None, None)}
    if video_token_id is not None:
        if frames_apart:  # Qwen3-VL: timestamps in text, no time scaling of the positions
            second_per_grid_ts = tokens_per_second = None
        if video_grid_thw is not None and tokens_per_second is not None and second_per_grid_ts is None:
            raise ValueError("video_grid_thw without second_per_grid_ts: Qwen2.5-VL times its videos by them")
        kinds[video_token_id] = _Visuals(
            "video", video_grid_thw, second_per_grid_ts, tokens_per_second, frames_apart
        )
    elif video_grid_thw is not None and video_grid_thw.shape[0]:
        raise ValueError("video_grid_thw was given without video_token_id")
    for row in range(batch):
        valid = attention_mask[row].bool()
        ids = input_ids[row][valid].tolist()
        pieces: list[torch.Tensor] = []
        pos, i = 0, 0
        while i < len(ids):
            j, visual = i + 1, kinds.get(ids[i])
            # A visual run: the same placeholder repeated; a text run: up to the next placeholder.
            while j < len(ids) and (ids[j] == ids[i] if visual else ids[j] not in kinds):
                j += 1
            if visual is None:
                pieces.append(torch.arange(pos, pos + j - i).expand(3, -1))
                pos += j - i
            else:
                piece = visual.positions(row, j - i, spatial_merge_size) + pos
                pieces.append(piece)
                pos = int(piece.max()) + 1
            i = j
        for visual in kinds.values():
            visual.check_row_done(row)
        if pieces:
            out[row, :, valid] = torch.cat(pieces, dim=1)
    for visual in kinds.values():
        visual.check_all_used()
    return out


class _Visuals:
    """The grids of one kind of visual input (images or videos), handed out run by run
    (``frames_apart``: a video's grid frame by frame, one run each)."""

    def __init__(self, kind: str, grids, seconds, tokens_per_second, frames_apart: bool = False):
        self.kind = kind
        self.article = "an" if kind == "image" else "a"
        self.grids = [] if grids is None else grids.tolist()
        self.seconds = None if seconds is None else [float(s) for s in torch.as_tensor(seconds).flatten()]
        if self.seconds is not None and len(self.seconds) != len(self.grids):
            raise ValueError(
                f"{len(self.seconds)} second_per_grid_ts entries for {len(self.grids)} {kind} grids; "
                "each video needs one"
            )
        self.tokens_per_second = tokens_per_second
        self.frames_apart = frames_apart
        self.used = 0  # grids fully handed out
        self.frame = 0  # frames_apart: frames of grid `used` handed out so far

    def positions(self, row: int, run: int, merge: int) -> torch.Tensor:
        """``[3, run]`` positions (from 0) of the next grid (frame), checked against the run's length."""
        if self.used >= len(self.grids):
            raise ValueError(
                f"row {row}: {self.article} {self.kind} placeholder run of {run} tokens has no {self.kind}_grid_thw entry "
                f"({len(self.grids)} grid(s) for the batch)"
            )
        if self.frames_apart:
            return self._frame_positions(row, run, merge)
        t, h, w = self.grids[self.used]
        step = 1.0
        if self.kind == "video" and self.tokens_per_second is not None:
            step = self.seconds[self.used] * self.tokens_per_second
        self.used += 1
        h, w = h // merge, w // merge
        if t * h * w != run:
            raise ValueError(
                f"row {row}: {self.article} {self.kind} takes {run} placeholder tokens "
                f"but its {self.kind}_grid_thw {[t, h * merge, w * merge]} implies {t * h * w} "
                f"(t x h x w / {merge}^2)"
            )
        times = (torch.arange(t, dtype=torch.float64) * step).long() if step != 1.0 else torch.arange(t)
        return _grid_positions(times, h, w)

    def _frame_positions(self, row: int, run: int, merge: int) -> torch.Tensor:
        """The next frame of the current video, numbered as a one-frame image (Qwen3-VL)."""
        t, h, w = self.grids[self.used]
        frame, video = self.frame, self.used
        self.frame += 1
        if self.frame == t:
            self.used, self.frame = self.used + 1, 0
        h, w = h // merge, w // merge
        if h * w != run:
            raise ValueError(
                f"row {row}: frame {frame} of {self.kind} {video} takes {run} placeholder tokens but its "
                f"{self.kind}_grid_thw {[t, h * merge, w * merge]} implies {h * w} per frame "
                f"(h x w / {merge}^2; each frame is its own run after its timestamp)"
            )
        return _grid_positions(torch.zeros(1, dtype=torch.long), h, w)

    def check_row_done(self, row: int) -> None:
        """A row ends between videos: every frame of a video lies in one row."""
        if self.frame:
            t = self.grids[self.used][0]
            raise ValueError(
                f"row {row}: {self.kind} {self.used} has {t} frames (video_grid_thw {self.grids[self.used]}) "
                f"but the row ends after {self.frame} runs of its tokens; each frame needs its own run"
            )

    def check_all_used(self) -> None:
        if self.used != len(self.grids):
            raise ValueError(
                f"{len(self.grids)} {self.kind}_grid_thw entries but only {self.used} {self.kind} placeholder "
                "runs in the batch"
            )


def _grid_positions(times: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``[3, T*h*w]`` (time, row, column) of a ``T x h x w`` grid of merged patches, ``times[k]``
    the time position of temporal patch ``k``."""
    t = times.numel()
    ti = times.view(-1, 1, 1).expand(t, h, w).flatten()
    hi = torch.arange(h).view(1, -1, 1).expand(t, h, w).flatten()
    wi = torch.arange(w).view(1, 1, -1).expand(t, h, w).flatten()
    return torch.stack([ti, hi, wi])


def extend_positions(prompt_positions: torch.Tensor, length: int) -> torch.Tensor:
    """Positions of ``length`` tokens generated after each prompt: ``[B, S]`` or ``[B, 3, S]`` ->
    the same rank with ``S + length`` positions, continuing from each row's last position.

    Generated text advances every M-RoPE stream by one per token, exactly as
    ``get_rope_index`` would number it over the whole sequence (the prompt ends in text).
    """
    last = prompt_positions[..., -1:]
    steps = torch.arange(1, length + 1, dtype=prompt_positions.dtype)
    return torch.cat([prompt_positions, last + steps], dim=-1)
