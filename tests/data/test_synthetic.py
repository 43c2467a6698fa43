"""Synthetic tasks: seeded, disjoint splits; arith prompts are short; countdown tasks are solvable."""

import pytest

from rlhf_megatron.data.synthetic import make_arith_rows, make_arith_split, make_countdown_split
from rlhf_megatron.rewards.countdown import compute_score


def test_arith_split_is_seeded_and_disjoint(tokenizer):
    train, test = make_arith_split(2000, 50, seed=1)
    assert (train, test) == make_arith_split(2000, 50, seed=1)
    assert len(train) == 2000 and len(test) == len({r["question"] for r in test}) == 50
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    for row in train[:50]:
        a, b = row["question"][:-1].split("+")
        assert row["answer"] == str(int(a) + int(b)) and row["text"] == row["question"] + row["answer"]
        chat = [{"role": "user", "content": row["question"]}]
        prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert len(tokenizer.encode(prompt, add_special_tokens=False)) <= 16


def test_arith_rows_distinct_until_exhausted():
    rows = make_arith_rows(961, seed=0)  # all (a, b) with 0 <= a, b <= 30
    assert len({r["question"] for r in rows}) == 961
    assert make_arith_rows(5, seed=0) != make_arith_rows(5, seed=1)
    with pytest.raises(ValueError, match="leaves no training problems"):
        make_arith_split(10, 4, seed=0, max_operand=1)


def test_countdown_split_solvable_and_disjoint():
    train, test = make_countdown_split(200, 20, seed=3)
    assert (train, test) == make_countdown_split(200, 20, seed=3)
    keys = lambda rows: {(tuple(sorted(r["numbers"])), r["target"]) for r in rows}  # noqa: E731
    assert len(keys(train)) == 200 and not keys(train) & keys(test)
    for row in train + test:
        assert 3 <= len(row["numbers"]) <= 4 and all(1 <= n <= 99 for n in row["numbers"])
        assert 1 <= row["target"] <= 100
        ground_truth = {"target": row["target"], "numbers": row["numbers"]}
        assert compute_score(f"<answer>{row['solution']}</answer>", ground_truth) == 1.0
