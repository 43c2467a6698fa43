"""Generate the tiny ``arith`` task (``"3+5="`` -> ``"8"``) used by the CPU quickstart.

    python tools/data/arith.py --output-dir data/arith --train-size 2000 --test-size 100 --seed 0

Prompts are single user messages ``"a+b="`` with ``0 <= a, b <= --max-operand``; the ground truth
is the sum as a string and the expected response is that number followed by eos. Test problems
never appear in train. Files are written atomically.
"""

from __future__ import annotations

import argparse
import os

from rlhf_megatron.data.preprocess import arith_row, write_parquet_atomic
from rlhf_megatron.data.synthetic import make_arith_split


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True, help="directory for train.parquet and test.parquet")
    parser.add_argument("--train-size", type=int, required=True)
    parser.add_argument("--test-size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=30, help="operands are drawn from 0..max-operand")
    args = parser.parse_args(argv)

    train, test = make_arith_split(args.train_size, args.test_size, args.seed, args.max_operand)
    paths = []
    for split, problems in (("train", train), ("test", test)):
        rows = [arith_row(p["question"], p["answer"], split, i) for i, p in enumerate(problems)]
        paths.append(write_parquet_atomic(rows, os.path.join(args.output_dir, f"{split}.parquet")))
        print(f"wrote {len(rows)} rows to {paths[-1]}")
    return paths


if __name__ == "__main__":
    main()
