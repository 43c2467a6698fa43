"""Videos of vision-language prompts: decoding, frame sampling and pixel bounds (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

A dataset row's videos (``data.video_key``) may be stored as a file path (``file://`` allowed), raw
bytes of a video file, ``{"bytes": ...}`` / ``{"path": ...}`` (what HF ``datasets`` hold), verl's
``{"video": ..., "fps": ..., "nframes": ..., "max_frames": ..., "min_pixels": ..., "max_pixels": ...}``
(the extra keys override the run's settings for that video), or a list of frames: a video already
split into images, each frame anything `open_image` takes or a uint8 RGB array ``[H, W, 3]``.
`load_video` turns one into a `Video`: uint8 RGB frames ``[T, H, W, 3]`` with ``T`` a multiple of
`FRAME_FACTOR` (the model's temporal patch), plus the fps of those frames (Qwen2.5-VL's
``second_per_grid_ts`` comes from it) and, decoded from a file, the source frames they are
(Qwen3-VL's timestamps come from those).

Files and bytes are decoded with PyAV and sampled in time the way qwen-vl-utils' ``fetch_video``
(EasyR1's ``process_video``) does: ``duration x data.video_fps`` frames, clamped to ``[min_frames,
min(data.video_max_frames, source frames)]`` and rounded to a multiple of `FRAME_FACTOR`, spread
evenly over the clip (or exactly ``nframes`` frames when a verl row asks for them). A frame list is
taken as already sampled at ``data.video_fps``: it is only padded (its last frame repeated) to a
multiple of `FRAME_FACTOR`. Every frame is then bounded like an image (`target_size`, EasyR1's
rule: at most ``data.max_pixels`` pixels, then at least ``data.min_pixels``), all frames of one
video at the size of its first.

Boundaries: PyAV, PIL and numpy only (PyAV is imported when a file is decoded, so text-only and
image-only runs do not need it); no torch, Megatron, Ray or vLLM.
"""

from __future__ import annotations

import io
import math
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rlhf_megatron.data.multimodal import ImageError, locate_file, open_image, target_size

__all__ = [
    "FRAME_FACTOR",
    "VIDEO_PLACEHOLDER",
    "Video",
    "VideoError",
    "load_video",
    "video_list",
]

# How EasyR1 and verl mark a video's place in a prompt's text.
VIDEO_PLACEHOLDER = "<video>"

# Frames come in multiples of this: Qwen2-VL's temporal_patch_size (two frames per temporal patch).
FRAME_FACTOR = 2

_FILE_PREFIX = "file://"


class VideoError(ValueError):
    """A video cannot be found, decoded or sampled; the dataset adds the file, row and column."""


def video_list(value: Any) -> list:
    """A videos cell as a list of videos: null -> [], a list/tuple/object array -> its items (each one
    video), any other single value (a path, bytes, a dict, a ``[T, H, W, 3]`` array) -> [it]."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.dtype == object):
        return list(value)
    return [value]


@dataclass(frozen=True, eq=False)
class Video:
    """One prepared video: what the processor and the rollout engine get."""

    frames: np.ndarray
    """uint8 ``[T, H, W, 3]`` RGB; ``T`` a multiple of `FRAME_FACTOR`, at least `FRAME_FACTOR`."""
    fps: float
    """Frames per second of the sampled frames (not of the source)."""
    source_frames: int
    """Frames the source had: the decoded count, or the length of a frame list."""
    source_fps: float | None = None
    """Frames per second of a decoded source; None for a frame list (its frames are the clip, at ``fps``)."""
    frame_indices: tuple[int, ...] | None = None
    """The source frame each of ``frames`` is (a decoded source, ``T`` entries); None for a frame list."""

    @property
    def second_per_grid(self) -> float:
        """Seconds one temporal patch spans: Qwen2.5-VL's ``second_per_grid_ts``."""
        return FRAME_FACTOR / self.fps

    def metadata(self) -> dict[str, Any]:
        """The frames' timing as transformers' ``VideoMetadata`` and vLLM's video items take it.

        A decoded video is described by its source (its fps and frame count, and which source
        frame each kept frame is), a frame list as a clip of its (padded) frames at ``fps``.
        Either way the sampled fps the processors derive, ``len(frames_indices) /
        total_num_frames * fps``, is this video's ``fps`` (Qwen2.5-VL's seconds per temporal
        patch come from it), and ``frames_indices / fps`` are the frames' times in seconds
        (Qwen3-VL writes them into the prompt as timestamps)."""
        if self.frame_indices is None:
            count = int(self.frames.shape[0])
            fps, total, indices = float(self.fps), count, list(range(count))
        else:
            fps, total, indices = float(self.source_fps), self.source_frames, list(self.frame_indices)
        return {
            "fps": fps,
            "duration": total / fps,
            "total_num_frames": total,
            "frames_indices": indices,
            "video_backend": "pyav",
        }


@dataclass(frozen=True)
class _Settings:
    fps: float
    min_pixels: int | None
    max_pixels: int | None
    max_frames: int
    min_frames: int
    nframes: float | None = None


# Keys of verl's video dict that override `load_video`'s arguments for that one video.
_OVERRIDES = ("fps", "nframes", "max_frames", "min_frames", "min_pixels", "max_pixels")


def load_video(
    value: Any,
    *,
    fps: float = 2.0,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    max_frames: int = 768,
    min_frames: int = 4,
    base_dir: str | None = None,
) -> Video:
    """Decode, sample and bound one video (see the module docstring for what ``value`` may be).

    ``fps`` is the sampling rate (``data.video_fps``; for a frame list, the rate it was sampled
    at), ``max_frames``/``min_frames`` bound the sampled frame count, ``min_pixels``/``max_pixels``
    bound each frame's pixels (`target_size`). Relative paths are looked up in ``base_dir`` (the data
    file's directory), then in the current directory.
    """
    settings = _Settings(fps, min_pixels, max_pixels, max_frames, min_frames)
    source, settings = _unwrap(value, settings)
    _check_settings(settings)
    if isinstance(source, np.ndarray) and source.dtype != object and source.ndim == 4:
        source = list(source)  # a [T, H, W, 3] array: a video already split into frames
    if isinstance(source, (list, tuple)) or (isinstance(source, np.ndarray) and source.dtype == object):
        return _from_frames(list(source), settings, base_dir)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            raise VideoError("a video's bytes are empty; the row holds no video data")
        return _decode(data, f"{len(data)} bytes of video", settings)
    if isinstance(source, (str, os.PathLike)):
        path = _find_file(os.fspath(source), base_dir)
        return _decode(path, f"video file {path}", settings)
    raise VideoError(
        "a video must be a path, bytes, {'bytes'|'path': ...}, {'video': ...} or a list of frames, "
        f"got {type(source).__name__}"
    )


def _unwrap(value: Any, settings: _Settings) -> tuple[Any, _Settings]:
    """The video inside dicts (HF's ``{"bytes"|"path"}``, verl's ``{"video"}``) and its overrides."""
    while isinstance(value, dict):
        kind = value.get("type")
        if kind is not None and kind != "video":
            raise VideoError(f"a dict of type {kind!r} is not a video (expected type 'video' or no 'type')")
        overrides = {key: value[key] for key in _OVERRIDES if value.get(key) is not None}
        settings = replace(settings, **overrides)
        if value.get("video") is not None:
            value = value["video"]
        elif value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path"):
            value = value["path"]
        else:
            raise VideoError(f"a video dict needs 'video', 'bytes' or 'path', got keys {sorted(value)}")
    return value, settings


def _check_settings(s: _Settings) -> None:
    if not isinstance(s.fps, numbers.Real) or not math.isfinite(s.fps) or s.fps <= 0:
        raise VideoError(
            f"the video fps must be a positive number, got {s.fps!r}; "
            "set data.video_fps (or the video's 'fps') to the frames per second to sample"
        )
    if s.max_frames < FRAME_FACTOR:
        raise VideoError(
            f"max_frames={s.max_frames} is below {FRAME_FACTOR}, the frames of one temporal patch; "
            f"raise data.video_max_frames (or the video's 'max_frames') to at least {FRAME_FACTOR}"
        )
    n = s.nframes
    if n is not None and (not isinstance(n, numbers.Real) or not math.isfinite(n) or n < 1):
        raise VideoError(f"the video's nframes must be at least 1, got {s.nframes!r}")


def _find_file(path: str, base_dir: str | None) -> str:
    if path.startswith(_FILE_PREFIX):
        path = path[len(_FILE_PREFIX) :]
    if path.startswith(("http://", "https://")):
        raise VideoError(f"video {path!r} is a URL; videos are not downloaded, store a local path or bytes")
    found, looked = locate_file(path, base_dir)
    if found is None:
        raise VideoError(
            f"video file {path!r} does not exist (looked for {looked}); "
            "relative video paths are resolved against the data file's directory, then the current directory"
        )
    return found


# ---------------------------------------------------------------------------------------------- sampling


def _round_to_factor(x: float) -> int:
    return int(math.floor(x / FRAME_FACTOR + 0.5)) * FRAME_FACTOR


def _ceil_to_factor(x: float) -> int:
    return math.ceil(x / FRAME_FACTOR) * FRAME_FACTOR


def _floor_to_factor(x: float) -> int:
    return math.floor(x / FRAME_FACTOR) * FRAME_FACTOR


def _frame_count(total: int, src_fps: float, s: _Settings, label: str) -> int:
    """How many frames to sample from ``total`` decoded frames at ``src_fps``: a multiple of FRAME_FACTOR."""
    if s.nframes is not None:
        if s.nframes > max(total, FRAME_FACTOR):
            raise VideoError(
                f"the video asks for nframes={s.nframes:g} but {label} has only {total} frames; "
                "lower the row's 'nframes' or drop it to sample by fps"
            )
        if total < FRAME_FACTOR:
            return FRAME_FACTOR
        n = min(_round_to_factor(s.nframes), _floor_to_factor(s.max_frames), _floor_to_factor(total))
        return max(n, FRAME_FACTOR)
    if total < FRAME_FACTOR:
        return FRAME_FACTOR  # a one-frame clip: its frame repeated to fill one temporal patch
    lower = _ceil_to_factor(s.min_frames)
    upper = _floor_to_factor(min(s.max_frames, total))
    n = total / src_fps * s.fps
    n = upper if upper < lower else min(max(n, lower), upper)
    return max(_round_to_factor(n), FRAME_FACTOR)


def _sample_indices(total: int, n: int) -> np.ndarray:
    return np.linspace(0, total - 1, n).round().astype(int)


# ---------------------------------------------------------------------------------------------- decoding


def _decode(source: str | bytes, label: str, s: _Settings) -> Video:
    """Decode a file or bytes with PyAV and sample it: one decoding pass when the container states
    its frame count (mp4/mov do) and the stated count is right, else a counting pass first."""
    try:
        import av
    except ImportError as err:
        raise ImportError("decoding videos needs PyAV (pip install av)") from err

    def open_container():
        return av.open(io.BytesIO(source) if isinstance(source, bytes) else source, mode="r")

    def decode_pass(wanted: set[int]) -> tuple[int, dict[int, np.ndarray]]:
        with open_container() as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            return _decode_frames(container.decode(stream), wanted, s, label)

    try:
        with open_container() as container:
            if not container.streams.video:
                kinds = sorted({stream.type for stream in container.streams}) or ["none"]
                raise VideoError(
                    f"{label} has no video stream (its streams: {', '.join(kinds)}); "
                    "data.video_key must name a column of videos"
                )
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            rate = _stream_rate(stream)
            seconds = _duration(stream, container)
            stated = int(stream.frames or 0)
            plan = None
            if stated > 0 and (rate or seconds):
                try:
                    plan = _frame_count(stated, rate or stated / seconds, s, label)
                except VideoError:
                    plan = None  # the stated count may be wrong: judge by the decoded one
            wanted = set(_sample_indices(stated, plan).tolist()) if plan else set()
            total, picked = _decode_frames(container.decode(stream), wanted, s, label)
        if total == 0:
            raise VideoError(f"{label} decodes to 0 frames; re-encode the clip or drop the row")
        src_fps = rate or (total / seconds if seconds else s.fps)
        n = _frame_count(total, src_fps, s, label)
        indices = _sample_indices(total, n)
        if plan is None or total != stated:
            _, picked = decode_pass(set(indices.tolist()))
    except VideoError:
        raise
    except Exception as err:
        raise VideoError(
            f"{label} cannot be decoded ({type(err).__name__}: {err}); "
            "check that the file plays (e.g. with ffprobe), re-encode it or drop the row"
        ) from err
    missing = sorted(set(indices.tolist()) - set(picked))
    if missing:  # the second pass decoded fewer frames than the first (a flaky decoder)
        raise VideoError(f"{label} decoded differently twice (frame {missing[0]} missing); re-encode it")
    frames = np.stack([picked[i] for i in indices.tolist()])
    return Video(
        frames=frames,
        fps=n / total * src_fps,
        source_frames=total,
        source_fps=src_fps,
        frame_indices=tuple(indices.tolist()),
    )


def _decode_frames(frames, wanted: set[int], s: _Settings, label: str) -> tuple[int, dict[int, np.ndarray]]:
    """Count decoded frames and keep the wanted ones, converted and bounded (see `_bounder`)."""
    picked: dict[int, np.ndarray] = {}
    bound = _bounder(s, label)
    total = 0
    for frame in frames:
        if total in wanted:
            picked[total] = bound(frame.to_ndarray(format="rgb24"))
        total += 1
    return total, picked


def _stream_rate(stream) -> float | None:
    for rate in (stream.average_rate, stream.guessed_rate):
        if rate is not None and float(rate) > 0 and math.isfinite(float(rate)):
            return float(rate)
    return None


def _duration(stream, container) -> float | None:
    """The stream's (else the container's) duration in seconds; None when unknown."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / 1_000_000  # av.time_base: microseconds
    return None


# ---------------------------------------------------------------------------------------------- frames


def _bounder(s: _Settings, label: str) -> Callable[[np.ndarray], np.ndarray]:
    """A function that resizes RGB frames to `target_size` of the first frame it was given."""
    size: list[tuple[int, int]] = []

    def bound(array: np.ndarray) -> np.ndarray:
        height, width = array.shape[:2]
        if not size:
            target = target_size(width, height, s.min_pixels, s.max_pixels)
            if min(target) < 1:
                raise VideoError(
                    f"{label}'s {width}x{height} frames shrink to {target[0]}x{target[1]} under "
                    f"max_pixels={s.max_pixels}; raise data.max_pixels"
                )
            size.append(target)
        if (width, height) == size[0]:
            return np.ascontiguousarray(array, dtype=np.uint8)
        from PIL import Image

        resized = Image.fromarray(array).resize(size[0], Image.Resampling.BICUBIC)
        return np.asarray(resized, dtype=np.uint8)

    return bound


def _from_frames(items: list, s: _Settings, base_dir: str | None) -> Video:
    """A video given as its frames: already sampled at ``s.fps``, padded to a multiple of FRAME_FACTOR."""
    count = len(items)
    label = f"a video of {count} frames"
    if count == 0:
        raise VideoError("a video's frame list is empty; a video needs at least one frame")
    if count > s.max_frames:
        raise VideoError(
            f"{label} has more than max_frames={s.max_frames} frames (a frame list is not resampled); "
            "raise data.video_max_frames or shorten the clip"
        )
    bound = _bounder(s, label)
    frames = []
    first_size = None
    for index, item in enumerate(items):
        array = _frame_array(item, index, label, base_dir)
        size = (array.shape[1], array.shape[0])
        if first_size is None:
            first_size = size
        elif size != first_size:
            raise VideoError(
                f"frame {index} of {label} is {size[0]}x{size[1]} but frame 0 is "
                f"{first_size[0]}x{first_size[1]}; all frames of a video must have one size"
            )
        frames.append(bound(array))
    frames.extend([frames[-1]] * (_ceil_to_factor(count) - count))
    return Video(frames=np.stack(frames), fps=float(s.fps), source_frames=count)


def _frame_array(item: Any, index: int, label: str, base_dir: str | None) -> np.ndarray:
    """One frame of a frame list as a uint8 RGB array [H, W, 3]."""
    if isinstance(item, np.ndarray):
        if item.dtype != np.uint8 or item.ndim != 3 or item.shape[2] != 3:
            raise VideoError(
                f"frame {index} of {label} is an array of {item.dtype} {list(item.shape)}; "
                "array frames must be uint8 [height, width, 3] RGB"
            )
        return item
    try:
        image = open_image(item, base_dir)
        image.load()
    except ImageError as err:
        raise VideoError(f"frame {index} of {label}: {err}") from err
    except Exception as err:
        raise VideoError(f"frame {index} of {label} cannot be decoded ({type(err).__name__}: {err})") from err
    return np.asarray(image if image.mode == "RGB" else image.convert("RGB"), dtype=np.uint8)
