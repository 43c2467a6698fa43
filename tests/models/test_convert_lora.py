"""``convert lora-to-peft`` / ``lora-to-hf``: a LoRA training checkpoint's adapter, exported as a PEFT
adapter or merged into its base, reproduces the PEFT model's logits; bad input is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_megatron.config.schema_model import LoraConfig
from rlhf_megatron.convert import main
from rlhf_megatron.models.checkpoint import CKPT_METADATA_FILE
from rlhf_megatron.models.lora_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_peft_adapter

from . import tiny_hf


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny Llama base, a PEFT model on it with random non-zero A and B, and that adapter laid out
    as a LoRA trainer checkpoint: ``global_step_3/actor/{adapter/, state_rank0.pt}``, no ``model/``."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, get_peft_model_state_dict

    root = tmp_path_factory.mktemp("lora_convert")
    model = tiny_hf.make_hf_model("llama")
    base = tiny_hf.save_hf_model(model, root / "base")
    tiny_hf.save_tokenizer(base)
    peft_cfg = PeftLoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, lora_dropout=0.0
    )
    torch.manual_seed(5)
    peft_model = get_peft_model(model, peft_cfg).eval()  # wraps (and changes) ``model`` in place
    batch = tiny_hf.padded_batch()
    ref = tiny_hf.hf_logits(peft_model, *batch)
    with peft_model.disable_adapter():  # the adapter moves the logits far more than the tolerances
        assert (tiny_hf.hf_logits(peft_model, *batch) - ref).abs().max() > 0.1
    tensors = {
        k.replace(".default", ""): v.detach().clone()
        for k, v in get_peft_model_state_dict(peft_model).items()
    }
    assert len(tensors) == 4 * 7 * 2 and all(v.abs().max() > 0 for v in tensors.values())
    actor = root / "global_step_3" / "actor"
    write_peft_adapter(
        actor / "adapter", tensors, LoraConfig(rank=4, alpha=8.0, target_modules="all-linear"), str(base)
    )
    torch.save({"optimizer": {}}, actor / "state_rank0.pt")
    return {"root": root, "base": base, "actor": actor, "batch": batch, "ref": ref, "tensors": tensors}


def _load_causal_lm(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


def test_lora_to_peft_loads_in_peft_with_the_same_logits(lora_run, tmp_path):
    from peft import PeftModel

    out = tmp_path / "adapter"
    assert main(["lora-to-peft", "--ckpt", str(lora_run["actor"]), "--out", str(out)]) == 0
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str(lora_run["base"].resolve())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    saved = load_file(str(out / ADAPTER_WEIGHTS))
    assert saved.keys() == lora_run["tensors"].keys()
    assert all(torch.equal(saved[k], v) for k, v in lora_run["tensors"].items())

    peft_model = PeftModel.from_pretrained(_load_causal_lm(lora_run["base"]), out).eval()
    logits = tiny_hf.hf_logits(peft_model, *lora_run["batch"])
    assert (logits - lora_run["ref"]).abs().max().item() <= 1e-5


def test_lora_to_hf_merges_into_a_model_with_the_same_logits(lora_run, tmp_path):
    out = tmp_path / "merged"
    step = lora_run["actor"].parent  # the step directory resolves to actor/adapter too
    argv = [
        "lora-to-hf",
        "--ckpt",
        str(step),
        "--out",
        str(out),
        "--max-shard-size",
        "200KB",
        "--no-progress",
    ]
    assert main(argv) == 0
    assert len(list(out.glob("model-*.safetensors"))) > 1  # streamed into several shards
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert not list(out.glob("adapter_*")) and not list(tmp_path.glob(".merged.*")), "stray files"

    merged = _load_causal_lm(out)
    logits = tiny_hf.hf_logits(merged, *lora_run["batch"])
    ref = lora_run["ref"]
    assert ((logits - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    # The base's names, shapes and dtypes, every adapted projection changed.
    base_state = tiny_hf.make_hf_model("llama").state_dict()
    merged_state = merged.state_dict()
    assert merged_state.keys() == base_state.keys()
    q = "model.layers.2.self_attn.q_proj.weight"
    assert not torch.equal(merged_state[q], base_state[q])
    norm = "model.layers.2.input_layernorm.weight"
    assert torch.equal(merged_state[norm], base_state[norm])


def test_lora_to_hf_bf16_is_the_fp32_merge_rounded_once(lora_run, tmp_path):
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    for out, extra in ((fp32, []), (bf16, ["--dtype", "bf16"])):
        argv = ["lora-to-hf", "--ckpt", str(lora_run["actor"]), "--out", str(out), "--no-progress", *extra]
        assert main(argv) == 0
    a, b = load_file(str(next(fp32.glob("*.safetensors")))), load_file(str(next(bf16.glob("*.safetensors"))))
    assert a.keys() == b.keys()
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(b[k], a[k].to(torch.bfloat16)) for k in a)
    config = json.loads((bf16 / "config.json").read_text())
    assert config["dtype"] == "bfloat16"


def test_missing_adapter_and_wrong_checkpoint_kind_are_refused(lora_run, tmp_path, capsys):
    out = str(tmp_path / "o")
    assert main(["lora-to-peft", "--ckpt", str(tmp_path / "nowhere"), "--out", out]) == 2
    assert "nowhere does not exist" in capsys.readouterr().err

    (tmp_path / "empty").mkdir()
    assert main(["lora-to-hf", "--ckpt", str(tmp_path / "empty"), "--out", out]) == 2
    err = capsys.readouterr().err
    assert "holds no LoRA adapter" in err and "actor/adapter" in err

    # A full fine-tuning checkpoint: <step>/actor/model holds the dist-checkpoint and its metadata.
    full = tmp_path / "global_step_1"
    (full / "actor" / "model").mkdir(parents=True)
    (full / "actor" / "model" / CKPT_METADATA_FILE).write_text("{}")
    for command in ("lora-to-peft", "lora-to-hf"):
        assert main([command, "--ckpt", str(full / "actor"), "--out", out]) == 2
        err = capsys.readouterr().err
        assert (
            "full fine-tuning checkpoint" in err and f"mcore-to-hf --ckpt {full / 'actor' / 'model'}" in err
        )

    # ... and the other way round: mcore-to-hf on a LoRA checkpoint (adapter, no model/).
    assert main(["mcore-to-hf", "--ckpt", str(lora_run["actor"]), "--out", out, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "is a LoRA checkpoint" in err and "lora-to-hf" in err and "lora-to-peft" in err
    assert not Path(out).exists()


def test_adapter_directory_missing_its_weights_is_named(lora_run, tmp_path, capsys):
    adapter = tmp_path / "actor" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / ADAPTER_CONFIG).write_text((lora_run["actor"] / "adapter" / ADAPTER_CONFIG).read_text())
    assert main(["lora-to-peft", "--ckpt", str(tmp_path / "actor"), "--out", str(tmp_path / "o")]) == 2
    assert f"{ADAPTER_WEIGHTS} is missing" in capsys.readouterr().err


def test_base_model_mismatch_is_named(lora_run, tmp_path, capsys):
    other = tmp_path / "other"
    tiny_hf.hf_config("llama", intermediate_size=192).save_pretrained(other)
    for command in ("lora-to-peft", "lora-to-hf"):
        argv = [command, "--ckpt", str(lora_run["actor"]), "--out", str(tmp_path / "o"), "--base", str(other)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "_proj.lora_" in err and "does not match" in err and str(other) in err
    assert not (tmp_path / "o").exists()

    # The base the adapter names is gone: say to pass --base.
    actor = tmp_path / "moved" / "actor"
    config = json.loads((lora_run["actor"] / "adapter" / ADAPTER_CONFIG).read_text())
    write_peft_adapter(
        actor / "adapter",
        lora_run["tensors"],
        LoraConfig(rank=config["r"], alpha=config["lora_alpha"], target_modules="all-linear"),
        str(tmp_path / "deleted_base"),
    )
    assert main(["lora-to-hf", "--ckpt", str(actor), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "deleted_base" in err and "pass --base" in err
    assert (
        main(
            [
                "lora-to-peft",
                "--ckpt",
                str(actor),
                "--out",
                str(tmp_path / "o"),
                "--base",
                str(lora_run["base"]),
            ]
        )
        == 0
    )


def test_existing_output_and_overlapping_output_are_refused(lora_run, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("x")
    for command in ("lora-to-peft", "lora-to-hf"):
        assert main([command, "--ckpt", str(lora_run["actor"]), "--out", str(out)]) == 2
        assert "already exists; pass --force" in capsys.readouterr().err
    assert (out / "keep").is_file()
    assert main(["lora-to-peft", "--ckpt", str(lora_run["actor"]), "--out", str(out), "--force"]) == 0
    assert not (out / "keep").exists() and (out / ADAPTER_WEIGHTS).is_file()

    # --force must not replace what the conversion reads.
    argv = ["lora-to-hf", "--ckpt", str(lora_run["actor"]), "--out", str(lora_run["actor"]), "--force"]
    assert main(argv) == 2
    assert "would replace the adapter" in capsys.readouterr().err
    argv = ["lora-to-hf", "--ckpt", str(lora_run["actor"]), "--out", str(lora_run["base"]), "--force"]
    assert main(argv) == 2
    assert "would replace the base model" in capsys.readouterr().err
    assert (lora_run["actor"] / "adapter" / ADAPTER_WEIGHTS).is_file() and (
        lora_run["base"] / "config.json"
    ).is_file()
