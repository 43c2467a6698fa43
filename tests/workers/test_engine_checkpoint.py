"""MegatronEngine checkpoint round trip: a restored engine takes exactly the step the original takes.

Covers the plain and the distributed optimizer (the latter stores fp32 main params and Adam moments
in bucket shards outside state_dict(), and megatron-core 0.16 without apex shares one Adam step
counter across parameters on load, which the engine undoes), saved after two steps or before any.
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


def _round_trip(rank, world, model, tmp, dist_opt, steps_before_save):
    from rlhf_megatron.config.schema import MegatronConfig, OptimConfig
    from rlhf_megatron.data.batch import Batch
    from rlhf_megatron.models.builder import ParallelConfig
    from rlhf_megatron.models.checkpoint import load_model_checkpoint, save_model_checkpoint
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import init_model_parallel
    from rlhf_megatron.workers.megatron_engine import MegatronEngine, split_micro_batches

    init_model_parallel(2, 1, seed=1)
    arch = ModelArch.from_hf_dir(model)

    def build():
        megatron = MegatronConfig(params_dtype="float32", use_distributed_optimizer=dist_opt)
        return MegatronEngine(arch, ParallelConfig(2), model, megatron, OptimConfig(lr=1e-3), total_steps=10)

    ids = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    batch = Batch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(12).expand(4, -1),
        }
    )

    def step(engine):
        micros = split_micro_batches(batch, ("input_ids", "attention_mask", "position_ids"), 2)
        return engine.train_step(
            micros, lambda logits, micro: (logits.float().pow(2).mean() * micro["_weight"], {})
        )

    def params(engine):
        return torch.cat([p.detach().flatten().clone() for p in engine.chunks[0].parameters()])

    original = build()
    for _ in range(steps_before_save):
        step(original)
    save_model_checkpoint(original.chunks, f"{tmp}/model", arch, ParallelConfig(2))
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    results_queue = type(filesystem_async._results_queue)
    torch.save(original.state_for_checkpoint(), f"{tmp}/state{rank}.pt")
    step(original)
    restored = build()
    load_model_checkpoint(restored.chunks, f"{tmp}/model")
    restored.load_checkpoint_state(torch.load(f"{tmp}/state{rank}.pt", weights_only=False))
    step(restored)
    diff = (params(original) - params(restored)).abs().max().item()
    return diff, f"{results_queue.__module__}.{results_queue.__name__}"


@pytest.mark.parametrize("steps_before_save", [2, 0], ids=["stepped", "never-stepped"])
@pytest.mark.parametrize("dist_opt", [False, True], ids=["plain-opt", "dist-opt"])
def test_restored_engine_steps_exactly_like_the_original(tiny, tmp_path, dist_opt, steps_before_save):
    """``never-stepped``: saved before any optimizer step (every update skipped under
    nan_policy=skip, or critic_warmup), which megatron-core's distributed optimizer cannot
    serialise by itself. The writer's results came back through an in-process queue, not the
    spawned manager megatron would start on a process's first save (~3 s)."""
    result = run_on_ranks(_round_trip, 2, tiny, str(tmp_path), dist_opt, steps_before_save, timeout_s=300)
    assert result == [(0.0, "queue.Queue"), (0.0, "queue.Queue")]
