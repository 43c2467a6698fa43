"""Generate SFT transcripts for the tiny ``arith`` task (``"3+5="`` -> ``"8"``), the stage before RL.

    python tools/data/arith_sft.py --output-dir data/arith_sft --train-size 2000 --test-size 100 --seed 0

Each row is one solved problem in both layouts verl's SFT dataset reads: ``messages`` (a user
message with the RL prompt ``"a+b="``, an assistant message with the sum exactly as the arith
reward scores it; the chat template adds the end-of-turn) for multi-turn SFT, and ``question`` /
``answer`` for single-turn SFT. Rendered with the chat template, a transcript is what
``tools/make_tiny_model.py`` pre-trains on and what an RL rollout that earns reward 1 looks like.

Problems come from ``make_arith_split`` as in ``tools/data/arith.py``: with the same --seed,
--test-size and --max-operand, the test split is the RL task's, and no train transcript solves
an RL test problem. Files are written atomically.
"""

from __future__ import annotations

import argparse
import os

from rlhf_megatron.data.preprocess import write_parquet_atomic
from rlhf_megatron.data.synthetic import make_arith_split


def sft_row(question: str, answer: str, split: str, index: int) -> dict:
    return {
        "data_source": "arith",
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        "question": question,
        "answer": answer,
        "extra_info": {"split": split, "index": index},
    }


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
        rows = [sft_row(p["question"], p["answer"], split, i) for i, p in enumerate(problems)]
        paths.append(write_parquet_atomic(rows, os.path.join(args.output_dir, f"{split}.parquet")))
        print(f"wrote {len(rows)} rows to {paths[-1]}")
    return paths


if __name__ == "__main__":
    main()
