"""Data parallelism in MegatronEngine: DP=2 on half batches steps exactly like DP=1 on the whole batch.

This is what finalize_model_grads (the DP all-reduce megatron's schedules call after the last
micro-batch) guarantees; without it each DP rank would step on its own half's gradients.
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


def _train(rank, world, model, dist_opt):
    from rlhf_megatron.config.schema import MegatronConfig, OptimConfig
    from rlhf_megatron.data.batch import Batch
    from rlhf_megatron.models.builder import ParallelConfig
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import init_model_parallel
    from rlhf_megatron.workers.megatron_engine import MegatronEngine, split_micro_batches

    info = init_model_parallel(1, 1, seed=1)
    arch = ModelArch.from_hf_dir(model)
    megatron = MegatronConfig(params_dtype="float32", use_distributed_optimizer=dist_opt)
    engine = MegatronEngine(arch, ParallelConfig(), model, megatron, OptimConfig(lr=1e-3), total_steps=10)
    ids = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    full = Batch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(12).expand(4, -1),
        }
    )
    mine = full.chunk(info.dp_size)[info.dp_rank]
    norms = []
    for _ in range(2):
        micros = split_micro_batches(mine, ("input_ids", "attention_mask", "position_ids"), 2)
        result = engine.train_step(micros, lambda out, m: (out.float().pow(2).mean() * m["_weight"], {}))
        norms.append(result["grad_norm"])
    params = torch.cat([p.detach().flatten() for p in engine.chunks[0].parameters()])
    return norms, params


@pytest.mark.parametrize("dist_opt", [False, True])
def test_dp2_half_batches_equal_dp1_whole_batch(tiny, dist_opt):
    ((single_norms, single_params),) = run_on_ranks(_train, 1, tiny, dist_opt, timeout_s=300)
    dp = run_on_ranks(_train, 2, tiny, dist_opt, timeout_s=300)
    for norms, params in dp:
        assert norms == pytest.approx(single_norms, rel=1e-5)
        torch.testing.assert_close(params, single_params, rtol=1e-5, atol=1e-6)


def _train_tp(rank, world, model, sequence_parallel):
    """Two steps of next-token loss at TP=world (the whole batch on every TP rank)."""
    from rlhf_megatron.config.schema import MegatronConfig, OptimConfig
    from rlhf_megatron.data.batch import Batch
    from rlhf_megatron.models.builder import ParallelConfig
    from rlhf_megatron.models.forward import vocab_parallel_log_probs
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import init_model_parallel
    from rlhf_megatron.workers.megatron_engine import MegatronEngine, split_micro_batches

    init_model_parallel(world, 1, seed=1)
    arch = ModelArch.from_hf_dir(model)
    sp = sequence_parallel and world > 1
    megatron = MegatronConfig(params_dtype="float32", tensor_model_parallel_size=world, sequence_parallel=sp)
    engine = MegatronEngine(
        arch,
        ParallelConfig(world, sequence_parallel=sp),
        model,
        megatron,
        OptimConfig(lr=1e-3),
        total_steps=10,
    )
    ids = torch.randint(3, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    batch = Batch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(12).expand(4, -1),
        }
    )

    def loss_fn(logits, micro):
        logp = vocab_parallel_log_probs(logits[:, :-1], micro["input_ids"][:, 1:], arch.vocab_size)
        loss = -logp.mean()
        return loss * micro["_weight"], {"loss": loss.item()}

    norms, losses = [], []
    for _ in range(2):
        micros = split_micro_batches(batch, ("input_ids", "attention_mask", "position_ids"), 2)
        result = engine.train_step(micros, loss_fn)
        norms.append(result["grad_norm"])
        losses.append([m["loss"] for m in result["metrics"]])
    return norms, losses


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_steps_like_tp1_with_the_same_gradient_norm(tiny, sequence_parallel):
    """A model built to be loaded (no megatron initialisation) still counts every TP shard once in
    the gradient norm (models.builder.mark_tensor_parallel_weights), with and without sequence
    parallelism (on CPU through models.norms)."""
    ((single_norms, single_losses),) = run_on_ranks(_train_tp, 1, tiny, False, timeout_s=300)
    for norms, losses in run_on_ranks(_train_tp, 2, tiny, sequence_parallel, timeout_s=300):
        assert norms == pytest.approx(single_norms, rel=1e-5)
        for got, want in zip(losses, single_losses):
            assert got == pytest.approx(want, rel=1e-5)
