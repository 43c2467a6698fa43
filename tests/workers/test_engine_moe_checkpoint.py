"""MegatronEngine checkpoint round trip for a mixture-of-experts model at expert parallelism 2.

megatron's DDP keeps the experts in their own gradient buffers and ``get_megatron_optimizer``
gives them their own (expert-data-parallel) optimizer in a chained optimizer; with the
distributed optimizer the experts' Adam state is sharded over the expert-data-parallel
group. A restored engine (model through dist-checkpointing, optimizer and scheduler per
rank) takes exactly the step the original takes, with the plain and the distributed
optimizer, in one 2-rank process start.
"""

import pytest
import torch

from rlhf_megatron.platform.multiproc import run_on_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rlhf_megatron.models.tiny import make_tiny_moe_model

    return str(make_tiny_moe_model(tmp_path_factory.mktemp("tiny_moe"), "qwen2_moe", mlp_only_layers=(1,)))


def _round_trip(rank, world, model, tmp):
    from rlhf_megatron.config.schema import MegatronConfig, OptimConfig
    from rlhf_megatron.data.batch import Batch
    from rlhf_megatron.models.builder import ParallelConfig
    from rlhf_megatron.models.checkpoint import load_model_checkpoint, save_model_checkpoint
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import init_model_parallel
    from rlhf_megatron.workers.megatron_engine import MegatronEngine, split_micro_batches

    init_model_parallel(1, 1, seed=1, expert_model_parallel_size=2)
    arch = ModelArch.from_hf_dir(model)
    parallel = ParallelConfig(expert_model_parallel_size=2)
    ids = torch.randint(3, 100, (4, 12), generator=torch.Generator().manual_seed(rank))
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

    out = {}
    for dist_opt in (False, True):
        megatron = MegatronConfig(
            params_dtype="float32", use_distributed_optimizer=dist_opt, expert_model_parallel_size=2
        )

        def build(megatron=megatron):
            return MegatronEngine(arch, parallel, model, megatron, OptimConfig(lr=1e-3), total_steps=10)

        original = build()
        steps = [step(original) for _ in range(2)]
        root = f"{tmp}/{'dist' if dist_opt else 'plain'}"
        save_model_checkpoint(original.chunks, f"{root}/model", arch, parallel)
        torch.save(original.state_for_checkpoint(), f"{root}/state{rank}.pt")
        step(original)
        restored = build()
        load_model_checkpoint(restored.chunks, f"{root}/model")
        restored.load_checkpoint_state(torch.load(f"{root}/state{rank}.pt", weights_only=False))
        step(restored)
        out[dist_opt] = {
            "diff": (params(original) - params(restored)).abs().max().item(),
            "optimizers": len(original._sub_optimizers()),
            "expert_buffers": len(original.chunks[0].expert_parallel_buffers),
            "aux": steps[0]["moe_aux_loss"],
        }
    return out


def test_ep2_engine_restores_and_steps_exactly_like_the_original(tiny, tmp_path):
    results = run_on_ranks(_round_trip, 2, tiny, str(tmp_path), timeout_s=300)
    for rank, out in enumerate(results):
        for dist_opt, r in out.items():
            assert r["diff"] == 0.0, (rank, dist_opt, r["diff"])
            # Dense and expert parameters: two DDP buffer groups, two optimizers in the chain.
            assert r["expert_buffers"] == 1 and r["optimizers"] == 2, (rank, dist_opt, r)
            assert list(r["aux"]) == [0] and r["aux"][0] > 0  # layer 0 is sparse, layer 1 dense
