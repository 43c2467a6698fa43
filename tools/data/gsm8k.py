"""Convert a local GSM8K JSON-lines file (fields ``question``, ``answer``) to verl-format parquet.

    python tools/data/gsm8k.py --input gsm8k/train.jsonl --output-dir data/gsm8k

writes ``data/gsm8k/train.parquet`` (split from the file name, or ``--split``). Each prompt is
the question followed by verl's instruction to answer after "####"; the ground truth is the
number after the reference solution's ``####``. The file is written atomically.
"""

from __future__ import annotations

import argparse
import os

from rlhf_megatron.data.preprocess import gsm8k_row, infer_split, read_jsonl, write_parquet_atomic


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="GSM8K JSON-lines file (question, answer)")
    parser.add_argument("--output-dir", required=True, help="directory for <split>.parquet")
    parser.add_argument("--split", default=None, help="split name (default: from the input file name)")
    args = parser.parse_args(argv)

    split = infer_split(args.input, args.split)
    rows = []
    for line_no, record in read_jsonl(args.input, ["question", "answer"]):
        try:
            rows.append(gsm8k_row(record["question"], record["answer"], split, index=len(rows)))
        except ValueError as err:
            raise ValueError(f"{args.input}:{line_no}: {err}") from err
    path = write_parquet_atomic(rows, os.path.join(args.output_dir, f"{split}.parquet"))
    print(f"wrote {len(rows)} rows to {path}")
    return path


if __name__ == "__main__":
    main()
