"""Convert a local MATH JSON-lines file (fields ``problem``, ``solution``) to verl-format parquet.

    python tools/data/math_dataset.py --input math/test.jsonl --output-dir data/math

writes ``data/math/test.parquet``. Each prompt is the problem followed by verl's instruction to
put the final answer in ``\\boxed{}``; the ground truth is the content of the reference
solution's last ``\\boxed{}``. ``level`` and ``type``, when present, go to ``extra_info``.
The file is written atomically.
"""

from __future__ import annotations

import argparse
import os

from rlhf_megatron.data.preprocess import infer_split, math_row, read_jsonl, write_parquet_atomic
from rlhf_megatron.rewards.boxed_math import last_boxed_answer


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="MATH JSON-lines file (problem, solution)")
    parser.add_argument("--output-dir", required=True, help="directory for <split>.parquet")
    parser.add_argument("--split", default=None, help="split name (default: from the input file name)")
    parser.add_argument(
        "--data-source",
        default="DigitalLearningGmbH/MATH-lighteval",
        help="data_source written to each row (selects the scorer; lighteval/MATH also works)",
    )
    args = parser.parse_args(argv)

    split = infer_split(args.input, args.split)
    rows = []
    for line_no, record in read_jsonl(args.input, ["problem", "solution"]):
        answer = last_boxed_answer(record["solution"])
        if answer is None:
            raise ValueError(f"{args.input}:{line_no}: the solution has no \\boxed{{...}} answer.")
        extra = {k: record[k] for k in ("level", "type") if k in record}
        rows.append(math_row(record["problem"], answer, split, len(rows), args.data_source, **extra))
    path = write_parquet_atomic(rows, os.path.join(args.output_dir, f"{split}.parquet"))
    print(f"wrote {len(rows)} rows to {path}")
    return path


if __name__ == "__main__":
    main()
