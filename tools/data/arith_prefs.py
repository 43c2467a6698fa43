"""Generate preference pairs for the tiny ``arith`` task, to train its reward model.

    python tools/data/arith_prefs.py --output-dir data/arith_prefs --train-size 2000 --test-size 100 --seed 0

Each row has TRL's standard preference columns: ``prompt`` (the RL prompt ``"a+b="``),
``chosen`` (the sum, which the arith reward scores 1) and ``rejected``, a plausible wrong answer
the reward scores 0: most often the sum off by 1 to --max-offset (never negative), otherwise a
malformed one, the sum with a digit run on after it (the failure the arith reward punishes) or
the whole equation echoed back. ``extra_info`` keeps the split, index, ground truth and which
kind of wrong answer was drawn.

Problems come from ``make_arith_split`` as in ``tools/data/arith.py``: with the same --seed,
--test-size and --max-operand, the test split is the RL task's and train never contains an RL
test problem. Files are written atomically.
"""

from __future__ import annotations

import random

from rlhf_megatron.data.synthetic import arith_split_parser, write_arith_splits

REJECTED_KINDS = ("off_by", "run_on", "echo")


def wrong_answer(
    question: str, answer: str, rng: random.Random, malformed: float, max_offset: int
) -> tuple[str, str]:
    """(kind, text) of a wrong answer to ``question`` whose sum is ``answer``."""
    total = int(answer)
    if rng.random() >= malformed:
        offsets = [d for d in range(-max_offset, max_offset + 1) if d and total + d >= 0]
        return "off_by", str(total + rng.choice(offsets))
    if rng.random() < 0.5:  # "0" + "0" would still read as 0, so a zero sum runs on with 1..9
        return "run_on", answer + str(rng.randrange(1 if total == 0 else 0, 10))
    return "echo", question + answer


def pref_row(
    question: str, answer: str, split: str, index: int, rng: random.Random, malformed: float, max_offset: int
) -> dict:
    kind, rejected = wrong_answer(question, answer, rng, malformed, max_offset)
    return {
        "prompt": question,
        "chosen": answer,
        "rejected": rejected,
        "extra_info": {"split": split, "index": index, "ground_truth": answer, "rejected_kind": kind},
    }


def main(argv: list[str] | None = None) -> list[str]:
    parser = arith_split_parser(__doc__.splitlines()[0])
    parser.add_argument("--max-offset", type=int, default=3, help="an off-by answer is 1..max-offset away")
    parser.add_argument(
        "--malformed-fraction", type=float, default=0.3, help="share of rejected answers that are malformed"
    )
    args = parser.parse_args(argv)
    if args.max_offset < 1 or not 0.0 <= args.malformed_fraction <= 1.0:
        parser.error(
            f"--max-offset must be at least 1 (got {args.max_offset}) and --malformed-fraction in [0, 1] "
            f"(got {args.malformed_fraction})"
        )
    # A generator of its own, so the problems stay exactly arith.py's for the same seed.
    rng = random.Random(f"arith_prefs:{args.seed}")

    def row(p: dict, split: str, i: int) -> dict:
        return pref_row(p["question"], p["answer"], split, i, rng, args.malformed_fraction, args.max_offset)

    return write_arith_splits(args, row)


if __name__ == "__main__":
    main()
