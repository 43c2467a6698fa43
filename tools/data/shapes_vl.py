"""Generate a tiny image-counting task in EasyR1's layout, laid out like a Hub dataset repository.

    python tools/data/shapes_vl.py --output-dir data/shapes_vl --train-size 512 --test-size 32 --seed 0

writes ``data/shapes_vl/data/train-00000-of-00001.parquet`` and ``.../test-00000-of-00001.parquet``
with EasyR1's columns: ``problem`` (``"<image>How many squares are in the image?"``),
``answer`` (the count, a string) and ``images`` (one PNG per row, stored as ``{"bytes", "path"}``
like HF datasets' Image feature). It stands in for hiyouga/geometry3k where no hub is reachable:
train on it with ``data.train_files=data/shapes_vl@train data.val_files=data/shapes_vl@test
data.prompt_key=problem reward.score_fn=math`` and a format prompt asking for ``\\boxed{}``.
Each image is ``--size`` pixels square with 1 to ``--max-count`` non-overlapping coloured squares.
Files are written atomically; the same seed gives the same files.

``--sft`` also writes a ``messages`` column for image SFT (``python -m rlhf_megatron.sft
data.multiturn.enable=true``): the problem as a user message (its ``<image>`` placeholder marks
where the image goes) and the answer as the assistant's reply, ``"There are 3 squares."``.
"""

from __future__ import annotations

import random

from rlhf_megatron.data.synthetic import (
    check_max_count,
    png_bytes,
    shapes_split_parser,
    square_boxes,
    squares_image,
    write_repository_splits,
)

PROBLEM = "<image>How many squares are in the image?"


def draw_squares(rng: random.Random, size: int, count: int) -> bytes:
    """PNG bytes: ``count`` squares on a white ``size x size`` canvas, on a grid so none overlap."""
    return png_bytes(squares_image(size, square_boxes(rng, size, count)))


def make_rows(n: int, rng: random.Random, size: int, max_count: int, sft: bool = False) -> list[dict]:
    rows = []
    for _ in range(n):
        count = rng.randint(1, max_count)
        image = {"bytes": draw_squares(rng, size, count), "path": None}
        row = {"problem": PROBLEM, "answer": str(count), "images": [image]}
        if sft:
            reply = f"There {'is' if count == 1 else 'are'} {count} square{'' if count == 1 else 's'}."
            row["messages"] = [{"role": "user", "content": PROBLEM}, {"role": "assistant", "content": reply}]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[str]:
    parser = shapes_split_parser(__doc__.splitlines()[0], "image", size=112, max_count=5)
    parser.add_argument("--sft", action="store_true", help="also write SFT transcripts (a messages column)")
    args = parser.parse_args(argv)
    check_max_count(parser, args.max_count)
    if args.size < 16:
        parser.error(f"--size must be at least 16 pixels, got {args.size}")
    return write_repository_splits(
        args, lambda n, rng: make_rows(n, rng, args.size, args.max_count, args.sft)
    )


if __name__ == "__main__":
    main()
