"""``convert`` for mixture-of-experts models: HF -> megatron (EP2 x PP2 and TP2 x EP2, and TP2 x PP2
for GLM-4.5 and DeepSeek-V3) -> HF.

For Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5 and DeepSeek-V3 (multi-latent attention): the round
trip is bit-exact (the score-correction bias buffer, and its next-token-prediction layer, which is not trained but kept
in the checkpoint's ``mtp_layers/`` and written back as stored, included), every expert tensor is in
the export exactly once (over several safetensors shards), the export loads in transformers
with the original logits (also when the checkpoint has no config.json and one is rebuilt from
the arch), and a distributed checkpoint saved at one expert-parallel size loads at others
(megatron reshards the experts) with transformers' logits.

Process starts dominate on CPU: the fourteen ``hf-to-mcore`` runs go through the command line on
4 already-started ranks (its torchrun path), followed by the reloads at other layouts in the
same processes; the exports share one fresh process.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from rlhf_megatron.convert import main
from rlhf_megatron.models.checkpoint import CKPT_METADATA_FILE
from rlhf_megatron.models.mtp import MTP_DIR
from rlhf_megatron.platform.multiproc import run_on_ranks

from . import tiny_moe
from .test_convert_ckpt import _export_in_subprocess, _hf_state

LAYOUTS = {"ep2pp2": ["--ep", "2", "--pp", "2"], "tp2ep2": ["--tp", "2", "--ep", "2"]}
DENSE_LAYOUT = {"tp2pp2": ["--tp", "2", "--pp", "2"]}
"""GLM-4.5 and DeepSeek-V3 also round-trip at TP2 x PP2: their attention (MLA's low-rank
projections and norms, GLM's partial-rotary heads with biases) split by TP across stages, the
experts whole on each rank."""


def _layouts(family: str) -> dict[str, list[str]]:
    return {**LAYOUTS, **DENSE_LAYOUT} if family in tiny_moe.SIGMOID_ROUTED else LAYOUTS


ROUND_TRIPS = [(family, layout) for family in tiny_moe.FAMILIES for layout in _layouts(family)]


RELOAD_LAYOUTS = [(1, 1, 1), (1, 1, 4), (2, 2, 1)]  # (tp, pp, ep); saved at EP2 x PP2 and TP2 x EP2
NEW_FAMILY_RELOADS = {"ep2pp2": [(2, 2, 1)]}
"""GLM-4.5 and DeepSeek-V3 share the reload path of the others (and its time is what this module
costs): one checkpoint, reloaded at a layout that changes every parallelism it was saved with."""


def _reload_layouts(family: str, layout: str) -> list[tuple[int, int, int]]:
    if family in tiny_moe.SIGMOID_ROUTED:
        return NEW_FAMILY_RELOADS.get(layout, [])
    return RELOAD_LAYOUTS


def _convert_and_reload(rank, world_size, jobs, reloads):
    """Every ``hf-to-mcore`` command on these ranks, then each checkpoint loaded at other layouts."""
    for argv in jobs:
        if main(argv) != 0:
            raise RuntimeError(f"convert {argv} failed on rank {rank}")
    return _load_and_forward(reloads)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_convert")
    out, jobs, exports, reloads = {}, [], [], []
    for family in tiny_moe.FAMILIES:
        hf = tiny_moe.make_model_dir(root, family)
        if family == "glm4_moe":  # as GLM-4.5 ships: one next-token-prediction layer
            tiny_moe.add_mtp_layer(hf)
        model = tiny_moe.load_hf(hf)
        batch = tiny_moe.padded_batch(model.config.vocab_size)
        out[family] = {"hf": hf, "batch": batch, "ref": tiny_moe.hf_outputs(model, *batch)[0]}
        for layout, flags in _layouts(family).items():
            ckpt, export = root / f"{family}-{layout}", root / f"{family}-{layout}-hf"
            jobs.append(["hf-to-mcore", "--hf", str(hf), "--out", str(ckpt), *flags])
            exports.append(
                ["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(export), "--max-shard-size", "300KB"]
            )
            out[family][layout] = (ckpt, export)
            reloads.append((family, str(ckpt), batch, _reload_layouts(family, layout)))
    ranks = run_on_ranks(_convert_and_reload, 4, jobs, reloads, timeout_s=1200)
    out["reloaded"] = [row for rows in ranks for row in rows]
    # Qwen2-MoE's checkpoint without its config.json: the export writes one from the arch.
    if "qwen2_moe" in out:  # (absent when a run narrows tiny_moe.FAMILIES)
        bare = root / "qwen2_moe-bare"
        shutil.copytree(out["qwen2_moe"]["ep2pp2"][0], bare)
        (bare / "config.json").unlink()
        exports.append(["mcore-to-hf", "--ckpt", str(bare), "--out", str(root / "bare-hf"), "--no-verify"])
        out["bare"] = root / "bare-hf"
    proc = _export_in_subprocess(*[[*e, "--no-progress"] for e in exports])
    assert proc.returncode == 0, proc.stderr
    return out


def _expert_keys(family: str) -> set[str]:
    block, projs = (
        ("block_sparse_moe", ("w1", "w2", "w3"))
        if family == "mixtral"
        else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    sparse = [i for i in range(2) if i not in tiny_moe.FAMILIES[family].get("mlp_only_layers", ())]
    experts = tiny_moe.FAMILIES[family]["num_experts"]
    return {
        f"model.layers.{i}.{block}.experts.{e}.{p}.weight"
        for i in sparse
        for e in range(experts)
        for p in projs
    }


@pytest.mark.slow
@pytest.mark.parametrize(("family", "layout"), ROUND_TRIPS)
def test_round_trip_is_bit_exact_with_each_expert_once(converted, family, layout):
    case = converted[family]
    ckpt, export = case[layout]
    original, exported = _hf_state(case["hf"]), _hf_state(export)
    assert set(exported) == set(original)
    for name, t in original.items():
        assert torch.equal(exported[name], t), name
    per_file = [set(safe_open(str(f), "pt").keys()) for f in sorted(export.glob("*.safetensors"))]
    assert len(per_file) > 1 and sum(map(len, per_file)) == len(set().union(*per_file))  # no key twice
    assert _expert_keys(family) <= set(exported)
    assert len([n for n in exported if ".experts." in n]) == len(_expert_keys(family))
    meta = json.loads((ckpt / CKPT_METADATA_FILE).read_text())
    expected_ep = 1 if layout in DENSE_LAYOUT else 2
    assert meta["expert_model_parallel_size"] == expected_ep and meta["arch"]["moe"]["top_k"] == 2
    mtp = {n for n in original if n.startswith("model.layers.2.")}  # past num_hidden_layers = 2
    assert bool(mtp) == (family == "glm4_moe")
    assert (ckpt / MTP_DIR).is_dir() == bool(mtp)
    if mtp:
        assert any(f.startswith(f"{MTP_DIR}/") for f in meta["files"])  # hashed with the rest
        bias = {n for n in original if n.endswith("e_score_correction_bias")}
        assert bias == {"model.layers.1.mlp.gate.e_score_correction_bias", *(mtp & bias)}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(tiny_moe.FAMILIES))
def test_export_loads_in_transformers_with_the_same_logits(converted, family):
    case = converted[family]
    model = tiny_moe.load_hf(case["tp2ep2"][1])
    assert torch.equal(tiny_moe.hf_outputs(model, *case["batch"])[0], case["ref"])
    if family == "qwen2_moe":  # config.json rebuilt from the arch: shared expert, dense layer 1
        rebuilt = tiny_moe.load_hf(converted["bare"])
        assert rebuilt.config.mlp_only_layers == [1] and rebuilt.config.shared_expert_intermediate_size == 96
        assert torch.equal(tiny_moe.hf_outputs(rebuilt, *case["batch"])[0], case["ref"])


def _load_and_forward(reloads):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.checkpoint import load_model_checkpoint, read_checkpoint_metadata
    from rlhf_megatron.models.forward import forward_logits_or_values
    from rlhf_megatron.platform import init_model_parallel

    out = []
    for family, ckpt, batch, layouts in reloads:
        arch = read_checkpoint_metadata(ckpt).arch
        for tp, pp, ep in layouts:
            init_model_parallel(tp, pp, expert_model_parallel_size=ep)
            chunks = build_gpt_model(
                arch, ParallelConfig(tp, pp, expert_model_parallel_size=ep), init_weights=False
            )
            load_model_checkpoint(chunks, ckpt)
            logits = forward_logits_or_values(chunks, *batch)
            if logits is not None:
                full = gather_from_tensor_model_parallel_region(logits)[..., : arch.vocab_size]
                out.append((family, ckpt, (tp, pp, ep), full.numpy()))
    return out


@pytest.mark.slow
def test_checkpoint_saved_at_one_ep_loads_at_others(converted):
    seen = set()
    for family, ckpt, layout, array in converted["reloaded"]:
        ref, valid = converted[family]["ref"], converted[family]["batch"][1].bool()
        rel = ((torch.from_numpy(array) - ref).abs()[valid].max() / ref[valid].abs().max()).item()
        assert rel <= 1e-5, (family, ckpt, layout, rel)
        seen.add((ckpt, layout))
    expected = {
        (str(converted[f][saved][0]), layout)
        for f in tiny_moe.FAMILIES
        for saved in LAYOUTS
        for layout in _reload_layouts(f, saved)
    }
    assert seen == expected
