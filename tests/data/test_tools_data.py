"""tools/data scripts: each writes data (verl's or EasyR1's layout) that RLHFDataset loads and the scorers accept."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_megatron.config.schema import DataConfig
from rlhf_megatron.data.dataset import RLHFDataset
from rlhf_megatron.rewards import default_compute_score

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "data"


def load_tool(name):
    spec = importlib.util.spec_from_file_location(f"tools_data_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def no_temp_files(directory):
    return not [f for f in os.listdir(directory) if ".tmp-" in f]


def test_gsm8k_tool(tmp_path, tokenizer):
    src = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
            {"question": "What is 1,000 + 5?", "answer": "#### 1,005"},
        ],
    )
    out = tmp_path / "out"
    path = load_tool("gsm8k").main(["--input", src, "--output-dir", str(out)])
    assert path == str(out / "train.parquet") and no_temp_files(out)
    ds = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=256))
    item = ds[1]
    assert item["data_source"] == "openai/gsm8k" and item["reward_model"]["ground_truth"] == "1005"
    assert item["extra_info"] == {
        "split": "train",
        "index": 1,
        "answer": "#### 1,005",
        "question": "What is 1,000 + 5?",
    }
    assert tokenizer.decode(item["raw_prompt_ids"]).endswith(
        'output the final answer after "####".</s><|assistant|>'
    )
    assert default_compute_score("openai/gsm8k", "so #### 1,005", item["reward_model"]["ground_truth"]) == 1.0


def test_gsm8k_tool_errors_name_file_and_line(tmp_path):
    src = write_jsonl(
        tmp_path / "test.jsonl",
        [{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": "no marker"}],
    )
    with pytest.raises(ValueError, match=r"test.jsonl:2: .*no '#### <number>'"):
        load_tool("gsm8k").main(["--input", src, "--output-dir", str(tmp_path)])
    bad = write_jsonl(tmp_path / "x.jsonl", [{"question": "q"}])
    with pytest.raises(ValueError, match=r"x.jsonl:1: missing field\(s\) \['answer'\]"):
        load_tool("gsm8k").main(["--input", bad, "--output-dir", str(tmp_path), "--split", "test"])
    with pytest.raises(ValueError, match="pass --split"):
        load_tool("gsm8k").main(["--input", bad, "--output-dir", str(tmp_path)])


def test_math_tool(tmp_path, tokenizer):
    src = write_jsonl(
        tmp_path / "math_test.jsonl",
        [
            {
                "problem": "Half of 1?",
                "solution": "It is $\\boxed{\\frac{1}{2}}$.",
                "level": "Level 1",
                "type": "Algebra",
            },
            {"problem": "2+2?", "solution": "\\boxed{4}"},
        ],
    )
    path = load_tool("math_dataset").main(["--input", src, "--output-dir", str(tmp_path / "out")])
    ds = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=256))
    item = ds[0]
    assert item["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert item["reward_model"]["ground_truth"] == "\\frac{1}{2}"
    assert item["extra_info"] == {"split": "test", "index": 0, "level": "Level 1", "type": "Algebra"}
    assert "within \\boxed{}." in tokenizer.decode(item["raw_prompt_ids"])
    score = default_compute_score(
        item["data_source"], "so \\boxed{0.5}", item["reward_model"]["ground_truth"]
    )
    assert score == 1.0


def test_countdown_tool(tmp_path, tokenizer):
    out = tmp_path / "cd"
    paths = load_tool("countdown").main(
        ["--output-dir", str(out), "--train-size", "30", "--test-size", "5", "--seed", "1"]
    )
    train = RLHFDataset(paths[0], tokenizer, DataConfig(max_prompt_length=512))
    test = RLHFDataset(paths[1], tokenizer, DataConfig(max_prompt_length=512))
    assert (len(train), len(test)) == (30, 5) and no_temp_files(out)
    item = train[0]
    assert item["data_source"] == "countdown" and set(item["reward_model"]["ground_truth"]) == {
        "target",
        "numbers",
    }
    assert "<answer> (1 + 2) / 3 </answer>" in tokenizer.decode(item["raw_prompt_ids"])
    solution = f"<answer>{item['extra_info']['solution']}</answer>"
    assert default_compute_score("countdown", solution, item["reward_model"]["ground_truth"]) == 1.0


def test_arith_tool_cli(tmp_path, tokenizer):
    out = tmp_path / "arith"
    cmd = [
        sys.executable,
        str(TOOLS / "arith.py"),
        "--output-dir",
        str(out),
        "--train-size",
        "40",
        "--test-size",
        "8",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "wrote 40 rows" in result.stdout
    train = RLHFDataset(str(out / "train.parquet"), tokenizer, DataConfig(max_prompt_length=16))
    test = RLHFDataset(str(out / "test.parquet"), tokenizer, DataConfig(max_prompt_length=16))
    questions = lambda ds: {tokenizer.decode(ds[i]["raw_prompt_ids"]) for i in range(len(ds))}  # noqa: E731
    assert not questions(train) & questions(test)
    item = test[0]
    assert item["data_source"] == "arith" and sum(item["attention_mask"].tolist()) <= 16
    assert (
        default_compute_score(
            "arith", item["reward_model"]["ground_truth"], item["reward_model"]["ground_truth"]
        )
        == 1.0
    )


def test_shapes_vl_tool_is_an_easyr1_dataset_repository(tmp_path, vision):
    """The synthetic image task loads through ``path@split`` in EasyR1's layout and scores with EasyR1's math."""
    from rlhf_megatron.rewards.easyr1 import math_compute_score

    out = tmp_path / "shapes_vl"
    tool = load_tool("shapes_vl")
    paths = tool.main(["--output-dir", str(out), "--train-size", "6", "--test-size", "2", "--seed", "3"])
    assert paths == [str(out / "data" / f"{s}-00000-of-00001.parquet") for s in ("train", "test")]
    assert no_temp_files(out / "data")
    again = tool.main(
        ["--output-dir", str(tmp_path / "again"), "--train-size", "6", "--test-size", "2", "--seed", "3"]
    )
    assert Path(again[0]).read_bytes() == Path(paths[0]).read_bytes()  # deterministic

    cfg = DataConfig(
        prompt_key="problem", max_prompt_length=128, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16
    )
    train = RLHFDataset(f"{out}@train", vision.processor.tokenizer, cfg, vision)
    test = RLHFDataset(f"{out}@test", vision.processor.tokenizer, cfg, vision)
    assert (len(train), len(test)) == (6, 2)
    item = test[0]
    assert item["data_source"] == "shapes_vl" and item["multi_modal_inputs"]["image_grid_thw"].tolist() == [
        [1, 8, 8]
    ]
    answer = item["reward_model"]["ground_truth"]
    assert 1 <= int(answer) <= 5
    assert math_compute_score(f"<think>count</think>\\boxed{{{answer}}}", answer)["overall"] == 1.0


def test_shapes_video_tool_writes_clips_whose_squares_appear_over_time(tmp_path, vision):
    """The synthetic video task: EasyR1's video layout, MPEG-4 clips decoded with PyAV, the count
    visible in full only at the end, timed positions for every row."""
    from rlhf_megatron.data.video import load_video

    out = tmp_path / "shapes_video"
    tool = load_tool("shapes_video")
    paths = tool.main(["--output-dir", str(out), "--train-size", "8", "--test-size", "2", "--seed", "3"])
    assert paths == [str(out / "data" / f"{s}-00000-of-00001.parquet") for s in ("train", "test")]
    assert no_temp_files(out / "data")
    again = tool.main(
        ["--output-dir", str(tmp_path / "again"), "--train-size", "8", "--test-size", "2", "--seed", "3"]
    )
    assert Path(again[0]).read_bytes() == Path(paths[0]).read_bytes()  # deterministic

    cfg = DataConfig(prompt_key="problem", max_prompt_length=128, min_pixels=3136, max_pixels=3136)
    train = RLHFDataset(f"{out}@train", vision.processor.tokenizer, cfg, vision)
    counts = []
    for i in range(len(train)):
        item = train[i]
        assert item["multi_modal_inputs"]["video_grid_thw"].tolist() == [[2, 4, 4]]  # 4 frames at 2 fps
        frames, _ = item["multi_modal_data"]["video"][0]
        # Squares only appear: the dark (non-white) area never shrinks from frame to frame.
        dark = [int((f.min(-1) < 150).sum()) for f in frames]
        assert dark == sorted(dark) and dark[0] > 0, dark
        counts.append(int(item["reward_model"]["ground_truth"]))
    assert set(counts) <= {1, 2, 3, 4} and len(set(counts)) > 1
    import pyarrow.parquet as pq

    raw = pq.read_table(paths[0]).to_pylist()[0]["videos"][0]["bytes"]
    assert load_video({"bytes": raw}, fps=2.0).frames.shape[0] == 4

    # verl's layout: the problem as a chat message, each video a dict of PNG frames and their fps.
    verl = tool.main(
        ["--output-dir", str(tmp_path / "verl"), "--train-size", "4", "--test-size", "1", "--layout", "verl"]
    )
    row = pq.read_table(verl[0]).to_pylist()[0]
    assert row["prompt"] == [{"role": "user", "content": "<video>How many squares appear in the video?"}]
    assert len(row["videos"][0]["video"]) == 4 and row["videos"][0]["fps"] == 2.0
    assert row["data_source"] == "shapes_video" and 1 <= int(row["reward_model"]["ground_truth"]) <= 4
    ds = RLHFDataset(
        verl[0], vision.processor.tokenizer, dataclasses.replace(cfg, prompt_key="prompt"), vision
    )
    assert ds[0]["multi_modal_inputs"]["video_grid_thw"].tolist() == [[2, 4, 4]]
