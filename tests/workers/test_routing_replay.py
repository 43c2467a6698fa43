"""Routing replay (R2/R3) on a real megatron-core Qwen3-MoE and DeepSeek-V3 at expert parallelism 2
(gloo). DeepSeek-V3's router is the other kind megatron-core has: sigmoid scores with the
score-correction bias in the selection only, group-limited top-k and the routed scaling factor,
behind multi-latent attention.

One 2-rank process start; each rank has its own left/right-padded rows. The engine records
the routers' choices in a forward pass (micro-batches of 2, padding trimmed per
micro-batch), then:

- the recorded routes are well formed: every real token has ``k`` distinct experts in each
  sparse layer, and the dense layer has none;
- replaying them with another micro-batch split (other trimmed widths, so the per-column
  mapping is exercised) gives the natural pass's log-probs;
- replaying *altered* routes (every expert shifted by one) moves the log-probs, and the
  routers' own output (``ExpertLoadRecorder``, from the routing map megatron dispatches
  with) counts exactly the replayed experts;
- a training step under the altered routes has the loss of the replayed forward pass, and
  still updates the router (gradients flow through the replayed selection).
"""

import pytest
import torch

from rlhf_megatron.platform.multiproc import run_on_ranks

pytestmark = pytest.mark.slow


FAMILIES = {  # family -> (its tiny model's options, (sparse layer, dense layer))
    "qwen3_moe": (dict(mlp_only_layers=(1,)), (0, 1)),
    "deepseek_v3": (dict(mlp_only_layers=(0,), groups=(2, 1)), (1, 0)),  # first_k_dense_replace 1
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    from rlhf_megatron.models.tiny import make_tiny_moe_model

    options, layers = FAMILIES[request.param]
    out = tmp_path_factory.mktemp(request.param)
    return str(make_tiny_moe_model(out, request.param, **options)), layers


def _batch(rank: int):
    from rlhf_megatron.data.batch import Batch

    g = torch.Generator().manual_seed(rank)
    rows, width = 6, 14
    ids = torch.randint(3, 100, (rows, width), generator=g)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for r in range(rows):  # left padding of 0..5, right padding of 0..3
        left, right = r, (rows - r) % 4
        mask[r, left : width - right] = 1
    ids = ids * mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return Batch.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": positions})


def _log_probs(engine, batch, micro_size, keys):
    """Per-row next-token log-probs [B, S] (0 where the model saw no column), forward only."""
    from rlhf_megatron.workers.megatron_engine import split_micro_batches

    width = batch["input_ids"].shape[1]

    def fn(logits, micro):
        left, right, _ = micro["_columns"].tolist() if "_columns" in micro else (0, width, width)
        lp = torch.log_softmax(logits.float(), -1)[:, :-1]
        per = lp.gather(-1, micro["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
        full = torch.zeros(per.shape[0], width)
        full[:, left + 1 : right] = per
        return logits.new_zeros(()), {"lp": full, "_rows": micro["_rows"]}

    out = engine.run(split_micro_batches(batch, keys, micro_size), fn, forward_only=True)
    rows = torch.cat([o["_rows"] for o in out])
    return torch.cat([o["lp"] for o in out])[torch.argsort(rows)]


def _replay_cases(rank, world, model, layers):
    from rlhf_megatron.config.schema import MegatronConfig, OptimConfig
    from rlhf_megatron.data.batch import Batch
    from rlhf_megatron.models.builder import ParallelConfig
    from rlhf_megatron.models.moe import ExpertLoadRecorder
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import init_model_parallel
    from rlhf_megatron.workers.megatron_engine import MODEL_KEYS, MegatronEngine, split_micro_batches

    init_model_parallel(1, 1, seed=1, expert_model_parallel_size=2)
    arch = ModelArch.from_hf_dir(model)
    megatron = MegatronConfig(
        params_dtype="float32", use_distributed_optimizer=False, expert_model_parallel_size=2
    )
    engine = MegatronEngine(
        arch,
        ParallelConfig(expert_model_parallel_size=2),
        model,
        megatron,
        OptimConfig(lr=1e-2),
        total_steps=10,
        routing_replay=True,
    )
    batch = _batch(rank)
    valid = batch["attention_mask"].bool()
    experts, k = arch.moe.num_experts, arch.moe.top_k

    engine.routing.recording = True
    natural = _log_probs(engine, batch, 2, MODEL_KEYS)
    routes = engine.routing.take_recorded(len(batch))
    engine.routing.recording = False
    sparse_layer, dense_layer = layers
    sparse = routes[:, :, sparse_layer][valid]  # [tokens, k]
    well_formed = bool(
        (sparse >= 0).all()
        and (sparse < experts).all()
        and all(len(set(t.tolist())) == k for t in sparse)
        and (routes[:, :, dense_layer] == -1).all()
    )

    keys = (*MODEL_KEYS, "routed_experts")
    replayed = _log_probs(engine, batch.union(Batch.from_dict({"routed_experts": routes})), 3, keys)
    altered = torch.where(routes >= 0, (routes + 1) % experts, routes)
    with_altered = batch.union(Batch.from_dict({"routed_experts": altered}))
    with ExpertLoadRecorder(engine.chunks) as load:
        shifted = _log_probs(engine, with_altered, 3, keys)
    expected_counts = torch.bincount(altered[:, :, sparse_layer][valid].flatten().long(), minlength=experts)

    # Training under the altered routes: the loss is the replayed forward's, the router learns.
    def loss_fn(logits, micro):
        lp = torch.log_softmax(logits.float(), -1)[:, :-1]
        per = lp.gather(-1, micro["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
        m = micro["attention_mask"][:, 1:].float() * micro["attention_mask"][:, :-1].float()
        loss = -(per * m).sum() / m.sum()
        return loss * micro["_weight"], {"loss": float(loss)}

    router = next(m for m in engine.chunks[0].modules() if type(m).__name__ == "TopKRouter")
    before = router.weight.detach().clone()
    result = engine.train_step(split_micro_batches(with_altered, keys, 6), loss_fn)
    pair = valid[:, 1:] & valid[:, :-1]
    return {
        "well_formed": well_formed,
        "replay_err": float((replayed - natural)[:, 1:][pair].abs().max()),
        "altered_change": float((shifted - natural)[:, 1:][pair].abs().max()),
        "counts": load.counts[sparse_layer].tolist(),
        "expected_counts": expected_counts.tolist(),
        "train_loss": result["metrics"][0]["loss"],
        "replayed_loss": float(-shifted[:, 1:][pair].mean()),
        "router_moved": float((router.weight.detach() - before).abs().max()),
        "update_ok": result["update_ok"],
    }


def test_recorded_routes_replay_exactly_and_altered_routes_are_obeyed(tiny):
    for rank, r in enumerate(run_on_ranks(_replay_cases, 2, *tiny, timeout_s=300)):
        assert r["well_formed"], (rank, r)
        assert r["replay_err"] < 1e-5, (rank, r)
        assert r["altered_change"] > 1e-3, (rank, r)
        assert r["counts"] == r["expected_counts"], (rank, r)
        assert r["update_ok"] and abs(r["train_loss"] - r["replayed_loss"]) < 1e-5, (rank, r)
        assert r["router_moved"] > 0, (rank, r)
