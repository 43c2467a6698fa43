"""Generate a tiny video-counting task in EasyR1's or verl's layout: squares appear one after another.

    python tools/data/shapes_video.py --output-dir data/shapes_video --train-size 512 --test-size 32 --seed 0

writes ``data/shapes_video/data/train-00000-of-00001.parquet`` and ``.../test-00000-of-00001.parquet``
with EasyR1's video columns: ``problem`` (``"<video>How many squares appear in the video?"``),
``answer`` (the count, a string) and ``videos`` (one MPEG-4 clip per row, stored as
``{"bytes": ...}``, decoded by the dataset with PyAV). ``--layout verl`` writes verl's columns
instead: ``data_source``, ``prompt`` (the problem as a user message), ``videos`` (per row one
``{"video": [PNG frame, ...], "fps": --fps}``), ``reward_model.ground_truth`` and ``extra_info``.
Each clip has ``--frames`` frames of ``--size`` pixels square at ``--fps`` frames per second; 1 to
``--max-count`` squares (drawn as ``shapes_vl.py`` draws them, on a 4 x 4 grid so none overlap)
appear at random frames, the first in the first frame, and stay: only the last frames show them
all. Train with ``data.video_key=videos data.video_fps=<--fps>``, or
``configs/quickstart_video_cpu.yaml``. Files are written atomically; the same seed gives the same
files.
"""

from __future__ import annotations

import io
import random

import av
import numpy as np
from PIL import Image

from rlhf_megatron.data.synthetic import (
    check_max_count,
    png_bytes,
    shapes_split_parser,
    square_boxes,
    squares_image,
    write_repository_splits,
)

PROBLEM = "<video>How many squares appear in the video?"


def frames(rng: random.Random, size: int, frame_count: int, count: int) -> list[Image.Image]:
    """``count`` squares on white, the first from frame 0, the others appearing at random frames
    (drawn as ``shapes_vl.py`` draws them, on a 4 x 4 grid so none overlap)."""
    shapes = square_boxes(rng, size, count)
    starts = [0] + sorted(rng.randrange(frame_count) for _ in range(count - 1))
    return [
        squares_image(size, [shape for shape, start in zip(shapes, starts) if f >= start])
        for f in range(frame_count)
    ]


def mp4(images: list[Image.Image], fps: int) -> bytes:
    """The frames as MPEG-4 bytes at ``fps``."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = images[0].size
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "2"}  # near-lossless: the colours survive the encoding
        for image in images:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.asarray(image), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def make_rows(
    n: int,
    rng: random.Random,
    size: int,
    frame_count: int,
    fps: int,
    max_count: int,
    layout: str = "easyr1",
) -> list[dict]:
    """``easyr1``: problem / answer / videos (an MPEG-4 clip). ``verl``: data_source / prompt (chat
    messages) / videos (a dict of PNG frames and their fps) / reward_model / extra_info."""
    rows = []
    for i in range(n):
        count = rng.randint(1, max_count)
        images = frames(rng, size, frame_count, count)
        if layout == "easyr1":
            video = {"bytes": mp4(images, fps), "path": None}
            rows.append({"problem": PROBLEM, "answer": str(count), "videos": [video]})
        else:
            rows.append(
                {
                    "data_source": "shapes_video",
                    "prompt": [{"role": "user", "content": PROBLEM}],
                    "videos": [{"video": [png_bytes(image) for image in images], "fps": float(fps)}],
                    "reward_model": {"style": "rule", "ground_truth": str(count)},
                    "extra_info": {"index": i},
                }
            )
    return rows


def main(argv: list[str] | None = None) -> list[str]:
    parser = shapes_split_parser(__doc__.splitlines()[0], "frame", size=56, max_count=4)
    parser.add_argument("--frames", type=int, default=4, help="frames per clip")
    parser.add_argument("--fps", type=int, default=2, help="frames per second of the clips")
    parser.add_argument(
        "--layout",
        choices=("easyr1", "verl"),
        default="easyr1",
        help="easyr1: problem / answer / videos (MPEG-4 clips); verl: prompt messages, videos as PNG frames",
    )
    args = parser.parse_args(argv)
    check_max_count(parser, args.max_count)
    if args.size < 16 or args.size % 2:
        parser.error(
            f"--size must be an even number of pixels, at least 16 (the encoder's 4:2:0), got {args.size}"
        )
    if args.frames < 2 or args.fps < 1:
        parser.error(f"--frames must be at least 2 and --fps at least 1, got {args.frames} and {args.fps}")
    return write_repository_splits(
        args,
        lambda n, rng: make_rows(n, rng, args.size, args.frames, args.fps, args.max_count, args.layout),
    )


if __name__ == "__main__":
    main()
