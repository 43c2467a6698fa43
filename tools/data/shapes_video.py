"""Generate a tiny video-counting task in EasyR1's layout: squares appear one after another in a clip.

    python tools/data/shapes_video.py --output-dir data/shapes_video --train-size 512 --test-size 32 --seed 0

writes ``data/shapes_video/data/train-00000-of-00001.parquet`` and ``.../test-00000-of-00001.parquet``
with EasyR1's video columns: ``problem`` (``"<video>How many squares appear in the video?"``),
``answer`` (the count, a string) and ``videos`` (one MPEG-4 clip per row, stored as
``{"bytes": ...}``, decoded by the dataset with PyAV). Each clip has ``--frames`` frames of
``--size`` pixels square at ``--fps`` frames per second; 1 to ``--max-count`` squares (drawn as
``shapes_vl.py`` draws them, on a 4 x 4 grid so none overlap) appear at random frames, the first
in the first frame, and stay: only the last frames show them all. Train with
``data.video_key=videos data.video_fps=<--fps>``, or ``configs/quickstart_video_cpu.yaml``.
Files are written atomically; the same seed gives the same files.
"""

from __future__ import annotations

import io
import random

import av
import numpy as np
from PIL import Image, ImageDraw

from rlhf_megatron.data.synthetic import (
    check_max_count,
    shapes_split_parser,
    square_boxes,
    write_repository_splits,
)

PROBLEM = "<video>How many squares appear in the video?"


def clip(rng: random.Random, size: int, frames: int, fps: int, count: int) -> bytes:
    """MPEG-4 bytes: ``count`` squares appearing at random frames (the first at frame 0) on white."""
    shapes = square_boxes(rng, size, count)
    starts = [0] + sorted(rng.randrange(frames) for _ in range(count - 1))
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "2"}  # near-lossless: the colours survive the encoding
        for f in range(frames):
            image = Image.new("RGB", (size, size), (255, 255, 255))
            draw = ImageDraw.Draw(image)
            for (box, colour), start in zip(shapes, starts):
                if f >= start:
                    draw.rectangle(box, fill=colour)
            frame = av.VideoFrame.from_ndarray(np.asarray(image), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def make_rows(n: int, rng: random.Random, size: int, frames: int, fps: int, max_count: int) -> list[dict]:
    rows = []
    for _ in range(n):
        count = rng.randint(1, max_count)
        video = {"bytes": clip(rng, size, frames, fps, count), "path": None}
        rows.append({"problem": PROBLEM, "answer": str(count), "videos": [video]})
    return rows


def main(argv: list[str] | None = None) -> list[str]:
    parser = shapes_split_parser(__doc__.splitlines()[0], "frame", size=56, max_count=4)
    parser.add_argument("--frames", type=int, default=4, help="frames per clip")
    parser.add_argument("--fps", type=int, default=2, help="frames per second of the clips")
    args = parser.parse_args(argv)
    check_max_count(parser, args.max_count)
    if args.size < 16 or args.size % 2:
        parser.error(
            f"--size must be an even number of pixels, at least 16 (the encoder's 4:2:0), got {args.size}"
        )
    if args.frames < 2 or args.fps < 1:
        parser.error(f"--frames must be at least 2 and --fps at least 1, got {args.frames} and {args.fps}")
    return write_repository_splits(
        args, lambda n, rng: make_rows(n, rng, args.size, args.frames, args.fps, args.max_count)
    )


if __name__ == "__main__":
    main()
