"""Generate the tiny ``arith`` task (``"3+5="`` -> ``"8"``) used by the CPU quickstart.

    python tools/data/arith.py --output-dir data/arith --train-size 2000 --test-size 100 --seed 0

Prompts are single user messages ``"a+b="`` with ``0 <= a, b <= --max-operand``; the ground truth
is the sum as a string and the expected response is that number followed by eos. Test problems
never appear in train. Files are written atomically.
"""

from __future__ import annotations

from rlhf_megatron.data.preprocess import arith_row
from rlhf_megatron.data.synthetic import arith_split_parser, write_arith_splits


def main(argv: list[str] | None = None) -> list[str]:
    args = arith_split_parser(__doc__.splitlines()[0]).parse_args(argv)
    return write_arith_splits(args, lambda p, split, i: arith_row(p["question"], p["answer"], split, i))


if __name__ == "__main__":
    main()
