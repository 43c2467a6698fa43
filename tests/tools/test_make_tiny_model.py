"""tools/make_tiny_model.py: a loadable, TP=2-shardable policy pre-trained by the SFT trainer, RL
parquet files, stamp and determinism."""

import contextlib
import hashlib
import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "make_tiny_model.py"

# Each build is a run of the SFT trainer (a local Ray, one megatron-core process): ~15 s.
pytestmark = pytest.mark.slow

# Few steps and small eval sets keep a build to a few seconds on 2 cores.
FAST = [
    "--steps",
    "10",
    "--eval-every",
    "5",
    "--train-size",
    "64",
    "--test-size",
    "40",
    "--probe-size",
    "40",
    "--samples-per-prompt",
    "2",
    "--batch-size",
    "32",
]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("tools_make_tiny_model", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def run(tool, capsys, *argv):
    assert tool.main([*FAST, *argv]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, f"expected one JSON line on stdout, got {lines}"
    return json.loads(lines[0])


def digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tool, tmp_path_factory):
    """One build shared by the tests below: (result, out_dir, data_dir)."""
    root = tmp_path_factory.mktemp("tiny")
    out, data = root / "model", root / "data"
    stdout = io.StringIO()  # capsys is function-scoped, so capture by hand
    with contextlib.redirect_stdout(stdout):
        assert tool.main([*FAST, "--out", str(out), "--data-dir", str(data)]) == 0
    return json.loads(stdout.getvalue()), out, data


def test_result_fields(built):
    result, _, _ = built
    for key in ("greedy_accuracy", "sampled_accuracy", "sampled_pass_at_n", "sampled_group_signal"):
        assert 0.0 <= result[key] <= 1.0, key
    assert 1 <= result["steps"] <= 10
    assert result["params"] > 1_000_000
    assert result["seconds"] > 0
    assert result["test_prompts"] == 40
    assert result["skipped"] is False
    # A probe at every checkpoint of the SFT run (every --eval-every steps), with the run's loss.
    curve = result["probe_curve"]
    assert [p["step"] for p in curve] == list(range(5, result["steps"] + 1, 5))
    assert all(0.0 <= p["accuracy"] <= 1.0 for p in curve)
    if len(curve) > 1:
        assert curve[-1]["loss"] < curve[0]["loss"]


def test_model_loads_and_is_tp2_shardable(built):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, out, _ = built
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 64)
    assert cfg.hidden_size == 256 and not cfg.tie_word_embeddings
    assert cfg.max_position_embeddings >= 128
    assert cfg.vocab_size == len(tokenizer)
    assert model.config.model_type == "llama"
    # The saved tokenizer renders prompts as the RL side does.
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "3+5="}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|user|>3+5=</s><|assistant|>"
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tokenizer))


def test_parquet_files_load_and_are_disjoint(built):
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from rlhf_megatron.data import RLHFDataset

    _, out, data = built
    tokenizer = AutoTokenizer.from_pretrained(out)
    train = RLHFDataset(data / "train.parquet", tokenizer, {"max_prompt_length": 16})
    test = RLHFDataset(data / "test.parquet", tokenizer, {"max_prompt_length": 16})
    assert (len(train), len(test)) == (64, 40)
    assert test[0]["data_source"] == "arith" and test[0]["input_ids"].shape == (16,)

    def questions(name):
        return {row[0]["content"] for row in pq.read_table(data / name).column("prompt").to_pylist()}

    assert not questions("train.parquet") & questions("test.parquet")


def test_pretraining_never_sees_test_problems(tool):
    args = tool.parse_args([*FAST])
    pool, probe, test = tool.split_problems(args)
    pool_q, probe_q, test_q = ({r["question"] for r in rows} for rows in (pool, probe, test))
    assert not pool_q & test_q and not probe_q & test_q and not pool_q & probe_q
    assert len(pool_q) + len(probe_q) + len(test_q) == 31 * 31


def test_second_run_skips_and_force_is_deterministic(tool, built, capsys, tmp_path):
    result, out, data = built
    weights = out / "model.safetensors"
    before = (digest(weights), weights.stat().st_mtime_ns)

    again = run(tool, capsys, "--out", str(out), "--data-dir", str(data))
    assert again["skipped"] is True
    assert again["greedy_accuracy"] == result["greedy_accuracy"]
    assert (digest(weights), weights.stat().st_mtime_ns) == before

    # Rebuilding elsewhere with the same seed gives the same weights and numbers.
    rebuilt = run(tool, capsys, "--out", str(tmp_path / "m"), "--data-dir", str(tmp_path / "d"), "--force")
    assert rebuilt["skipped"] is False
    assert digest(tmp_path / "m" / "model.safetensors") == before[0]
    assert rebuilt["greedy_accuracy"] == result["greedy_accuracy"]
    assert rebuilt["sampled_accuracy"] == result["sampled_accuracy"]
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_changed_arguments_rebuild_and_the_probe_stops_pretraining(tool, capsys, tmp_path):
    out = tmp_path / "m"
    first = run(tool, capsys, "--out", str(out), "--data-dir", str(tmp_path / "d"), "--steps", "5")
    # Target 0: the first checkpoint's probe is enough, so the SFT run stops there (step 5 of 10).
    second = run(tool, capsys, "--out", str(out), "--data-dir", str(tmp_path / "d"), "--target-accuracy", "0")
    assert first["skipped"] is False and second["skipped"] is False
    assert second["steps"] == 5 and len(second["probe_curve"]) == 1
    assert json.loads((out / "stamp.json").read_text())["args"]["target_accuracy"] == 0.0


def test_refuses_to_replace_a_foreign_directory(tool, tmp_path):
    out = tmp_path / "not_ours"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(SystemExit, match="has no stamp.json"):
        tool.main([*FAST, "--out", str(out), "--data-dir", str(tmp_path / "d")])
    assert (out / "keep.txt").exists()
