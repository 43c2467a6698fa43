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

from rlhf_megatron.data.synthetic import arith_split_parser, write_arith_splits


def sft_row(question: str, answer: str, split: str, index: int) -> dict:
    return {
        "data_source": "arith",
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        "question": question,
        "answer": answer,
        "extra_info": {"split": split, "index": index},
    }


def main(argv: list[str] | None = None) -> list[str]:
    args = arith_split_parser(__doc__.splitlines()[0]).parse_args(argv)
    return write_arith_splits(args, lambda p, split, i: sft_row(p["question"], p["answer"], split, i))


if __name__ == "__main__":
    main()
