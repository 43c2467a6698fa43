"""Generate the Countdown task (TinyZero) as verl-format train/test parquet files.

    python tools/data/countdown.py --output-dir data/countdown --train-size 10000 --test-size 500 --seed 0

Each task gives 3-4 numbers in 1..99 and a target reachable with + - * / using each number
once; the model must answer inside ``<answer> </answer>``. Train and test tasks are distinct.
Files are written atomically.
"""

from __future__ import annotations

import argparse
import os

from rlhf_megatron.data.preprocess import countdown_row, write_parquet_atomic
from rlhf_megatron.data.synthetic import make_countdown_split


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True, help="directory for train.parquet and test.parquet")
    parser.add_argument("--train-size", type=int, required=True)
    parser.add_argument("--test-size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-number", type=int, default=99, help="numbers are drawn from 1..max-number")
    parser.add_argument("--max-target", type=int, default=100, help="targets lie in 1..max-target")
    args = parser.parse_args(argv)

    train, test = make_countdown_split(
        args.train_size, args.test_size, args.seed, max_number=args.max_number, max_target=args.max_target
    )
    paths = []
    for split, problems in (("train", train), ("test", test)):
        rows = [
            countdown_row(p["numbers"], p["target"], p["solution"], split, i) for i, p in enumerate(problems)
        ]
        paths.append(write_parquet_atomic(rows, os.path.join(args.output_dir, f"{split}.parquet")))
        print(f"wrote {len(rows)} rows to {paths[-1]}")
    return paths


if __name__ == "__main__":
    main()
