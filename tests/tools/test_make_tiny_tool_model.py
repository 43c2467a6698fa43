"""The tool quickstart's pieces: the tool_mult task, its scorer, and the pre-training transcripts
(rendered as the multi-turn rollout renders them, loss only on what the policy writes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlhf_megatron.agent.calls import parse_hermes
from rlhf_megatron.agent.loop import render_turn_ids
from rlhf_megatron.models.tiny import build_tiny_hf_model
from rlhf_megatron.rewards.tool_mult import compute_score

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


tool_mult = _load("tool_mult_data", TOOLS / "data" / "tool_mult.py")
builder = _load("make_tiny_tool_model", TOOLS / "make_tiny_tool_model.py")


def test_split_is_disjoint_and_rows_are_verl_multi_turn_rows(tmp_path):
    train, test = tool_mult.split(500, 50, seed=3)
    assert len(train) == 500 and len(test) == 50 and not set(train) & set(test)
    assert all(10 <= a <= 99 and 10 <= b <= 99 for a, b in train + test)
    tool_mult.main(["--output-dir", str(tmp_path), "--train-size", "20", "--test-size", "5"])
    rows = pq.read_table(tmp_path / "test.parquet").to_pylist()
    row = rows[0]
    a, b = map(int, row["extra_info"]["question"].split("*"))
    assert row["data_source"] == "tool_mult" and row["agent_name"] == "tool_agent"
    assert row["prompt"] == [{"role": "user", "content": f"What is {a}*{b}?"}]
    assert row["reward_model"]["ground_truth"] == str(a * b)
    assert row["extra_info"]["tools_kwargs"]["calculator"]["create_kwargs"]["ground_truth"] == str(a * b)


@pytest.mark.parametrize(
    ("response", "score"),
    [
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>'
            "<tool_response>1776</tool_response>1776",
            1.0,
        ),
        ("1776", 1.0),
        ("1775", 0.0),
        # the operands written into an unanswered call are not an answer
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1776*1"}}</tool_call>', 0.0),
        ("<tool_response>1776</tool_response>", 0.0),
    ],
)
def test_only_the_final_answer_scores(response, score):
    assert compute_score(response, "1776") == score


def test_transcripts_train_on_the_call_and_answer_only():
    _, tok = build_tiny_hf_model(extra_words=builder.TOOL_WORDS)
    transcripts = builder.Transcripts(tok)
    prompt = transcripts.prompt(37, 48)
    ids, labels = transcripts.example(37, 48, with_tool=True)
    assert ids[: len(prompt)] == prompt and all(label == -100 for label in labels[: len(prompt)])
    trained = [i for i, label in zip(ids, labels) if label != -100]
    call = transcripts.call(37, 48)
    assert trained == call + transcripts.answer("1776")
    _, calls, errors = parse_hermes(tok.decode(call, skip_special_tokens=True))
    assert not errors and calls[0].name == "calculator" and "37*48" in calls[0].arguments
    # The masked middle is exactly the tool turn the agent loop appends.
    middle = ids[len(prompt) + len(call) : len(ids) - len(transcripts.answer("1776"))]
    assert middle == render_turn_ids(tok, [{"role": "tool", "content": "1776"}])
    assert len(ids) - len(prompt) <= 32, "the whole trajectory fits the quickstart's response budget"
    direct_ids, direct_labels = transcripts.example(37, 48, with_tool=False)
    assert [i for i, label in zip(direct_ids, direct_labels) if label != -100] == transcripts.answer("1776")


def test_follow_up_questions_are_masked_and_answered_the_same_way():
    _, tok = build_tiny_hf_model(extra_words=builder.TOOL_WORDS)
    transcripts = builder.Transcripts(tok)
    ids, labels = transcripts.example(37, 48, with_tool=True, follow_ups=[(12, 34)])
    trained = [i for i, label in zip(ids, labels) if label != -100]
    expected = (
        transcripts.call(37, 48)
        + transcripts.answer("1776")
        + transcripts.call(12, 34)
        + transcripts.answer("408")
    )
    assert trained == expected
    question = transcripts.question_turn(12, 34)
    start = (
        len(ids)
        - len(transcripts.answer("408"))
        - len(transcripts.tool_turn("408"))
        - len(transcripts.call(12, 34))
    )
    assert ids[start - len(question) : start] == question


def _stage_samples(tok, path):
    """The rows of ``path`` as the SFT trainer tokenizes them, with the builder's data keys."""
    from omegaconf import OmegaConf

    from rlhf_megatron.config.loader import load_stage_config
    from rlhf_megatron.config.schema_stages import SFTConfig
    from rlhf_megatron.stages.data import sft_samples

    overrides = ["data.multiturn.enable=true", "data.multiturn.tools_key=tools"]
    data = OmegaConf.to_object(load_stage_config(SFTConfig, None, overrides)).data
    return sft_samples(data, tok, str(path), "data.train_files")


@pytest.mark.parametrize("with_tool", [True, False])
def test_the_sft_trainer_reads_the_rows_as_the_rollout_renders_them(tmp_path, with_tool):
    """The builder pre-trains through the SFT trainer: a row it writes (messages + the tool's
    schema) tokenizes to the ids and loss mask of ``Transcripts.example``, and so does a
    transcript with a follow-up question (``--max-rounds`` > 1)."""
    import json

    import pyarrow as pa

    _, tok = build_tiny_hf_model(extra_words=builder.TOOL_WORDS)
    transcripts = builder.Transcripts(tok)
    args = builder.parse_args(["--tool-share", "1.0" if with_tool else "0.0"])
    path = builder.write_sft_rows(transcripts, [(37, 48)], args, tmp_path / "train.parquet")
    (written,) = _stage_samples(tok, path)
    ids, labels = transcripts.example(37, 48, with_tool=with_tool)
    assert list(written.input_ids) == ids
    assert list(written.loss_mask) == [int(label != -100) for label in labels]

    messages = builder.transcript_messages(37, 48, with_tool, [(12, 13)])
    row = {"messages": json.dumps(messages), "tools": json.dumps(transcripts.tools)}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "two.parquet")
    (two,) = _stage_samples(tok, tmp_path / "two.parquet")
    ids, labels = transcripts.example(37, 48, with_tool=with_tool, follow_ups=[(12, 13)])
    assert list(two.input_ids) == ids
    assert list(two.loss_mask) == [int(label != -100) for label in labels]
