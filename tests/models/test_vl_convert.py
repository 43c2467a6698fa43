"""``convert`` for Qwen2.5-VL and Qwen3-VL: HF -> megatron (TP2 x PP2) -> HF is bit-exact, loads in
transformers with the same logits (Qwen3-VL: on an image batch and a video batch), and the
processor, tokenizer and chat template travel with it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlhf_megatron.convert import main
from rlhf_megatron.models.checkpoint import CKPT_METADATA_FILE
from rlhf_megatron.platform.multiproc import run_on_ranks

from . import tiny_vl
from .test_convert_ckpt import _export_in_subprocess, _hf_state

SIDE_FILES = (
    "processor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_convert")
    hf = tiny_vl.make_model_dir(root, num_layers=4)  # 4 layers: PP2 x VPP2 splits them
    batch = tiny_vl.image_batch(hf)
    ref = tiny_vl.hf_logits(tiny_vl.load_hf(hf), batch)
    ckpt, out = root / "mcore", root / "hf-out"
    assert main(["hf-to-mcore", "--hf", str(hf), "--out", str(ckpt), "--tp", "2", "--pp", "2"]) == 0
    # The same checkpoint without config.json / generation_config.json: export rebuilds them from the arch.
    bare, bare_out = root / "mcore-bare", root / "hf-bare"
    shutil.copytree(ckpt, bare)
    for name in ("config.json", "generation_config.json"):
        (bare / name).unlink()
    # Qwen3-VL: DeepStack mergers split over TP, learned positions, layers on two stages.
    q3 = tiny_vl.make_model_dir(root, "qwen3_vl", num_layers=4)
    q3_model = tiny_vl.load_hf(q3)
    q3_batches = {"images": tiny_vl.image_batch(q3), "video": tiny_vl.video_batch(q3)}
    q3_refs = {k: tiny_vl.hf_logits(q3_model, b) for k, b in q3_batches.items()}
    q3_ckpt, q3_out, q3_bare, q3_bare_out = (
        root / n for n in ("q3-mcore", "q3-out", "q3-bare", "q3-bare-out")
    )
    assert main(["hf-to-mcore", "--hf", str(q3), "--out", str(q3_ckpt), "--tp", "2", "--pp", "2"]) == 0
    shutil.copytree(q3_ckpt, q3_bare)
    for name in ("config.json", "generation_config.json"):
        (q3_bare / name).unlink()
    proc = _export_in_subprocess(
        ["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--no-progress"],
        ["mcore-to-hf", "--ckpt", str(bare), "--out", str(bare_out), "--no-progress", "--no-verify"],
        ["mcore-to-hf", "--ckpt", str(q3_ckpt), "--out", str(q3_out), "--no-progress"],
        ["mcore-to-hf", "--ckpt", str(q3_bare), "--out", str(q3_bare_out), "--no-progress", "--no-verify"],
    )
    assert proc.returncode == 0, proc.stderr
    qwen3 = {"hf": q3, "out": q3_out, "bare_out": q3_bare_out, "batches": q3_batches, "refs": q3_refs}
    return {
        "hf": hf,
        "ckpt": ckpt,
        "out": out,
        "bare_out": bare_out,
        "batch": batch,
        "ref": ref,
        "qwen3": qwen3,
    }


@pytest.mark.slow
def test_round_trip_is_bit_exact_with_processor_files(converted):
    original, exported = _hf_state(converted["hf"]), _hf_state(converted["out"])
    assert set(exported) == set(original)
    assert any(n.startswith("visual.blocks.") for n in exported)  # what save_pretrained writes
    for name, t in original.items():
        assert torch.equal(exported[name], t), name
    meta = json.loads((converted["ckpt"] / CKPT_METADATA_FILE).read_text())
    assert meta["arch"]["vision"]["intermediate_size"] == 252 and meta["arch"]["mrope_section"] == [8, 12, 12]
    for name in SIDE_FILES:
        assert name in meta["files"], name
        assert (converted["out"] / name).read_bytes() == (converted["hf"] / name).read_bytes(), name


@pytest.mark.slow
def test_export_loads_in_transformers_with_the_same_logits(converted):
    from transformers import AutoProcessor

    model = tiny_vl.load_hf(converted["out"])
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert torch.equal(tiny_vl.hf_logits(model, converted["batch"]), converted["ref"])
    processor = AutoProcessor.from_pretrained(converted["out"])
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id
    # Without the source config.json the export writes one from the arch; transformers reads it alike.
    bare = tiny_vl.load_hf(converted["bare_out"])
    assert torch.equal(tiny_vl.hf_logits(bare, converted["batch"]), converted["ref"])


@pytest.mark.slow
def test_qwen3_vl_round_trip_is_bit_exact_and_runs_images_and_videos_alike(converted):
    q3 = converted["qwen3"]
    original, exported = _hf_state(q3["hf"]), _hf_state(q3["out"])
    assert set(exported) == set(original)
    assert any(n.startswith("model.visual.deepstack_merger_list.1.") for n in exported)
    assert "model.visual.pos_embed.weight" in exported and "model.visual.patch_embed.proj.bias" in exported
    for name, t in original.items():
        assert torch.equal(exported[name], t), name
    for out in (q3["out"], q3["bare_out"]):  # the bare one's config.json is written from the arch
        model = tiny_vl.load_hf(out)
        assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
        for kind, batch in q3["batches"].items():
            assert torch.equal(tiny_vl.hf_logits(model, batch), q3["refs"][kind]), (out.name, kind)


def _load_and_forward(rank, world_size, ckpt, batch, layouts):
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
        logits = forward_logits_or_values(
            chunks,
            batch["input_ids"],
            batch["attention_mask"],
            batch["position_ids"],
            micro_batch_size=1,
            pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"],
        )
        if logits is not None:
            out[(tp, pp, vpp)] = gather_from_tensor_model_parallel_region(logits)[
                ..., : arch.vocab_size
            ].numpy()
    return out


@pytest.mark.slow
def test_checkpoint_saved_at_tp2pp2_loads_at_other_layouts(converted):
    layouts = [(1, 1, None), (1, 2, 2)]  # TP1, and PP2 with two virtual stages (the tower on chunk 0)
    results = run_on_ranks(_load_and_forward, 2, str(converted["ckpt"]), converted["batch"], layouts)
    valid, ref = converted["batch"]["attention_mask"].bool(), converted["ref"]
    seen = set()
    for out in results:
        for layout, array in out.items():
            seen.add(layout)
            rel = ((torch.from_numpy(array) - ref).abs()[valid].max() / ref[valid].abs().max()).item()
            assert rel <= 1e-5, (layout, rel)
    assert seen == set(layouts)
