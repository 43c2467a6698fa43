"""SFT rows: the loss mask covers exactly what the assistant says (tool calls included), and
truncation and packing keep samples whole and separable."""

from __future__ import annotations

import pytest

from rlhf_megatron.data.sft import (
    SFTDataError,
    SFTSample,
    pack_samples,
    single_turn_messages,
    tokenize_conversation,
    truncate,
)
from rlhf_megatron.data.tokenizer import build_tiny_tokenizer

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "37*48"}}}


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _trained_text(tok, sample: SFTSample) -> str:
    return tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])


def test_only_assistant_turns_and_their_end_of_turn_are_trained(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3="},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "4+4="},
        {"role": "assistant", "content": "8"},
    ]
    sample = tokenize_conversation(tok, messages, source="row 0")
    full = tok.apply_chat_template(messages, tokenize=True)
    assert list(sample.input_ids) == _ids(full), "the sample is the whole rendered transcript"
    eos = tok.eos_token
    assert _trained_text(tok, sample) == f"5{eos}8{eos}"  # no role headers, no user or system text


def test_tool_calls_are_trained_and_tool_responses_are_not(tok):
    messages = [
        {"role": "user", "content": "What is 37*48?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "1776"},
        {"role": "assistant", "content": "1776"},
    ]
    sample = tokenize_conversation(tok, messages, tools=TOOLS, source="row 7")
    trained = _trained_text(tok, sample)
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>' in trained
    assert "<tool_response>" not in trained and "tools: calculator" not in trained
    assert trained.endswith(f"1776{tok.eos_token}")
    assert list(sample.input_ids) == _ids(tok.apply_chat_template(messages, tools=TOOLS, tokenize=True))


def test_a_single_turn_row_is_a_user_assistant_chat(tok):
    sample = tokenize_conversation(tok, single_turn_messages("12+7=", "19", "row 2"), source="row 2")
    assert _trained_text(tok, sample) == f"19{tok.eos_token}"
    with pytest.raises(SFTDataError, match="row 3: the response must be a non-empty string"):
        single_turn_messages("12+7=", None, "row 3")


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "user", "content": "hi"}], "row 4: no assistant message"),
        (
            [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}],
            "message 0 has role 'narrator'",
        ),
    ],
)
def test_rows_without_anything_to_train_are_named(tok, messages, message):
    with pytest.raises(SFTDataError, match=message):
        tokenize_conversation(tok, messages, source="row 4")


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    class Rewriting:  # renders the last assistant turn in a different way than earlier ones
        chat_template = "x"

        def apply_chat_template(self, messages, add_generation_prompt=False, **_):
            body = [len(m["content"]) + (5 if i == len(messages) - 1 else 0) for i, m in enumerate(messages)]
            return body + ([99] if add_generation_prompt else [])

    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(SFTDataError, match="row 9: rendering message 1 changed the tokens"):
        tokenize_conversation(Rewriting(), messages, source="row 9")


def test_truncation_follows_verls_modes():
    sample = SFTSample(tuple(range(10)), (0, 0, 0, 0, 0, 1, 1, 1, 1, 1))
    with pytest.raises(SFTDataError, match="row 1: 10 tokens, more than data.max_length=6"):
        truncate(sample, 6, "error", "row 1")
    assert truncate(sample, 6, "left", "row 1").input_ids == (4, 5, 6, 7, 8, 9)
    assert truncate(sample, 8, "right", "row 1").loss_mask == (0, 0, 0, 0, 0, 1, 1, 1)
    with pytest.raises(SFTDataError, match="no assistant token is left"):
        truncate(sample, 4, "right", "row 1")
    assert truncate(sample, 10, "error", "row 1") is sample


def test_packing_keeps_samples_whole_in_segments_with_their_own_positions():
    samples = [SFTSample((1,) * n, (1,) * n) for n in (5, 3, 4, 2, 6)]
    rows = pack_samples(samples, 8)
    assert sorted(len(r.input_ids) for r in rows) == [4, 8, 8]  # first fit, longest first: 6+2, 5+3, 4
    assert sum(len(r.input_ids) for r in rows) == 20
    for row in rows:
        assert len(row.input_ids) <= 8
        for seg in set(row.segment_ids):
            positions = [p for p, s in zip(row.position_ids, row.segment_ids) if s == seg]
            assert positions == list(range(len(positions))), "positions restart in every segment"
    with pytest.raises(SFTDataError, match="sample 4: 6 tokens do not fit a packed row of 5"):
        pack_samples(samples, 5)


def test_stage_batches_pad_with_attended_untrained_filler_rows():
    from rlhf_megatron.config.schema_stages import SFTDataConfig
    from rlhf_megatron.stages.data import sft_batch

    samples = [SFTSample((5, 6, 7), (0, 1, 1)), SFTSample((8, 9), (0, 1))]
    batch = sft_batch(samples, SFTDataConfig(max_length=4, packing=True), dp=4)
    assert len(batch) == 4  # two packed rows (3 and 2 tokens do not share 4), two filler rows
    for row in range(len(batch)):
        assert batch["attention_mask"][row].sum() >= 1, "every row attends to at least one token"
    assert int(batch["loss_mask"].sum()) == 3, "filler rows train nothing"
