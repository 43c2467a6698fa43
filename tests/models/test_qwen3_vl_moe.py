"""Qwen3-VL-MoE (transformers' ``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL's tower over a
Qwen3-MoE decoder whose checkpoint stacks each layer's experts into ``experts.gate_up_proj`` and
``experts.down_proj``) on megatron-core.

Without processes: the config and what it refuses, parameter counts, the spec's stacked experts
(bit-exact both ways; transformers 5's transposed ``save_pretrained`` layout read alike), the weight
sync's per-expert names, the config rebuilt from the arch.

One 4-rank run (process starts are the suite's cost): ``hf-to-mcore`` at EP2 x PP2 and TP2 x PP2
through the command line's torchrun path, logits against transformers' on images and on videos at
TP1, EP2 x PP2 and TP2 x PP2 (both DeepStack levels on the first stage), and the ``hf``-format sync
stream at EP2 x PP2. One export process for both checkpoints: bit-exact, and transformers computes
the same logits from them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rlhf_megatron.models.spec import (
    DictTensorSource,
    ExpertStacker,
    expected_hf_shapes,
    gather_tp_shards,
    hf_names,
    hf_source,
    hf_to_mcore,
    is_expert_param,
    mcore_full_shape,
    mcore_param_names,
    mcore_to_hf,
)
from rlhf_megatron.planning.model_arch import ModelArch, UnsupportedModelError

from . import tiny_vl

REL_TOL = 1e-5
EXPERTS, WIDTH, HIDDEN = 4, 64, 256  # the tiny model's experts, expert width, hidden size
LAYER0 = "model.language_model.layers.0.mlp."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(hf dir, arch, HF state, config.json) of a 4-layer tiny Qwen3-VL-MoE (the hub's layout)."""
    hf = tiny_vl.make_model_dir(tmp_path_factory.mktemp("q3moe"), "qwen3_vl_moe", num_layers=4)
    config = json.loads((hf / "config.json").read_text())
    return hf, ModelArch.from_hf_dir(hf), load_file(str(hf / "model.safetensors")), config


# -- config ------------------------------------------------------------------------------------


def test_config_parses_to_qwen3_vls_tower_over_a_qwen3_moe_decoder(tiny):
    _, arch, _, config = tiny
    assert arch.architecture == "Qwen3VLMoeForConditionalGeneration" and arch.model_type == "qwen3_vl_moe"
    assert ModelArch.from_dict(json.loads(json.dumps(arch.to_dict()))) == arch
    assert (arch.qk_norm, arch.qkv_bias, arch.mrope_interleaved, arch.tie_word_embeddings) == (
        True,
        False,
        True,
        False,
    )
    moe = arch.moe
    assert (moe.num_experts, moe.top_k, moe.ffn_hidden_size, moe.moe_layers) == (
        EXPERTS,
        2,
        WIDTH,
        (0, 1, 2, 3),
    )
    assert moe.norm_topk_prob and moe.aux_loss_coef == 0.01 and moe.shared_expert_ffn_hidden_size is None
    v = arch.vision
    assert v.deepstack_visual_indexes == (0, 1) and v.frames_apart and v.num_position_embeddings == 16
    # transformers' router renormalises whatever the config says: so does the arch without the key.
    config = json.loads(json.dumps(config))
    config["text_config"].pop("norm_topk_prob")
    assert ModelArch.from_hf_config(config).moe.norm_topk_prob


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda c: c["text_config"].update(norm_topk_prob=False),
            "norm_topk_prob=false is not supported for qwen3_vl_moe",
        ),
        (  # transformers' Qwen3VLMoeTextConfig default, beside the untied top level
            lambda c: c["text_config"].pop("tie_word_embeddings"),
            "tie_word_embeddings is false .* text_config.tie_word_embeddings is true",
        ),
        (
            lambda c: c["text_config"].update(moe_intermediate_size=128),
            "moe_intermediate_size=128 with hidden_size=256 is not supported: .* square",
        ),
        (
            lambda c: c["text_config"]["rope_parameters"].pop("mrope_interleaved"),
            'a qwen3_vl_moe config needs "mrope_interleaved": true',
        ),
        (lambda c: c["text_config"].update(num_experts_per_tok=5), "num_experts_per_tok=5 must be between 1"),
        (lambda c: c["text_config"].update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    ],
)
def test_configs_transformers_and_vllm_would_run_apart_are_refused_naming_the_key(tiny, edit, match):
    config = json.loads(json.dumps(tiny[3]))
    edit(config)
    with pytest.raises(UnsupportedModelError, match=match):
        ModelArch.from_hf_config(config, source="/m/config.json")


def test_parameter_count_is_the_checkpoints_and_the_released_models(tiny):
    from rlhf_megatron.planning.arch import count_parameters

    _, arch, state, _ = tiny
    count = count_parameters(arch)
    assert count.total == sum(t.numel() for t in state.values())
    assert count.vision == sum(t.numel() for n, t in state.items() if n.startswith("model.visual."))
    assert sum(count.experts) == sum(t.numel() for n, t in state.items() if ".experts." in n)
    assert count.total - count.active == 4 * (EXPERTS - 2) * 3 * HIDDEN * WIDTH  # 2 of 4 experts idle
    # Qwen3-VL-30B-A3B as released (the preset's model_arch) and Qwen3-VL-235B-A22B, which differs in
    # its sizes only (the hub lists 31.1B and 236B parameters).
    preset = Path(__file__).resolve().parents[2] / "configs" / "models" / "qwen3_vl_30b_a3b.yaml"
    released = yaml.safe_load(preset.read_text())["model_arch"]
    assert round(count_parameters(ModelArch.from_hf_config(released)).total / 1e9, 1) == 31.1
    released["text_config"].update(
        hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, moe_intermediate_size=1536
    )
    released["vision_config"].update(out_hidden_size=4096)
    assert round(count_parameters(ModelArch.from_hf_config(released)).total / 1e9) == 236


# -- spec --------------------------------------------------------------------------------------


def test_each_megatron_expert_is_a_row_of_the_stacked_tensors_and_the_round_trip_is_bit_exact(tiny):
    _, arch, state, _ = tiny
    assert state[LAYER0 + "experts.gate_up_proj"].shape == (EXPERTS, HIDDEN, 2 * WIDTH)  # the hub's
    assert state[LAYER0 + "experts.down_proj"].shape == (EXPERTS, WIDTH, HIDDEN)
    source = hf_source(DictTensorSource(state), arch)
    fc1 = "language_model.decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    fc2 = "language_model.decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"
    assert hf_names(fc1, arch) == (LAYER0 + "experts.gate_up_proj",) and is_expert_param(fc1, arch)
    gate_up = state[LAYER0 + "experts.gate_up_proj"][3]  # [hidden, gate | up]
    assert torch.equal(hf_to_mcore(fc1, arch, source), gate_up.T)  # megatron's [gate; up]
    assert torch.equal(hf_to_mcore(fc2, arch, source), state[LAYER0 + "experts.down_proj"][3].T)
    # Expert TP 2: each rank its [gate_r; up_r], reassembled as megatron's gather does.
    shards = [hf_to_mcore(fc1, arch, source, r, 2) for r in range(2)]
    assert torch.equal(shards[1], torch.cat([gate_up.T[32:64], gate_up.T[96:128]]))
    assert torch.equal(gather_tp_shards(fc1, shards, arch), gate_up.T)
    # Every megatron tensor, back through ExpertStacker: the checkpoint, each tensor once.
    stacker, exported = ExpertStacker(arch), {}
    for name in mcore_param_names(arch):
        full = hf_to_mcore(name, arch, source)
        assert tuple(full.shape) == mcore_full_shape(name, arch), name
        for row, t in mcore_to_hf(name, full, arch):
            for hf_name, whole in stacker.add(row, t):
                assert hf_name not in exported, hf_name
                exported[hf_name] = whole
    assert stacker.pending == [] and set(exported) == set(state) == set(expected_hf_shapes(arch))
    for name, t in state.items():
        assert torch.equal(exported[name], t), name
    assert mcore_to_hf(fc2, torch.zeros(HIDDEN, WIDTH), arch)[0][0] == LAYER0 + "experts.down_proj[3]"


def test_a_checkpoint_saved_by_transformers_reads_as_the_hubs(tiny, tmp_path):
    hf, arch, state, _ = tiny
    tiny_vl.load_hf(hf).save_pretrained(tmp_path)  # transformers 5 writes the stacks transposed
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert saved[LAYER0 + "experts.gate_up_proj"].shape == (EXPERTS, 2 * WIDTH, HIDDEN)
    source, hub = hf_source(DictTensorSource(saved), arch), hf_source(DictTensorSource(state), arch)
    assert source.shape(LAYER0 + "experts.down_proj") == (EXPERTS, WIDTH, HIDDEN)
    for name in mcore_param_names(arch):
        if is_expert_param(name, arch):
            assert torch.equal(hf_to_mcore(name, arch, source, 1, 2), hf_to_mcore(name, arch, hub, 1, 2)), (
                name
            )


def test_weight_sync_sends_each_expert_under_qwen3_moe_names(tiny):
    from rlhf_megatron.weights import TrainLayout, build_sync_plan
    from rlhf_megatron.weights.plan import vllm_hf_tensors

    _, arch, state, _ = tiny
    plan = build_sync_plan(arch, TrainLayout(1, 2, ep_size=2), 1, "hf", bucket_bytes=1 << 16, dtype_bytes=4)
    targets = {x.name: x.shape for t in plan.transfers for x in t.targets}
    experts = LAYER0 + "experts."
    assert targets[experts + "3.gate_proj.weight"] == targets[experts + "3.up_proj.weight"] == (WIDTH, HIDDEN)
    assert targets[experts + "3.down_proj.weight"] == (HIDDEN, WIDTH)
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in targets)
    assert len([n for n in targets if ".experts." in n]) == 4 * EXPERTS * 3
    assert set(targets) - {n for n in targets if ".experts." in n} == {
        n for n in state if ".experts." not in n
    }
    # What is sent for expert 3 is the checkpoint's row 3, split and transposed.
    source = hf_source(DictTensorSource(state), arch)
    fc1 = "language_model.decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    sent = dict(vllm_hf_tensors(fc1, hf_to_mcore(fc1, arch, source), arch))
    row = state[experts + "gate_up_proj"][3]
    assert torch.equal(sent[experts + "3.gate_proj.weight"], row[:, :WIDTH].T)
    assert torch.equal(sent[experts + "3.up_proj.weight"], row[:, WIDTH:].T)
    with pytest.raises(ValueError, match="load_format=sharded is not supported"):
        build_sync_plan(arch, TrainLayout(1, 1), 1, "sharded")


def test_export_without_a_config_rebuilds_one_transformers_and_vllm_read_alike(tiny):
    from transformers import AutoConfig

    from rlhf_megatron.convert.common import hf_config

    arch = tiny[1]
    config = hf_config(arch, None, torch.float32)  # from the arch alone, as mcore-to-hf does
    assert ModelArch.from_hf_config(config) == arch
    assert config["text_config"]["norm_topk_prob"] is True  # vLLM reads it
    reread = AutoConfig.for_model(**config).to_dict()
    assert ModelArch.from_hf_config({**reread, "architectures": [arch.architecture]}) == arch


# -- megatron-core: one 4-rank run ---------------------------------------------------------------

LAYOUTS = [(1, 1, 1), (1, 2, 2), (2, 2, 1)]  # (tp, pp, ep): TP1, EP2 x PP2, TP2 x PP2
CONVERSIONS = {"ep2pp2": ["--ep", "2", "--pp", "2"], "tp2pp2": ["--tp", "2", "--pp", "2"]}
VISUALS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def _forward(hf_dir, batches, refs):
    """Relative logit errors against transformers', per (batch, layout), on the output ranks; and
    the EP2 x PP2 actor's ``hf`` sync stream."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.forward import forward_logits_or_values
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.platform import ParallelGroups, init_model_parallel
    from rlhf_megatron.weights import TrainLayout, WeightSyncer, build_sync_plan

    arch = ModelArch.from_hf_dir(hf_dir)
    errors, stream = {}, None
    for tp, pp, ep in LAYOUTS:
        info = init_model_parallel(tp, pp, expert_model_parallel_size=ep)
        chunks = build_gpt_model(
            arch, ParallelConfig(tp, pp, expert_model_parallel_size=ep), init_weights=False
        )
        load_hf_weights(chunks, hf_dir, arch)
        for kind, b in batches.items():
            out = forward_logits_or_values(
                chunks,
                b["input_ids"],
                b["attention_mask"],
                b["position_ids"],
                micro_batch_size=1 if pp > 1 else None,
                **{k: b[k] for k in VISUALS if k in b},
            )
            if out is not None:
                full = gather_from_tensor_model_parallel_region(out)[..., : arch.vocab_size]
                ref, valid = refs[kind], b["attention_mask"].bool()
                errors[(kind, (tp, pp, ep))] = (
                    (full - ref).abs()[valid].max() / ref[valid].abs().max()
                ).item()
        if (pp, ep) == (2, 2):
            plan = build_sync_plan(arch, TrainLayout.of(info), 1, "hf", bucket_bytes=1 << 16, dtype_bytes=4)
            syncer = WeightSyncer.of(plan, chunks, info, ParallelGroups.current())
            stream = [(n, t.clone()) for n, t in syncer.iter_weights()]
    return errors, stream


def _convert_and_forward(rank, world_size, jobs, hf_dir, batches, refs):
    from rlhf_megatron.convert import main

    for argv in jobs:
        if main(argv) != 0:
            raise RuntimeError(f"convert {argv} failed on rank {rank}")
    return _forward(hf_dir, batches, refs)


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    from rlhf_megatron.platform.multiproc import run_on_ranks

    from .test_convert_ckpt import _export_in_subprocess

    hf = tiny[0]
    root = tmp_path_factory.mktemp("q3moe_runs")
    model = tiny_vl.load_hf(hf)
    batches = {"images": tiny_vl.image_batch(hf), "video": tiny_vl.video_batch(hf)}
    refs = {kind: tiny_vl.hf_logits(model, b) for kind, b in batches.items()}
    jobs, exports, out = [], [], {}
    for layout, flags in CONVERSIONS.items():
        ckpt, export = root / layout, root / f"{layout}-hf"
        jobs.append(["hf-to-mcore", "--hf", str(hf), "--out", str(ckpt), *flags])
        exports.append(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(export), "--no-progress"])
        out[layout] = export
    ranks = run_on_ranks(_convert_and_forward, 4, jobs, str(hf), batches, refs, timeout_s=900)
    proc = _export_in_subprocess(*exports)
    assert proc.returncode == 0, proc.stderr
    return {"ranks": ranks, "exports": out, "batches": batches, "refs": refs}


@pytest.mark.slow
def test_megatron_logits_match_transformers_on_images_and_videos(runs):
    seen = set()
    for errors, _ in runs["ranks"]:
        for key, err in errors.items():
            assert err <= REL_TOL, (key, err)
            seen.add(key)
    assert seen == {(kind, layout) for kind in ("images", "video") for layout in LAYOUTS}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(CONVERSIONS))
def test_hf_to_mcore_to_hf_is_bit_exact_and_transformers_computes_the_same(tiny, runs, layout):
    from .test_convert_ckpt import _hf_state

    hf, _, state, _ = tiny
    export = runs["exports"][layout]
    exported = _hf_state(export)
    assert set(exported) == set(state)
    for name, t in state.items():
        assert torch.equal(exported[name], t), name
    model = tiny_vl.load_hf(export)
    assert type(model).__name__ == "Qwen3VLMoeForConditionalGeneration"
    for kind, batch in runs["batches"].items():
        assert torch.equal(tiny_vl.hf_logits(model, batch), runs["refs"][kind]), kind


@pytest.mark.slow
def test_weight_sync_stream_carries_every_expert_once_per_rank(tiny, runs):
    _, _, state, _ = tiny
    want = {n: t for n, t in state.items() if ".experts." not in n}
    for name, stack in state.items():
        if name.endswith("experts.gate_up_proj"):
            experts = name.removesuffix("gate_up_proj")
            for e, row in enumerate(stack):  # [hidden, gate | up]
                want[f"{experts}{e}.gate_proj.weight"] = row[:, :WIDTH].T
                want[f"{experts}{e}.up_proj.weight"] = row[:, WIDTH:].T
        elif name.endswith("experts.down_proj"):
            experts = name.removesuffix("down_proj")
            for e, row in enumerate(stack):
                want[f"{experts}{e}.down_proj.weight"] = row.T
    for rank, (_, stream) in enumerate(runs["ranks"]):
        names = [n for n, _ in stream]
        assert len(names) == len(set(names)) and set(names) == set(want), rank
        for name, t in stream:
            assert torch.equal(t, want[name]), (rank, name)


# -- vLLM: one fresh process -------------------------------------------------------------------


def _image_prompt(hf_dir):
    """One chat prompt with an image: (the processor, the prompt text, the image)."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(hf_dir)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 96, 3), dtype=np.uint8))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor, text, image


def _vllm_before_and_after_sync(rank, world_size, export_dir, perturbed_dir):
    """vLLM (rollout TP 1) started from ``export_dir``: its prompt log-probs, then again after the
    ``hf``-format sync of a TP1 actor loaded from ``perturbed_dir``."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    from rlhf_megatron.config.schema import RolloutConfig
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.platform import ParallelGroups, init_model_parallel
    from rlhf_megatron.rollout.vllm_engine import VLLMEngine
    from rlhf_megatron.weights import TrainLayout, WeightSyncer, build_sync_plan

    info = init_model_parallel(1, 1)
    arch = ModelArch.from_hf_dir(perturbed_dir)
    chunks = build_gpt_model(arch, ParallelConfig(1, 1), init_weights=False)
    load_hf_weights(chunks, perturbed_dir, arch)
    engine = VLLMEngine(
        export_dir,
        RolloutConfig(dtype="float32", max_num_seqs=2, limit_images=1),
        max_model_len=256,
        tensor_parallel_size=1,
    )
    processor, text, image = _image_prompt(export_dir)
    # One <|image_pad|> per image, as a rollout prompt holds it: vLLM expands it to the image's tokens.
    prompt = {
        "prompt_token_ids": processor.tokenizer(text)["input_ids"],
        "multi_modal_data": {"image": image},
    }
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def log_probs():
        out = engine.llm.generate([dict(prompt)], params)[0]
        ids = list(out.prompt_token_ids)
        return ids, [x[t].logprob for x, t in zip(out.prompt_logprobs[1:], ids[1:])]

    ids, before = log_probs()
    plan = build_sync_plan(arch, TrainLayout.of(info), 1, "hf", bucket_bytes=1 << 16, dtype_bytes=4)
    sent = []
    stream = WeightSyncer.of(plan, chunks, info, ParallelGroups.current()).iter_weights()
    engine.update_weights((sent.append(n) or (n, t)) for n, t in stream)
    _, after = log_probs()
    engine.shutdown()
    return {"ids": ids, "before": before, "after": after, "experts_sent": sum(".experts." in n for n in sent)}


def _perturbed_copy(src, dst):
    """``src`` with every tensor moved by seeded noise of 5% of its spread (config, processor kept)."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    moved = {n: t + 0.05 * t.std() * torch.randn(t.shape, generator=g) for n, t in state.items()}
    save_file(moved, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.slow
def test_vllm_loads_the_export_and_takes_a_weight_sync_as_transformers_reads_it(tiny, runs, tmp_path):
    from rlhf_megatron.platform.multiproc import run_on_ranks

    export = runs["exports"]["ep2pp2"]
    perturbed = _perturbed_copy(tiny[0], tmp_path / "perturbed")
    processor, text, image = _image_prompt(export)
    enc = processor(text=[text], images=[image], return_tensors="pt")
    ids = enc["input_ids"][0]
    refs = {}
    for name, hf_dir in (("export", export), ("perturbed", perturbed)):
        with torch.no_grad():
            logits = tiny_vl.load_hf(hf_dir)(**enc).logits[0].float()
        refs[name] = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    (got,) = run_on_ranks(_vllm_before_and_after_sync, 1, str(export), str(perturbed), env=env, timeout_s=600)
    assert got["ids"] == ids.tolist()  # vLLM expands the image as the processor does
    assert got["experts_sent"] == 4 * EXPERTS * 3  # per expert: gate, up, down
    before, after = torch.tensor(got["before"]), torch.tensor(got["after"])
    assert (before - refs["export"]).abs().max() < 1e-4
    assert (after - refs["perturbed"]).abs().max() < 1e-4
    assert (after - refs["export"]).abs().max() > 1e-2  # the sync did change the weights
