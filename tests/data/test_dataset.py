"""RLHFDataset on text: tokenization and padding, verl's parquet layout, truncation, filtering, errors,
and the typed ``data`` config it reads."""

import json
import logging

import numpy as np
import pyarrow as pa
import pytest
import torch
from omegaconf import OmegaConf

from rlhf_megatron.config.schema import DataConfig, RunConfig
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.data.dataset import DatasetFormatError, RLHFDataset, collate_fn, truncate_ids
from rlhf_megatron.data.preprocess import gsm8k_row
from rlhf_megatron.data.tokenizer import build_tiny_tokenizer


def config(**overrides):
    return DataConfig(**{"max_prompt_length": 16, **overrides})


def test_item_is_left_padded_chat_prompt(tokenizer, write_parquet, arith_rows):
    ds = RLHFDataset(write_parquet(arith_rows), tokenizer, config())
    assert len(ds) == 5
    item = ds[3]
    expected_ids = tokenizer.encode("<|user|>3+3=</s><|assistant|>", add_special_tokens=False)
    assert item["raw_prompt_ids"] == expected_ids and len(expected_ids) == 7
    pad = 16 - 7
    assert item["input_ids"].shape == (16,) and item["input_ids"].dtype == torch.long
    assert item["input_ids"][:pad].tolist() == [tokenizer.pad_token_id] * pad
    assert item["input_ids"][pad:].tolist() == expected_ids
    assert item["attention_mask"].tolist() == [0] * pad + [1] * 7
    assert item["position_ids"].tolist() == [0] * pad + list(range(7))
    assert item["data_source"] == "arith" and item["ability"] == "arithmetic"
    assert item["reward_model"] == {"style": "rule", "ground_truth": "6"}
    assert item["index"] == 103 and item["extra_info"]["split"] == "train"
    assert "raw_prompt" not in item and "prompt" not in item


def test_several_files_and_raw_chat(tokenizer, write_parquet, arith_rows):
    no_extra = [{k: v for k, v in row.items() if k != "extra_info"} for row in arith_rows[:2]]
    files = [write_parquet(arith_rows[:3], "a.parquet"), write_parquet(no_extra, "b.parquet")]
    ds = RLHFDataset(files, tokenizer, config(return_raw_chat=True, return_raw_input_ids=True))
    assert len(ds) == 5
    assert [ds[i]["index"] for i in range(5)] == [100, 101, 102, 3, 4]  # row number without extra_info
    assert ds[4]["raw_prompt"] == [{"role": "user", "content": "1+1="}]
    assert ds[4]["raw_input_ids"] == ds[4]["raw_prompt_ids"]
    assert ds[4]["extra_info"] == {}


def test_config_is_the_typed_data_section(tokenizer, write_parquet, arith_rows):
    """The trainer passes ``OmegaConf.to_object(cfg).data``; the data DictConfig and a dict of data.*
    keys are converted to the same DataConfig, and a key DataConfig lacks is refused."""
    path = write_parquet(arith_rows)
    cfg = OmegaConf.structured(RunConfig)
    cfg.data.max_prompt_length = 9
    typed = OmegaConf.to_object(cfg).data
    assert isinstance(typed, DataConfig)
    for given in (typed, cfg.data, {"max_prompt_length": 9}):
        ds = RLHFDataset(path, tokenizer, given)
        assert isinstance(ds.config, DataConfig) and ds.config.max_prompt_length == 9
        assert ds[0]["input_ids"].shape == (9,)
    with pytest.raises(TypeError, match=r"\['max_prompt_len'\] are not data.\* keys"):
        RLHFDataset(path, tokenizer, {"max_prompt_len": 9})


def _verl_gsm8k_table() -> pa.Table:
    """A table as verl's examples/data_preprocess/gsm8k.py writes it (through HF datasets), with the
    nested columns given as numpy object arrays, the way pandas/pyarrow hand them back."""
    rows = [
        gsm8k_row(
            "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?",
            "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72",
            "train",
            0,
        ),
        gsm8k_row("What is 1,000 + 234?", "1,000 + 234 = 1,234\n#### 1,234", "train", 1),
    ]
    table = pa.Table.from_pylist(rows)
    numpy_columns = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
    assert isinstance(numpy_columns["prompt"][0], np.ndarray)  # what pandas-based readers see
    rebuilt = pa.table({name: pa.array(values) for name, values in numpy_columns.items()})
    features = {"data_source": {"dtype": "string", "_type": "Value"}}  # abridged HF datasets metadata
    return rebuilt.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})


def test_verl_gsm8k_parquet_loads_unchanged(tokenizer, write_parquet):
    table = _verl_gsm8k_table()
    assert str(table.schema.field("prompt").type) == "list<item: struct<role: string, content: string>>"
    tok = build_tiny_tokenizer()
    ds = RLHFDataset(write_parquet(table, "train.parquet"), tok, config(max_prompt_length=512))
    item = ds[1]
    assert item["data_source"] == "openai/gsm8k" and item["ability"] == "math"
    assert item["reward_model"] == {"style": "rule", "ground_truth": "1234"}
    assert item["extra_info"]["question"] == "What is 1,000 + 234?" and item["index"] == 1
    text = tok.decode(item["raw_prompt_ids"])
    assert text.startswith("<|user|>What is 1,000 + 234? Let's think step by step")
    assert text.endswith('after "####".</s><|assistant|>')
    batch = collate_fn([ds[0], ds[1]])
    assert batch["input_ids"].shape == (2, 512)
    assert batch["reward_model"][0]["ground_truth"] == "72"


def test_content_before_role_struct_order(tokenizer, write_parquet):
    row = {
        "data_source": "arith",
        "prompt": [{"content": "1+2=", "role": "user"}],
        "reward_model": {"ground_truth": "3"},
    }
    ds = RLHFDataset(write_parquet([row]), tokenizer, config())
    assert tokenizer.decode(ds[0]["raw_prompt_ids"]) == "<|user|>1+2=</s><|assistant|>"


def test_truncation_error_names_file_row_and_length(tokenizer, write_parquet, arith_rows):
    path = write_parquet(arith_rows)
    ds = RLHFDataset(path, tokenizer, config(max_prompt_length=5))
    with pytest.raises(ValueError, match=rf"{path} row 2: prompt is 7 tokens.*max_prompt_length=5"):
        ds[2]


def test_truncation_modes(tokenizer, write_parquet, arith_rows):
    path = write_parquet(arith_rows[:1])
    full = tokenizer.encode("<|user|>0+0=</s><|assistant|>", add_special_tokens=False)
    for mode, expected in [("left", full[-4:]), ("right", full[:4]), ("middle", full[:2] + full[-2:])]:
        ds = RLHFDataset(path, tokenizer, config(max_prompt_length=4, truncation=mode))
        assert ds[0]["raw_prompt_ids"] == expected
        assert ds[0]["input_ids"].tolist() == expected
    assert truncate_ids([1, 2, 3, 4, 5], 3, "middle") == [1, 4, 5]


def test_filter_overlong_prompts_drops_and_logs(tokenizer, write_parquet, arith_rows, caplog):
    rows = arith_rows + [gsm8k_row("a long question " * 3, "#### 1", "train", 7)]
    with caplog.at_level(logging.INFO, logger="rlhf_megatron.data.dataset"):
        ds = RLHFDataset(write_parquet(rows), tokenizer, config(filter_overlong_prompts=True))
    assert len(ds) == 5 and [ds[i]["index"] for i in range(5)] == [100, 101, 102, 103, 104]
    assert ds.prompt_lengths.dtype == np.int32 and ds.prompt_lengths.tolist() == [7] * 5
    assert "filtered out 1 of 6 prompts" in caplog.text


def test_missing_column_names_file_and_key(tokenizer, write_parquet, arith_rows):
    rows = [{k: v for k, v in row.items() if k != "reward_model"} for row in arith_rows]
    path = write_parquet(rows)
    with pytest.raises(DatasetFormatError, match=rf"{path}: missing column 'reward_model'"):
        RLHFDataset(path, tokenizer, config())
    with pytest.raises(DatasetFormatError, match="missing column 'question'"):
        RLHFDataset(write_parquet(arith_rows, "b.parquet"), tokenizer, config(prompt_key="question"))


def test_prompt_column_of_wrong_type(tokenizer, write_parquet):
    path = write_parquet([{"data_source": "arith", "prompt": "1+1=", "reward_model": {"ground_truth": "2"}}])
    with pytest.raises(DatasetFormatError, match=rf"{path}: column 'prompt' has Arrow type string"):
        RLHFDataset(path, tokenizer, config())


@pytest.mark.parametrize(
    "row_update, key",
    [
        ({"prompt": [{"role": "user"}]}, r"'prompt'\[0\] must be a dict with string 'role' and 'content'"),
        ({"prompt": []}, "'prompt' must be a non-empty list"),
        ({"prompt": None}, "'prompt' must be a non-empty list"),
        ({"reward_model": {"style": "rule"}}, "'reward_model' must be a dict with a non-null 'ground_truth'"),
        ({"reward_model": None}, "'reward_model' must be a dict with a non-null 'ground_truth'"),
    ],
)
def test_malformed_row_names_file_row_and_key(tokenizer, write_parquet, arith_rows, row_update, key):
    rows = [dict(r) for r in arith_rows]
    rows[3].update(row_update)
    path = write_parquet(rows)
    ds = RLHFDataset(path, tokenizer, config())
    ds[2]  # other rows are fine
    with pytest.raises(DatasetFormatError, match=rf"{path} row 3: {key}"):
        ds[3]


def test_malformed_row_is_found_when_filtering(tokenizer, write_parquet, arith_rows):
    rows = [dict(r) for r in arith_rows]
    rows[4]["prompt"] = [{"role": "user", "content": None}]
    path = write_parquet(rows)
    with pytest.raises(DatasetFormatError, match=rf"{path} row 4: 'prompt'\[0\]"):
        RLHFDataset(path, tokenizer, config(filter_overlong_prompts=True))


def test_tokenizer_without_chat_template(write_parquet, arith_rows):
    tok = build_tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"no chat template.*Set tokenizer.chat_template"):
        RLHFDataset(write_parquet(arith_rows), tok, config())


def test_empty_and_missing_files(tokenizer, write_parquet, arith_rows, tmp_path):
    empty = write_parquet(pa.Table.from_pylist(arith_rows).slice(0, 0), "empty.parquet")
    with pytest.raises(ValueError, match=rf"parquet file {empty} has no rows"):
        RLHFDataset(empty, tokenizer, config())
    with pytest.raises(FileNotFoundError, match="nope.parquet does not exist"):
        RLHFDataset(str(tmp_path / "nope.parquet"), tokenizer, config())


def test_bad_config_values(tokenizer, write_parquet, arith_rows):
    with pytest.raises(ValueError, match="data.truncation must be one of"):
        RLHFDataset(write_parquet(arith_rows), tokenizer, config(truncation="sideways"))


def test_collate_fn_builds_batch(tokenizer, write_parquet, arith_rows):
    ds = RLHFDataset(write_parquet(arith_rows), tokenizer, config())
    batch = collate_fn([ds[i] for i in range(4)])
    assert isinstance(batch, Batch) and len(batch) == 4
    assert set(batch.tensor_keys) == {"input_ids", "attention_mask", "position_ids"}
    assert batch["raw_prompt_ids"][0] == ds[0]["raw_prompt_ids"]
    assert batch["index"].tolist() == [100, 101, 102, 103]
    assert batch["data_source"].tolist() == ["arith"] * 4


def test_easyr1_text_layout(tokenizer, write_parquet, tmp_path):
    """Plain-text prompts (EasyR1's layout): format_prompt renders the text, system_prompt comes first,
    the answer becomes the ground truth and the file's name the data source."""
    template = tmp_path / "fmt.jinja"
    template.write_text("\n{{ content }} Answer:\n")  # EasyR1 strips the file's text
    rows = [{"problem": "1+1=", "answer": "2", "level": 3}, {"problem": "2+5=", "answer": "7", "level": 1}]
    cfg = config(
        prompt_key="problem", format_prompt=str(template), system_prompt="Be brief.", max_prompt_length=48
    )
    item = RLHFDataset(write_parquet(rows, "arith_easy.parquet"), tokenizer, cfg)[1]
    assert (
        tokenizer.decode(item["raw_prompt_ids"])
        == "<|system|>Be brief.</s><|user|>2+5= Answer:</s><|assistant|>"
    )
    assert item["reward_model"] == {"ground_truth": "7"} and item["data_source"] == "arith_easy"
    assert item["level"] == 1 and not {"problem", "answer"} & set(item)
    assert item["position_ids"].shape == (48,)  # a text model keeps 1-D positions

    path = write_parquet([{"problem": "1+1=", "solution": "2"}], "no_answer.parquet")
    with pytest.raises(
        DatasetFormatError, match=r"no_answer.parquet: column 'problem' holds plain text.*'answer'"
    ):
        RLHFDataset(path, tokenizer, config(prompt_key="problem"))


def test_system_prompt_and_format_prompt_on_verl_rows(tokenizer, write_parquet, arith_rows, tmp_path):
    own = dict(
        arith_rows[1], prompt=[{"role": "system", "content": "Mine."}, {"role": "user", "content": "1+1="}]
    )
    ds = RLHFDataset(
        write_parquet([arith_rows[0], own]),
        tokenizer,
        config(system_prompt="Be brief.", max_prompt_length=32),
    )
    assert tokenizer.decode(ds[0]["raw_prompt_ids"]) == "<|system|>Be brief.</s><|user|>0+0=</s><|assistant|>"
    assert tokenizer.decode(ds[1]["raw_prompt_ids"]) == "<|system|>Mine.</s><|user|>1+1=</s><|assistant|>"
    template = tmp_path / "fmt.jinja"
    template.write_text("{{ content }}")
    with pytest.raises(
        ValueError, match=r"data.format_prompt=.*fmt.jinja renders plain-text prompts.*chat messages"
    ):
        RLHFDataset(write_parquet(arith_rows, "b.parquet"), tokenizer, config(format_prompt=str(template)))
