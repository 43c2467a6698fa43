"""Preference pairs: both TRL layouts render to prompt + response ids ending at the scored token, and
every row that cannot give a preference is refused with its row and column named."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_megatron.data.preference import PreferenceDataError, PreferencePair, tokenize_pair
from rlhf_megatron.data.tokenizer import build_tiny_tokenizer

ROW = {"prompt": "12+7=", "chosen": "19", "rejected": "18"}


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def plain_tok():
    t = build_tiny_tokenizer()
    t.chat_template = None
    return t


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)  # transformers 5 or 4


def _rl_sequence(tok, prompt: str, response: str) -> list[int]:
    """What a rollout looks like: the prompt as RLHFDataset renders it, the response, then eos."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tok.encode(text, add_special_tokens=False)
    return prompt_ids + tok.encode(response, add_special_tokens=False) + [tok.eos_token_id]


def test_string_columns_render_like_an_rl_rollout(tok):
    pair = tokenize_pair(tok, ROW, "row 0")
    assert isinstance(pair, PreferencePair)
    assert list(pair.chosen_ids) == _rl_sequence(tok, "12+7=", "19")
    assert list(pair.rejected_ids) == _rl_sequence(tok, "12+7=", "18")
    assert tok.decode(pair.chosen_ids) == "<|user|>12+7=</s><|assistant|>19</s>"
    assert pair.chosen_ids[-1] == tok.eos_token_id, "the score is read at the end-of-turn"


def test_without_a_chat_template_it_is_plain_text_then_eos(plain_tok):
    pair = tokenize_pair(plain_tok, ROW, "row 0")
    eos = plain_tok.eos_token_id
    assert list(pair.chosen_ids) == plain_tok.encode("12+7=19", add_special_tokens=False) + [eos]
    already = tokenize_pair(plain_tok, {**ROW, "chosen": "19</s>"}, "row 0")
    assert already.chosen_ids == pair.chosen_ids, "a response that ends with eos gets no second one"


def test_conversational_columns_with_and_without_a_prompt(tok):
    user = [{"role": "system", "content": "Add."}, {"role": "user", "content": "12+7="}]
    chosen = [{"role": "assistant", "content": "19"}]
    rejected = [{"role": "assistant", "content": "20"}]
    explicit = tokenize_pair(tok, {"prompt": user, "chosen": chosen, "rejected": rejected}, "row 1")
    assert list(explicit.chosen_ids) == _ids(tok.apply_chat_template(user + chosen, tokenize=True))
    implicit = tokenize_pair(tok, {"chosen": user + chosen, "rejected": user + rejected}, "row 1")
    assert implicit == explicit, "a prompt column is prepended; without one the responses carry it"
    assert (
        tokenize_pair(tok, {"prompt": None, "chosen": user + chosen, "rejected": user + rejected}, "r")
        == explicit
    )
    # parquet read through pandas gives numpy arrays of dicts
    as_numpy = {"prompt": np.array(user), "chosen": np.array(chosen), "rejected": np.array(rejected)}
    assert tokenize_pair(tok, as_numpy, "row 1") == explicit


def test_rows_read_back_from_parquet_with_custom_keys(tok, tmp_path):
    path = tmp_path / "prefs.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "1+1=", "good": "2", "bad": "3"}]), path)
    row = pq.read_table(path).to_pylist()[0]
    pair = tokenize_pair(tok, row, f"{path} row 0", prompt_key="q", chosen_key="good", rejected_key="bad")
    assert list(pair.rejected_ids) == _rl_sequence(tok, "1+1=", "3")


@pytest.mark.parametrize(
    "row, match",
    [
        (
            {"prompt": "a", "rejected": "b"},
            r"row 5: no column 'chosen' \(the chosen response\); the row has \['prompt', 'rejected'\]",
        ),
        (
            {"chosen": "a", "rejected": "b"},
            r"row 5: no column 'prompt' \(the prompt\); string responses need",
        ),
        ({**ROW, "prompt": ""}, r"row 5: column 'prompt' is an empty string; expected a non-empty string"),
        ({**ROW, "rejected": ""}, r"row 5: column 'rejected' is an empty string"),
        ({**ROW, "chosen": 19}, r"row 5: column 'chosen' is int 19; expected a non-empty string or a list"),
        ({**ROW, "rejected": None}, r"row 5: column 'rejected' is NoneType None"),
        ({**ROW, "chosen": []}, r"row 5: column 'chosen' is an empty list"),
        ({**ROW, "prompt": 3}, r"row 5: column 'prompt' is int 3; expected a non-empty string"),
        (
            {**ROW, "rejected": [{"role": "assistant", "content": "18"}]},
            r"row 5: column 'chosen' is a string but 'rejected' is list .*both must be strings or both lists",
        ),
        (
            {**ROW, "rejected": "19"},
            r"row 5: columns 'chosen' and 'rejected' give the same 11 tokens, so there is no preference",
        ),
        (
            {
                "prompt": "12+7=",
                "chosen": [{"role": "assistant", "content": "19"}],
                "rejected": [{"role": "assistant", "content": "1"}],
            },
            r"row 5: column 'prompt' is a string but the responses are lists of chat messages",
        ),
        (
            {
                "chosen": [{"role": "user", "content": "19"}],
                "rejected": [{"role": "assistant", "content": "1"}],
            },
            r"row 5: column 'chosen' ends with a 'user' message; the scored conversation must end with the assistant",
        ),
        (
            {"chosen": [{"content": "19"}], "rejected": [{"role": "assistant", "content": "1"}]},
            r"row 5: column 'chosen', message 0 has no 'role'",
        ),
        (
            {
                "chosen": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "1"}],
                "rejected": [{"role": "assistant", "content": "1"}],
            },
            r"row 5: the tokenizer's chat template cannot render column 'chosen': .*unknown role narrator",
        ),
    ],
)
def test_unusable_rows_name_the_row_and_column(tok, row, match):
    with pytest.raises(PreferenceDataError, match=match):
        tokenize_pair(tok, row, "row 5")


def test_messages_need_a_chat_template(plain_tok):
    row = {
        "chosen": [{"role": "assistant", "content": "1"}],
        "rejected": [{"role": "assistant", "content": "2"}],
    }
    with pytest.raises(
        PreferenceDataError,
        match="row 2: column 'chosen' is a list of chat messages but the tokenizer has no chat template",
    ):
        tokenize_pair(plain_tok, row, "row 2")


def test_truncation_error_left_and_refused_right(tok):
    full = tokenize_pair(tok, ROW, "row 3")  # 11 tokens each
    assert tokenize_pair(tok, ROW, "row 3", max_length=11) == full
    with pytest.raises(
        PreferenceDataError,
        match=r"row 3: column 'chosen' renders to 11 tokens, more than max_length=10; .*truncation=left",
    ):
        tokenize_pair(tok, ROW, "row 3", max_length=10)
    left = tokenize_pair(tok, ROW, "row 3", max_length=10, truncation="left")
    assert left.chosen_ids == full.chosen_ids[-10:] and left.rejected_ids == full.rejected_ids[-10:]
    assert left.chosen_ids[-1] == tok.eos_token_id, "left truncation keeps the scored last token"
    with pytest.raises(
        PreferenceDataError,
        match="row 3: truncation=right is refused for preference pairs: .*would cut the last one, where the reward model's score is read",
    ):
        tokenize_pair(tok, ROW, "row 3", max_length=100, truncation="right")
    with pytest.raises(
        PreferenceDataError, match=r"truncation='middle'; expected one of \['error', 'left'\]"
    ):
        tokenize_pair(tok, ROW, "row 3", truncation="middle")
    with pytest.raises(PreferenceDataError, match="max_length must be a positive integer"):
        tokenize_pair(tok, ROW, "row 3", max_length=0)


def test_left_truncation_that_erases_the_difference_is_refused(tok):
    row = {"prompt": "1+1=", "chosen": "2 and that is all", "rejected": "3 and that is all"}
    with pytest.raises(
        PreferenceDataError, match="same 8 tokens after left truncation to 8 tokens.*or raise max_length"
    ):
        tokenize_pair(tok, row, "row 4", max_length=8, truncation="left")
