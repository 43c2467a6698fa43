"""DeepSeek-V3's aux-loss-free balancing through ``megatron.moe_router_bias_update`` on a real
megatron-core tiny DeepSeek-V3 (one rank, gloo).

The key reaches megatron's ``TransformerConfig`` (``moe_router_bias_update_rate``) of a trained
engine: by default (null, the family carries the bias) at the configured rate, with false at 0, and
never for a frozen engine. One training step then moves each sparse layer's ``router.expert_bias``
exactly as DeepSeek-V3 prescribes, ``bias + rate x sign(mean load - expert load)``, the loads
counted by ``ExpertLoadRecorder`` over the same step; with false the bias stays at the
checkpoint's values.
"""

import pytest
import torch

from rlhf_megatron.platform.multiproc import run_on_ranks

pytestmark = pytest.mark.slow

RATE = 0.01


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rlhf_megatron.models.tiny import make_tiny_moe_model

    return str(
        make_tiny_moe_model(
            tmp_path_factory.mktemp("tiny_ds"),
            "deepseek_v3",
            num_experts=4,
            mlp_only_layers=(0,),
            hidden_size=128,
            num_heads=2,
        )
    )


def _config(engine):
    inner = engine.chunks[0]
    while hasattr(inner, "module"):
        inner = inner.module
    return inner.config


def _biases(engine) -> dict[str, torch.Tensor]:
    return {
        name: buf.detach().clone()
        for name, buf in engine.chunks[0].named_buffers()
        if name.endswith("router.expert_bias")
    }


def _cases(rank, world, model):
    from rlhf_megatron.config.schema import MegatronConfig, OptimConfig
    from rlhf_megatron.data.batch import Batch
    from rlhf_megatron.models.builder import ParallelConfig
    from rlhf_megatron.models.moe import ExpertLoadRecorder
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import init_model_parallel
    from rlhf_megatron.workers.megatron_engine import MegatronEngine, split_micro_batches

    init_model_parallel(1, 1, seed=1)
    arch = ModelArch.from_hf_dir(model)
    ids = torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    batch = Batch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(16).expand(4, -1),
        }
    )
    out = {}
    for update in (None, False):
        megatron = MegatronConfig(
            params_dtype="float32",
            use_distributed_optimizer=False,
            moe_router_bias_update=update,
            moe_router_bias_update_rate=RATE,
        )
        engine = MegatronEngine(arch, ParallelConfig(), model, megatron, OptimConfig(lr=1e-3), total_steps=4)
        config = _config(engine)
        before = _biases(engine)
        micros = split_micro_batches(batch, ("input_ids", "attention_mask", "position_ids"), 2)
        with ExpertLoadRecorder(engine.chunks) as load:
            engine.train_step(
                micros, lambda logits, micro: (logits.float().pow(2).mean() * micro["_weight"], {})
            )
        after = _biases(engine)
        expected = {}
        for name, bias in before.items():
            layer = int(name.split("layers.")[1].split(".")[0])
            counts = load.counts[layer].float()
            expected[name] = bias + RATE * torch.sign(counts.mean() - counts)
        out[update] = {
            "enable": config.moe_router_enable_expert_bias,
            "rate": config.moe_router_bias_update_rate,
            "layers": sorted(before),
            "moved": max((after[n] - before[n]).abs().max().item() for n in before),
            "err": max((after[n] - expected[n]).abs().max().item() for n in before),
        }
    frozen = MegatronEngine(arch, ParallelConfig(), model, MegatronConfig(params_dtype="float32"), None)
    out["frozen_rate"] = _config(frozen).moe_router_bias_update_rate
    return out


def test_the_bias_update_key_reaches_megatron_and_moves_the_bias_by_the_load(tiny):
    [r] = run_on_ranks(_cases, 1, tiny, timeout_s=300)
    on, off = r[None], r[False]
    assert [n.partition("decoder.")[2] for n in on["layers"]] == [
        "layers.1.mlp.router.expert_bias"
    ]  # 0 is dense
    assert on["enable"] and on["rate"] == RATE
    assert on["moved"] == pytest.approx(RATE) and on["err"] < 1e-7, on
    assert off["enable"] and off["rate"] == 0.0 and off["moved"] == 0.0, off
    assert r["frozen_rate"] == 0.0
