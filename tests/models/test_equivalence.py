"""megatron-core models loaded from HF checkpoints compute what transformers computes.

Real megatron-core on 4 gloo ranks; one process start per test, several
layouts inside it (parallel state is re-initialised between layouts). Logits
are compared on the valid (non-padding) positions of a left-padded batch, in
fp32: relative error = max |mcore - hf| / max |hf|.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.platform.multiproc import run_on_ranks

from . import tiny_hf

REL_TOL = 1e-4
LOGP_TOL = 1e-4


def _run_cases(rank, world_size, cases):
    """For each case and layout: logits / log-prob / entropy errors on output ranks."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from rlhf_megatron.models import ModelArch
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.forward import (
        forward_logits_or_values,
        vocab_parallel_entropy,
        vocab_parallel_log_probs,
    )
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.platform import init_model_parallel

    results = []
    for case in cases:
        arch = ModelArch.from_hf_dir(case["hf_dir"], head=case.get("head"))
        ids, mask, pos = case["batch"]
        ref = case["ref"]
        valid = mask.bool()
        for tp, pp, vpp in case["layouts"]:
            info = init_model_parallel(tp, pp, vpp)
            chunks = build_gpt_model(arch, ParallelConfig(tp, pp, vpp), init_weights=False)
            report = load_hf_weights(chunks, case["hf_dir"], arch)
            window = None if case.get("drop_window") else arch.sliding_window
            out = forward_logits_or_values(chunks, ids, mask, pos, sliding_window=window)
            row = {
                "name": case["name"],
                "layout": (tp, pp, vpp),
                "info": info,
                "kept": report.kept_initialised,
            }
            if out is not None:
                if arch.head == "lm":
                    full = gather_from_tensor_model_parallel_region(out)[..., : arch.vocab_size]
                    # log p(token t+1 | prefix) on pairs of valid positions
                    pair = valid[:, :-1] & valid[:, 1:]
                    logp = vocab_parallel_log_probs(out[:, :-1], ids[:, 1:], arch.vocab_size)
                    ref_logp = torch.log_softmax(ref[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
                    ent = vocab_parallel_entropy(out, arch.vocab_size)
                    ref_p = torch.softmax(ref, -1)
                    ref_ent = -(ref_p * torch.log_softmax(ref, -1)).sum(-1)
                    row["logp_err"] = (logp - ref_logp).abs()[pair].max().item()
                    row["ent_err"] = (ent - ref_ent).abs()[valid].max().item()
                else:
                    full = out  # [B, S] values
                row["shape"] = tuple(out.shape)
                if ref is None:
                    results.append(row)
                    continue
                row["rel_err"] = ((full - ref).abs()[valid].max() / ref[valid].abs().max()).item()
            results.append(row)
    return results


def _case(tmp_path, family, layouts, max_shard_size="200KB", **extra):
    model = tiny_hf.make_hf_model(family)
    hf_dir = tiny_hf.save_hf_model(model, tmp_path / family, max_shard_size=max_shard_size)
    batch = tiny_hf.padded_batch()
    return {
        "name": family,
        "hf_dir": str(hf_dir),
        "batch": batch,
        "ref": tiny_hf.hf_logits(model, *batch),
        "layouts": layouts,
        **extra,
    }, model


def _errors(results, name):
    """{layout: [rows of output ranks]} for one case; checks the tolerances."""
    by_layout: dict = {}
    for r in results:
        if r["name"] == name and "shape" in r:
            by_layout.setdefault(r["layout"], []).append(r)
    for layout, rows in by_layout.items():
        for r in rows:
            if "rel_err" in r:
                assert r["rel_err"] <= REL_TOL, (name, layout, r["rel_err"])
            if "logp_err" in r:
                assert r["logp_err"] <= LOGP_TOL, (name, layout, r["logp_err"])
                assert r["ent_err"] <= LOGP_TOL, (name, layout, r["ent_err"])
    return by_layout


ALL_LAYOUTS = [(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None)]


def _critic_case(tmp_path, qwen2, model):
    """A critic checkpoint in HF's token-classification layout (num_labels=1): the LM's
    body plus a random score head (weight and bias)."""
    from transformers import AutoModelForTokenClassification

    config = tiny_hf.hf_config("qwen2", num_labels=1)
    config._attn_implementation = "eager"
    critic = AutoModelForTokenClassification.from_config(config).eval()
    critic.model.load_state_dict(model.model.state_dict())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        critic.score.weight.copy_(torch.randn(critic.score.weight.shape, generator=g))
        critic.score.bias.fill_(0.25)
    critic_dir = tmp_path / "qwen2-critic"
    critic.save_pretrained(critic_dir, safe_serialization=True)
    ids, mask, pos = qwen2["batch"]
    with torch.no_grad():
        values = critic(input_ids=ids, attention_mask=mask, position_ids=pos).logits[..., 0]
    return {
        **qwen2,
        "name": "qwen2-critic",
        "hf_dir": str(critic_dir),
        "ref": values,
        "layouts": [(1, 1, None), (2, 2, None)],
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case below in ONE 4-rank run: process start-up dominates on CPU."""
    tmp_path = tmp_path_factory.mktemp("equivalence")
    llama, _ = _case(tmp_path, "llama", ALL_LAYOUTS + [(1, 2, 2)])
    mistral, _ = _case(tmp_path, "mistral", [(1, 1, None), (2, 2, None)], max_shard_size=None)
    qwen2, qwen2_model = _case(tmp_path, "qwen2", ALL_LAYOUTS)
    qwen3, _ = _case(tmp_path, "qwen3", ALL_LAYOUTS)
    cases = [
        llama,
        mistral,
        # Negative control: the same Mistral without its sliding window must differ.
        {**mistral, "name": "mistral-no-window", "layouts": [(1, 1, None)], "drop_window": True},
        qwen2,
        _critic_case(tmp_path, qwen2, qwen2_model),
        # A critic started from the LM checkpoint: body loaded, head left at its init.
        {**qwen2, "name": "qwen2-critic-from-lm", "head": "value", "ref": None, "layouts": [(2, 1, None)]},
        qwen3,
    ]
    return [row for rank_rows in run_on_ranks(_run_cases, 4, cases, timeout_s=600) for row in rank_rows]


@pytest.mark.slow
def test_llama_gqa_llama3_rope_scaling_matches_transformers(results):
    by_layout = _errors(results, "llama")
    assert set(by_layout) == set(ALL_LAYOUTS + [(1, 2, 2)])  # incl. PP=2 with 2 virtual stages
    # TP=2: each rank returns its vocabulary shard (512 padded rows / 2).
    assert {r["shape"] for r in by_layout[(2, 2, None)]} == {(4, 12, 256)}


@pytest.mark.slow
def test_mistral_sliding_window_matches_transformers(results):
    assert set(_errors(results, "mistral")) == {(1, 1, None), (2, 2, None)}
    no_window = [r for r in results if r["name"] == "mistral-no-window" and "shape" in r]
    assert no_window and all(r["rel_err"] > 1e-2 for r in no_window), no_window


@pytest.mark.slow
def test_qwen2_qkv_bias_tied_embeddings_match_transformers(results):
    assert set(_errors(results, "qwen2")) == set(ALL_LAYOUTS)


@pytest.mark.slow
def test_qwen2_critic_values_match_transformers_token_classification(results):
    by_layout = _errors(results, "qwen2-critic")
    assert set(by_layout) == {(1, 1, None), (2, 2, None)}
    assert {r["shape"] for r in by_layout[(2, 2, None)]} == {(4, 12)}  # [B, S], same on both TP ranks
    from_lm = [r for r in results if r["name"] == "qwen2-critic-from-lm"]
    on_last_stage = [r for r in from_lm if r["info"].pp_rank == r["info"].pp_size - 1]
    assert on_last_stage and all(
        r["kept"] == ["output_layer.weight", "output_layer.bias"] for r in on_last_stage
    )
    assert {r["shape"] for r in from_lm if "shape" in r} == {(4, 12)}


@pytest.mark.slow
def test_qwen3_qk_norm_and_head_dim_match_transformers(results):
    assert set(_errors(results, "qwen3")) == set(ALL_LAYOUTS)
