"""Building verl-format rows and writing them to parquet atomically (used by `tools/data/`).

A verl row has ``data_source``, ``prompt`` (list of ``{role, content}``), ``ability``,
``reward_model`` (``{style: "rule", ground_truth}``) and ``extra_info`` (``{split, index, ...}``).
The instruction suffixes match verl's preprocessing, so a model trained with verl's data sees
the same prompts here.

Boundaries: row construction and file writing; the dataset reader is `rlhf_megatron.data.dataset`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "COUNTDOWN_PROMPT_WORDS",
    "GSM8K_INSTRUCTION",
    "MATH_INSTRUCTION",
    "arith_row",
    "countdown_prompt",
    "countdown_row",
    "extract_gsm8k_answer",
    "gsm8k_row",
    "infer_split",
    "math_row",
    "read_jsonl",
    "verl_row",
    "write_parquet_atomic",
]

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def verl_row(
    data_source: str, content: str, ability: str, ground_truth: Any, split: str, index: int, **extra: Any
) -> dict:
    """One row in verl's layout with a single user message."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, **extra},
    }


def extract_gsm8k_answer(answer: str) -> str | None:
    """The number after the last ``####`` of a GSM8K reference solution, commas removed."""
    match = re.findall(r"####\s*(-?[0-9.,]+)", answer)
    return match[-1].replace(",", "").rstrip(".") if match else None


def gsm8k_row(question: str, answer: str, split: str, index: int) -> dict:
    ground_truth = extract_gsm8k_answer(answer)
    if ground_truth is None:
        raise ValueError(
            f"gsm8k row {index}: the answer has no '#### <number>' final answer: {answer[-200:]!r}."
        )
    return verl_row(
        "openai/gsm8k",
        f"{question} {GSM8K_INSTRUCTION}",
        "math",
        ground_truth,
        split,
        index,
        answer=answer,
        question=question,
    )


def math_row(problem: str, ground_truth: str, split: str, index: int, data_source: str, **extra: Any) -> dict:
    return verl_row(data_source, f"{problem} {MATH_INSTRUCTION}", "math", ground_truth, split, index, **extra)


COUNTDOWN_PROMPT_WORDS = (
    *("Using ", "numbers ", "write ", "equation ", "equals ", "You ", "may ", "use ", "and "),
    *("parentheses", "must ", "every ", "number ", "exactly ", "once", "Reason ", "inside ", "tags"),
    *("then ", "give ", "only ", "the ", "for ", "example ", "<think>", "</think>", "an "),
)
"""The whole words of ``countdown_prompt``: a tiny test tokenizer that makes each a single token
(``models.tiny.make_tiny_hf_model(extra_words=...)``) fits the prompt into the TinyZero command's
``data.max_prompt_length=256``, which a character-level one would not."""


def countdown_prompt(numbers: Sequence[int], target: int) -> str:
    return (
        f"Using the numbers {list(numbers)}, write an equation that equals {target}. You may use +, -, *, / "
        "and parentheses, and must use every number exactly once. Reason inside <think> </think> tags, "
        "then give only the equation inside <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
    )


def countdown_row(numbers: Sequence[int], target: int, solution: str, split: str, index: int) -> dict:
    return verl_row(
        "countdown",
        countdown_prompt(numbers, target),
        "math",
        {"target": int(target), "numbers": [int(n) for n in numbers]},
        split,
        index,
        solution=solution,
    )


def arith_row(question: str, answer: str, split: str, index: int) -> dict:
    return verl_row("arith", question, "arithmetic", answer, split, index)


def infer_split(input_path: str, split: str | None = None) -> str:
    """``split`` if given, else 'train'/'test'/'val' when the file name contains it."""
    if split:
        return split
    name = os.path.basename(input_path).lower()
    for candidate in ("train", "test", "val"):
        if candidate in name:
            return candidate
    raise ValueError(
        f"cannot tell the split of {input_path} from its file name; pass --split (e.g. train or test)."
    )


def read_jsonl(path: str, required: Sequence[str]) -> Iterator[tuple[int, dict]]:
    """(line number, row) for each row of a JSON-lines file; a bad line or a missing field is an
    error naming the file and line."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({err}).") from err
            missing = [k for k in required if k not in row]
            if missing:
                raise ValueError(f"{path}:{line_no}: missing field(s) {missing}; the line has {sorted(row)}.")
            yield line_no, row


def write_parquet_atomic(rows: Sequence[dict], path: str) -> str:
    """Write rows to ``path`` via a temporary file and a rename, so readers never see half a file."""
    if not rows:
        raise ValueError(f"write_parquet_atomic: no rows to write to {path}.")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    table = pa.Table.from_pylist(list(rows))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)  # atomic on POSIX within one filesystem
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
