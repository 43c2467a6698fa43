"""trainer.nan_policy at the engine: a NaN loss on any rank never reaches the weights.

Two gloo ranks at TP=2 run ``MegatronEngine.train_step`` with a loss that is NaN on rank 1
only; the all-reduced check makes both ranks skip (or both raise) together. At DP=2 (each rank
the whole model, gradients all-reduced by DDP) each rank's own check reaches the same verdict.
"""

import pytest
import torch

from rlhf_megatron.platform.multiproc import run_on_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rlhf_megatron.models.tiny import make_tiny_hf_model

    return str(
        make_tiny_hf_model(
            tmp_path_factory.mktemp("tiny"),
            "llama",
            num_layers=2,
            hidden_size=128,
            num_heads=2,
            num_kv_heads=2,
            ffn_hidden_size=256,
        )
    )


def _nan_step(rank, world, model, tp):
    from rlhf_megatron.config.schema import MegatronConfig, OptimConfig
    from rlhf_megatron.data.batch import Batch
    from rlhf_megatron.models.builder import ParallelConfig
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import init_model_parallel
    from rlhf_megatron.workers.megatron_engine import (
        MegatronEngine,
        NonFiniteGradientError,
        split_micro_batches,
    )

    init_model_parallel(tp, 1, seed=1)
    arch = ModelArch.from_hf_dir(model)
    engine = MegatronEngine(
        arch,
        ParallelConfig(tp),
        model,
        MegatronConfig(
            params_dtype="float32", tensor_model_parallel_size=tp, use_distributed_optimizer=False
        ),
        OptimConfig(lr=1e-3),
        total_steps=10,
    )
    ids = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    batch = Batch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(12).expand(4, -1),
        }
    )
    micros = split_micro_batches(batch, ("input_ids", "attention_mask", "position_ids"), 2)

    def loss(poison):
        def fn(logits, micro):
            value = logits.float().pow(2).mean() * micro["_weight"]
            return (value * float("nan") if poison else value), {}

        return fn

    def params():
        return torch.cat([p.detach().flatten().clone() for p in engine.chunks[0].parameters()])

    before, lr_steps = params(), engine.scheduler.num_steps
    skipped = engine.train_step(micros, loss(rank == 1), "skip", f"[actor] rank {rank} step 1")
    after_skip = params()
    try:
        engine.train_step(micros, loss(rank == 1), "stop", f"[actor] rank {rank} step 2")
        stop_error = None
    except NonFiniteGradientError as e:
        stop_error = str(e)
    after_stop = params()
    lr_steps_after_skips = engine.scheduler.num_steps - lr_steps
    good = engine.train_step(micros, loss(False), "stop", f"[actor] rank {rank} step 3")
    return {
        "replicated": engine.grads_replicated,
        "skipped": skipped["nan_skipped"],
        "update_ok": skipped["update_ok"],
        "unchanged_after_skip": torch.equal(before, after_skip),
        "unchanged_after_stop": torch.equal(before, after_stop),
        "lr_steps_after_skips": lr_steps_after_skips,
        "stop_error": stop_error,
        "good_step_changed": not torch.equal(before, params()),
        "good_ok": good["update_ok"],
    }


@pytest.mark.parametrize("tp", [2, 1])
def test_nan_on_one_rank_skips_or_stops_on_every_rank_and_leaves_weights(tiny, tp):
    results = run_on_ranks(_nan_step, 2, tiny, tp, timeout_s=300)
    for rank, r in enumerate(results):
        assert r["replicated"] == (tp == 1)
        assert r["skipped"] and not r["update_ok"], r
        assert r["unchanged_after_skip"] and r["unchanged_after_stop"], "weights changed by a NaN step"
        assert r["lr_steps_after_skips"] == 0, "the LR schedule advanced on a skipped step"
        assert r["stop_error"] and f"[actor] rank {rank} step 2" in r["stop_error"], r["stop_error"]
        # TP's backward all-reduce (DP's gradient all-reduce) spreads rank 1's NaN to rank 0's
        # grads; rank 1 is always named.
        assert "1] of this role" in r["stop_error"] and "NaN" in r["stop_error"]
        assert r["good_step_changed"] and r["good_ok"], "a finite step after the skips must train"
