"""Seeded synthetic tasks: tiny arithmetic (the CPU quickstart) and Countdown (TinyZero).

Both generators are pure functions of their arguments, so the train/test parquet files from
`tools/data/arith.py` and `tools/data/countdown.py` and the pretraining text of
`tools/make_tiny_model.py` agree with each other for the same seed.

*Arith.* ``"a+b="`` with ``0 <= a, b <= max_operand`` (default 30, so answers have at most two
digits and the prompt is a handful of characters). The expected response is the sum as a
decimal string followed by eos. There are only ``(max_operand + 1) ** 2`` distinct problems,
so a large training set repeats problems; test problems never appear in the training set.

*Countdown.* 3–4 integers in ``1..max_number`` and a target that some expression using each
number exactly once reaches. The target is built by combining the numbers with random
operations (subtraction and division only when they give a positive integer), so every task
is solvable; the generating expression is kept as ``solution``.

*Squares.* The vision tasks (`tools/data/shapes_vl.py`, `tools/data/shapes_video.py`) place
non-overlapping coloured squares on a 4 x 4 grid (`square_boxes`) and write their splits laid
out like a Hub dataset repository (`write_repository_splits`).

Boundaries: produces plain Python rows; turning them into verl parquet rows is in
`rlhf_megatron.data.preprocess`.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "ArithProblem",
    "CountdownProblem",
    "make_arith_rows",
    "make_arith_split",
    "make_countdown_split",
    "check_max_count",
    "shapes_split_parser",
    "square_boxes",
    "write_repository_splits",
]

SQUARE_COLORS = ((220, 40, 40), (40, 160, 60), (40, 80, 220), (230, 170, 20), (150, 60, 190))
SQUARE_CELLS = 4
"""The squares' grid: ``SQUARE_CELLS x SQUARE_CELLS`` cells, at most one square each."""


@dataclass(frozen=True)
class ArithProblem:
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    @property
    def text(self) -> str:
        """Question and answer, e.g. ``"3+5=8"`` (pretraining text)."""
        return self.question + self.answer

    def as_row(self) -> dict:
        return {"question": self.question, "answer": self.answer, "text": self.text, "a": self.a, "b": self.b}


def _arith_pool(max_operand: int) -> list[ArithProblem]:
    if max_operand < 1:
        raise ValueError(f"arith: max_operand must be at least 1, got {max_operand}.")
    return [ArithProblem(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]


def _draw(pool: list, n: int, rng: random.Random) -> list:
    """``n`` items: a shuffled pass over ``pool``, then further shuffled passes as needed."""
    if n > 0 and not pool:
        raise ValueError("no problems left to draw from")
    out: list = []
    while len(out) < n:
        batch = pool[:]
        rng.shuffle(batch)
        out.extend(batch[: n - len(out)])
    return out


def make_arith_rows(n: int, seed: int, max_operand: int = 30) -> list[dict]:
    """``n`` addition problems as dicts (question, answer, text, a, b); distinct while ``n`` allows."""
    return [p.as_row() for p in _draw(_arith_pool(max_operand), n, random.Random(seed))]


def make_arith_split(
    train_size: int, test_size: int, seed: int, max_operand: int = 30
) -> tuple[list[dict], list[dict]]:
    """Train and test rows; test problems are distinct and never appear in train."""
    pool = _arith_pool(max_operand)
    if test_size >= len(pool):
        raise ValueError(
            f"arith: test_size={test_size} leaves no training problems out of {len(pool)} "
            f"(max_operand={max_operand}); lower test_size or raise max_operand."
        )
    rng = random.Random(seed)
    rng.shuffle(pool)
    test, train_pool = pool[:test_size], pool[test_size:]
    return [p.as_row() for p in _draw(train_pool, train_size, rng)], [p.as_row() for p in test]


@dataclass(frozen=True)
class CountdownProblem:
    numbers: tuple[int, ...]
    target: int
    solution: str

    def as_row(self) -> dict:
        return {"numbers": list(self.numbers), "target": self.target, "solution": self.solution}


def _combine(rng: random.Random, x: tuple[int, str], y: tuple[int, str]) -> tuple[int, str] | None:
    """One random operation on two (value, expression) pairs; None if it gives no positive int."""
    (vx, ex), (vy, ey) = x, y
    op = rng.choice("+-*/")
    if op in "-/" and vx < vy:
        (vx, ex), (vy, ey) = (vy, ey), (vx, ex)
    if op == "+":
        value = vx + vy
    elif op == "*":
        value = vx * vy
    elif op == "-":
        value = vx - vy
    elif vy != 0 and vx % vy == 0:
        value = vx // vy
    else:
        return None
    if value <= 0:
        return None
    return value, f"({ex} {op} {ey})"


def _random_countdown(rng: random.Random, min_count: int, max_count: int, max_number: int, max_target: int):
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(rng.randint(min_count, max_count))]
        items: list[tuple[int, str] | None] = [(v, str(v)) for v in numbers]
        while len(items) > 1 and items[-1] is not None:
            x = items.pop(rng.randrange(len(items)))
            y = items.pop(rng.randrange(len(items)))
            items.append(_combine(rng, x, y))  # None ends this attempt
        if items[-1] is not None and len(items) == 1 and 1 <= items[0][0] <= max_target:
            expression = items[0][1]
            expression = expression[1:-1] if expression.startswith("(") else expression
            rng.shuffle(numbers)  # present the numbers in an order unrelated to the solution
            return CountdownProblem(tuple(numbers), items[0][0], expression)


def make_countdown_split(
    train_size: int,
    test_size: int,
    seed: int,
    min_count: int = 3,
    max_count: int = 4,
    max_number: int = 99,
    max_target: int = 100,
) -> tuple[list[dict], list[dict]]:
    """Distinct Countdown tasks (numbers, target, solution); no (numbers, target) is in both splits."""
    if not 2 <= min_count <= max_count:
        raise ValueError(f"countdown: need 2 <= min_count <= max_count, got {min_count}, {max_count}.")
    rng = random.Random(seed)
    seen: set[tuple[tuple[int, ...], int]] = set()
    problems: list[CountdownProblem] = []
    attempts, wanted = 0, train_size + test_size
    while len(problems) < wanted:
        attempts += 1
        if attempts > 50 * wanted + 1000:
            raise ValueError(
                f"countdown: found only {len(problems)} distinct tasks of {wanted} requested; "
                "widen max_number/max_target or ask for fewer."
            )
        problem = _random_countdown(rng, min_count, max_count, max_number, max_target)
        key = (tuple(sorted(problem.numbers)), problem.target)
        if key not in seen:
            seen.add(key)
            problems.append(problem)
    return [p.as_row() for p in problems[:train_size]], [p.as_row() for p in problems[train_size:]]


# -- the arith data tools' command line (tools/data/arith*.py) ------------------------------------


def arith_split_parser(description: str) -> argparse.ArgumentParser:
    """The options every arith data tool takes: where, how many, seed, operand range."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output-dir", required=True, help="directory for train.parquet and test.parquet")
    parser.add_argument("--train-size", type=int, required=True)
    parser.add_argument("--test-size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=30, help="operands are drawn from 0..max-operand")
    return parser


def write_arith_splits(args: argparse.Namespace, make_row: Callable[[dict, str, int], dict]) -> list[str]:
    """``make_arith_split``'s train and test problems as ``make_row(problem, split, index)`` rows in
    ``<output_dir>/{train,test}.parquet`` (atomically); returns the paths."""
    from rlhf_megatron.data.preprocess import write_parquet_atomic

    train, test = make_arith_split(args.train_size, args.test_size, args.seed, args.max_operand)
    paths = []
    for split, problems in (("train", train), ("test", test)):
        rows = [make_row(p, split, i) for i, p in enumerate(problems)]
        paths.append(write_parquet_atomic(rows, os.path.join(args.output_dir, f"{split}.parquet")))
        print(f"wrote {len(rows)} rows to {paths[-1]}")
    return paths


def square_boxes(rng: random.Random, size: int, count: int) -> list[tuple[list[int], tuple[int, int, int]]]:
    """``count`` squares on a ``size x size`` canvas, each in its own cell of the grid so none
    overlap: ``([x0, y0, x1, y1], colour)`` each, drawn from ``rng`` cell, side, colour in turn."""
    cell = size // SQUARE_CELLS
    out = []
    for slot in rng.sample(range(SQUARE_CELLS * SQUARE_CELLS), count):
        x, y = (slot % SQUARE_CELLS) * cell, (slot // SQUARE_CELLS) * cell
        side = rng.randint(cell // 2, cell - 2)
        out.append(([x + 1, y + 1, x + side, y + side], rng.choice(SQUARE_COLORS)))
    return out


def squares_image(size: int, boxes: list[tuple[list[int], tuple[int, int, int]]]):
    """A white ``size x size`` PIL image with ``boxes`` (``square_boxes``' entries) drawn on it."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for box, colour in boxes:
        draw.rectangle(box, fill=colour)
    return image


def png_bytes(image) -> bytes:
    """A PIL image as PNG bytes (what HF datasets' Image feature stores)."""
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def shapes_split_parser(description: str, what: str, size: int, max_count: int) -> argparse.ArgumentParser:
    """The options every squares tool takes: where, how many, seed, ``what``'s side, most squares."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--output-dir", required=True, help="dataset directory (data/<split>-*.parquet inside)"
    )
    parser.add_argument("--train-size", type=int, required=True)
    parser.add_argument("--test-size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=size, help=f"{what} side in pixels")
    parser.add_argument(
        "--max-count", type=int, default=max_count, help=f"most squares in one {what} (at most 16)"
    )
    return parser


def check_max_count(parser: argparse.ArgumentParser, max_count: int) -> None:
    if not 1 <= max_count <= SQUARE_CELLS * SQUARE_CELLS:
        parser.error(f"--max-count must be in 1..16 (a 4 x 4 grid), got {max_count}")


def write_repository_splits(
    args: argparse.Namespace, make_rows: Callable[[int, random.Random], list[dict]]
) -> list[str]:
    """``make_rows(n, rng)`` for the train then the test split, one ``random.Random(args.seed)``
    throughout, written atomically to ``<output_dir>/data/{split}-00000-of-00001.parquet``;
    returns the paths."""
    from rlhf_megatron.data.preprocess import write_parquet_atomic

    rng = random.Random(args.seed)
    paths = []
    for split, n in (("train", args.train_size), ("test", args.test_size)):
        rows = make_rows(n, rng)
        path = os.path.join(args.output_dir, "data", f"{split}-00000-of-00001.parquet")
        paths.append(write_parquet_atomic(rows, path))
        print(f"wrote {len(rows)} rows to {path}")
    return paths
