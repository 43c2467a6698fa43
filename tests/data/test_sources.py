"""Data sources: parquet, JSON, JSONL, save_to_disk directories and dataset repositories on disk, with
EasyR1's ``path@split``; a path that is not on disk fails naming the key (no hub is contacted)."""

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from vl_helpers import png

from rlhf_megatron.config.schema import DataConfig
from rlhf_megatron.data.dataset import RLHFDataset
from rlhf_megatron.data.sources import load_source

CFG = DataConfig(prompt_key="problem", max_prompt_length=64)


def rows(split, n=3):
    return [{"problem": f"{split} {i}+{i}=", "answer": str(2 * i)} for i in range(n)]


def problems(ds):
    user = "<|user|>"
    return [
        ds.tokenizer.decode(ds[i]["raw_prompt_ids"]).split(user)[1].split("</s>")[0] for i in range(len(ds))
    ]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "json_lines", "json_list"])
def test_single_files(tokenizer, tmp_path, kind):
    records = rows("train")
    path = (
        tmp_path
        / {"parquet": "d.parquet", "jsonl": "d.jsonl", "json_lines": "d.json", "json_list": "d.json"}[kind]
    )
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    elif kind == "json_list":
        path.write_text(json.dumps(records, indent=1))
    else:
        write_jsonl(path, records)
    spec = str(path) + ("@train" if kind == "jsonl" else "")  # a file's only split may be named
    ds = RLHFDataset(spec, tokenizer, CFG)
    assert problems(ds) == ["train 0+0=", "train 1+1=", "train 2+2="]
    assert ds[2]["reward_model"] == {"ground_truth": "4"} and ds[2]["data_source"] == "d"


def test_dataset_repository_on_disk_with_splits(tokenizer, tmp_path):
    """A dataset repository as the Hub lays it out (hiyouga/geometry3k: data/<split>-0000x-of-0000n.parquet)."""
    repo = tmp_path / "hiyouga" / "geometry3k"
    (repo / "data").mkdir(parents=True)
    (repo / ".git").mkdir()
    (repo / "README.md").write_text("# geometry3k")
    (repo / "dataset_infos.json").write_text("{}")
    pq.write_table(pa.Table.from_pylist(rows("train")[:2]), repo / "data" / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows("train")[2:]), repo / "data" / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows("test", 2)), repo / "data" / "test-00000-of-00001.parquet")
    write_jsonl(repo / "data" / "validation.jsonl", rows("validation", 1))

    assert problems(RLHFDataset(str(repo), tokenizer, CFG)) == ["train 0+0=", "train 1+1=", "train 2+2="]
    test = RLHFDataset(f"{repo}@test", tokenizer, CFG)
    assert problems(test) == ["test 0+0=", "test 1+1="] and test[0]["data_source"] == "geometry3k"
    assert problems(RLHFDataset(f"{repo}@validation", tokenizer, CFG)) == ["validation 0+0="]
    with pytest.raises(
        ValueError,
        match=r"no data files for split 'dev'; its files belong to splits \['test', 'train', 'validation'\]",
    ):
        RLHFDataset(f"{repo}@dev", tokenizer, CFG)


def test_save_to_disk_dataset_and_dataset_dict(tokenizer, tmp_path):
    train, test = datasets.Dataset.from_list(rows("train")), datasets.Dataset.from_list(rows("test", 2))
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    train.select([2, 0]).save_to_disk(str(tmp_path / "single"))  # an indices view is saved flattened

    assert problems(RLHFDataset(str(tmp_path / "dd"), tokenizer, CFG)) == [
        "train 0+0=",
        "train 1+1=",
        "train 2+2=",
    ]
    assert problems(RLHFDataset(f"{tmp_path / 'dd'}@test", tokenizer, CFG)) == ["test 0+0=", "test 1+1="]
    assert problems(RLHFDataset(str(tmp_path / "single"), tokenizer, CFG)) == ["train 2+2=", "train 0+0="]
    with pytest.raises(ValueError, match=r"has no split 'validation'; it has \['test', 'train'\]"):
        RLHFDataset(f"{tmp_path / 'dd'}@validation", tokenizer, CFG)


def test_save_to_disk_with_hf_image_feature(vision, tmp_path):
    """Images stored by datasets' Image feature ({bytes, path} structs) reach the processor."""
    features = datasets.Features(
        {
            "images": datasets.Sequence(datasets.Image()),
            "problem": datasets.Value("string"),
            "answer": datasets.Value("string"),
        }
    )
    data = {"images": [[{"bytes": png(56, 56), "path": None}]], "problem": ["<image>x?"], "answer": ["1"]}
    datasets.Dataset.from_dict(data, features=features).save_to_disk(str(tmp_path / "geo"))
    cfg = DataConfig(
        prompt_key="problem", max_prompt_length=64, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16
    )
    item = RLHFDataset(str(tmp_path / "geo"), vision.processor.tokenizer, cfg, vision)[0]
    assert item["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert item["data_source"] == "geo" and item["reward_model"] == {"ground_truth": "1"}


def test_missing_path_names_the_key_and_never_reaches_a_hub(tokenizer, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        RLHFDataset("hiyouga/geometry3k@test", tokenizer, CFG, files_key="data.val_files")
    message = str(info.value)
    for words in (
        "data.val_files",
        "'hiyouga/geometry3k@test'",
        "hiyouga/geometry3k does not exist",
        "save_to_disk",
        "no hub is contacted",
    ):
        assert words in message, message


def test_bad_specs(tokenizer, tmp_path):
    pq.write_table(pa.Table.from_pylist(rows("train")), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"single file, which has no splits"):
        load_source(f"{tmp_path / 'd.parquet'}@test", "data.train_files")
    (tmp_path / "d.csv").write_text("problem,answer\n1+1=,2\n")
    with pytest.raises(ValueError, match=r"data.train_files: .*d.csv has an unsupported type '.csv'"):
        load_source(str(tmp_path / "d.csv"), "data.train_files")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"data.val_files: directory .*empty holds no parquet/JSON"):
        load_source(str(tmp_path / "empty"), "data.val_files")
    (tmp_path / "bad.json").write_text('{"problem": "a"}\n{"problem": ')
    with pytest.raises(ValueError, match=r"bad.json is not valid JSON Lines"):
        load_source(str(tmp_path / "bad.json"), "data.train_files")
