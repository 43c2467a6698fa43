"""Mixture-of-experts models on megatron-core compute what transformers computes, at any EP layout.

Real megatron-core on 4 gloo ranks, one process start for everything (parallel state is
re-initialised between layouts). For Qwen3-MoE, Qwen2-MoE (shared expert, q/k/v biases, a
dense layer among sparse ones), Mixtral, GLM-4.5 (group-limited sigmoid routing with
score-correction bias, half-rotary heads) and DeepSeek-V3 (the same router, multi-latent attention
with YaRN); the last two's expected expert load comes from the experts transformers' routers
chose, read with a forward hook:

- fp32 logits equal transformers' within 1e-5 relative at EP1, EP2, TP2 x EP2 and EP2 x PP2
  (GLM-4.5 and DeepSeek-V3: EP1 and TP2 x EP2) (plus expert tensor parallelism at EP2 x ETP2 and TP2 x EP2 x ETP1 for Qwen3-MoE), on a
  left-padded batch; the expert load the routers report equals transformers' top-k choices;
- sequence parallelism (TP2 x EP2, TP2 x PP2 x EP2 for Qwen3-MoE) gives the same logits, and a
  training step at TP2 x EP2 with it the same loss and untouched-by-TP weights as EP1;
- a training step (loss with the load-balancing loss, backward, Adam) at EP2 and EP4 gives
  the loss, the gradients and the updated weights of EP1 (the weights wherever Adam's first
  step is well conditioned: its ``g / (|g| + eps)`` turns the rounding of gradients within
  ~1e-7 of zero into updates of either sign), and megatron's tracked load-balancing loss equals
  an independent computation from transformers' router logits (and, for Qwen2-MoE's single
  sparse layer, transformers' own ``aux_loss`` divided by top-k: see ``models/moe.py``).
"""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.platform.multiproc import run_on_ranks

from . import tiny_moe

REL_TOL = 1e-5
FORWARD_LAYOUTS = [(1, 1, 1, None), (1, 1, 2, None), (2, 1, 2, None), (1, 2, 2, None)]  # (tp, pp, ep, etp)
NEW_FAMILY_LAYOUTS = [(1, 1, 1, None), (2, 1, 2, None)]  # GLM-4.5, DeepSeek-V3: TP1 and TP2 x EP2
ETP_LAYOUTS = [(1, 1, 2, 2), (2, 1, 2, 1)]
SP_LAYOUTS = [(2, 1, 2, 1, "sp"), (2, 2, 2, 1, "sp")]  # sequence parallelism (models/norms.py on CPU)
TRAIN_FAMILIES = ("qwen3_moe", "qwen2_moe")
TRAIN_EP = (1, 2, 4)
TRAIN_TP_SP = "tp2ep2sp"  # TP2 x EP2 with sequence parallelism: DP 2, four rows per rank
TP_SPLIT = ("word_embeddings", "output_layer", "self_attention.linear_", "mlp.linear_fc", "shared_experts")
LR, ADAM_EPS = 1e-3, 1e-8  # megatron's default adam_eps


def _layouts(family: str) -> list[tuple]:
    if family in tiny_moe.SIGMOID_ROUTED:
        return NEW_FAMILY_LAYOUTS
    return FORWARD_LAYOUTS + (ETP_LAYOUTS + SP_LAYOUTS if family == "qwen3_moe" else [])


def _forward(case):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from rlhf_megatron.models import ModelArch
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.forward import forward_logits_or_values
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.models.moe import ExpertLoadRecorder
    from rlhf_megatron.platform import init_model_parallel

    arch = ModelArch.from_hf_dir(case["hf_dir"])
    ids, mask, pos = case["batch"]
    rows = []
    for layout in case["layouts"]:
        tp, pp, ep, etp, *sp = layout
        init_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        parallel = ParallelConfig(
            tp, pp, sequence_parallel=bool(sp), expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
        )
        chunks = build_gpt_model(arch, parallel, init_weights=False)
        load_hf_weights(chunks, case["hf_dir"], arch)
        with ExpertLoadRecorder(chunks) as load:
            out = forward_logits_or_values(chunks, ids, mask, pos)
        row = {
            "name": case["name"],
            "layout": layout,
            "load": load.counts,
            "rank": torch.distributed.get_rank(),
        }
        if out is not None:
            full = gather_from_tensor_model_parallel_region(out)[..., : arch.vocab_size]
            ref, valid = case["ref"], mask.bool()
            row["rel_err"] = ((full - ref).abs()[valid].max() / ref[valid].abs().max()).item()
        rows.append(row)
    return rows


def _train(case, rank):
    """One optimizer step per EP size on this DP rank's rows: losses, tracked aux losses, new weights."""
    from rlhf_megatron.config.schema import MegatronConfig, OptimConfig
    from rlhf_megatron.data.batch import Batch
    from rlhf_megatron.models import ModelArch
    from rlhf_megatron.models.builder import ParallelConfig
    from rlhf_megatron.models.forward import vocab_parallel_log_probs
    from rlhf_megatron.models.loader import unwrap_model
    from rlhf_megatron.models.spec import local_to_global_expert
    from rlhf_megatron.platform import init_model_parallel
    from rlhf_megatron.workers.megatron_engine import MegatronEngine, split_micro_batches

    arch = ModelArch.from_hf_dir(case["hf_dir"])
    ids, mask, pos = case["batch"]
    rows = slice(2 * rank, 2 * rank + 2)  # DP = 4 at every EP size: the same rows per rank
    batch = Batch.from_dict({"input_ids": ids[rows], "attention_mask": mask[rows], "position_ids": pos[rows]})

    def loss_fn(logits, micro):
        logp = vocab_parallel_log_probs(logits[:, :-1], micro["input_ids"][:, 1:], arch.vocab_size)
        pair = (micro["attention_mask"][:, :-1] * micro["attention_mask"][:, 1:]).float()
        loss = -(logp * pair).sum() / pair.sum()
        return loss * micro["_weight"], {"loss": loss.item()}

    out = {}
    for key in (*TRAIN_EP, TRAIN_TP_SP):
        tp, ep = (2, 2) if key == TRAIN_TP_SP else (1, key)
        etp = 1  # the experts whole on each EP rank, as on CPU (see test_training_step_at_tp2_ep2_...)
        info = init_model_parallel(
            tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, seed=3
        )
        # The plain optimizer leaves every DP rank the whole reduced gradient to compare.
        megatron = MegatronConfig(
            params_dtype="float32",
            tensor_model_parallel_size=tp,
            sequence_parallel=tp > 1,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            use_distributed_optimizer=False,
        )
        engine = MegatronEngine(
            arch,
            ParallelConfig(
                tp, sequence_parallel=tp > 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
            ),
            case["hf_dir"],
            megatron,
            OptimConfig(lr=LR),
        )
        mine = batch
        if tp > 1:  # DP = 2: this rank's TP group takes the rows of two TP=1 ranks
            dp = rank // tp
            names = ("input_ids", "attention_mask", "position_ids")
            mine = Batch.from_dict({k: v[4 * dp : 4 * dp + 4] for k, v in zip(names, (ids, mask, pos))})
        micros = split_micro_batches(mine, ("input_ids", "attention_mask", "position_ids"), 1)
        result = engine.train_step(micros, loss_fn)
        params = {
            local_to_global_expert(n, arch.moe.num_experts, info.ep_rank, ep): p
            for n, p in unwrap_model(engine.chunks[0]).named_parameters()
        }
        out[key] = {
            "losses": [m["loss"] for m in result["metrics"]],
            "aux": result["moe_aux_loss"],
            "coeff": result["moe_aux_loss_coeff"],
            "update_ok": result["update_ok"],
            "grad_norm": result["grad_norm"],
            "weights": {n: p.detach().clone() for n, p in params.items()},
            "grads": {n: p.main_grad.detach().clone() for n, p in params.items()},
            "tp_split": {n for n in params if tp > 1 and any(part in n for part in TP_SPLIT)},
        }
    return out


def _run(rank, world_size, forward_cases, train_cases):
    return {
        "forward": [r for case in forward_cases for r in _forward(case)],
        "train": {case["name"]: _train(case, rank) for case in train_cases},
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_equivalence")
    forward, train, refs = [], [], {}
    for family in tiny_moe.FAMILIES:
        hf_dir = tiny_moe.make_model_dir(root, family)
        model = tiny_moe.load_hf(hf_dir)
        batch = tiny_moe.padded_batch(model.config.vocab_size)
        logits, router = tiny_moe.hf_outputs(model, *batch)
        if family in tiny_moe.SIGMOID_ROUTED:
            router = tiny_moe.hf_expert_choices(model, *batch)
        layouts = _layouts(family)
        forward.append(
            {"name": family, "hf_dir": str(hf_dir), "batch": batch, "ref": logits, "layouts": layouts}
        )
        train_batch = tiny_moe.padded_batch(model.config.vocab_size, batch=8, seed=2)
        if family in TRAIN_FAMILIES:
            train.append({"name": family, "hf_dir": str(hf_dir), "batch": train_batch})
        refs[family] = {"model": model, "batch": batch, "router": router, "train_batch": train_batch}
    out = run_on_ranks(_run, 4, forward, train, timeout_s=900)
    return {
        "forward": [r for o in out for r in o["forward"]],
        "train": [o["train"] for o in out],
        "refs": refs,
    }


def _moe_layers(family):
    return [
        i
        for i in range(tiny_moe.SIZES["num_layers"])
        if i not in tiny_moe.FAMILIES[family].get("mlp_only_layers", ())
    ]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(tiny_moe.FAMILIES))
def test_logits_match_transformers_at_ep1_ep2_tp2ep2_ep2pp2(results, family):
    rows = [r for r in results["forward"] if r["name"] == family]
    with_logits = {r["layout"] for r in rows if "rel_err" in r}
    assert with_logits == set(_layouts(family))
    for r in rows:
        if "rel_err" in r:
            assert r["rel_err"] <= REL_TOL, (family, r["layout"], r["rel_err"])


@pytest.mark.slow
@pytest.mark.parametrize("family", list(tiny_moe.FAMILIES))
def test_expert_load_matches_transformers_routing(results, family):
    ref = results["refs"][family]
    valid = ref["batch"][1].bool()
    top_k = tiny_moe.SIZES["top_k"]
    if family in tiny_moe.SIGMOID_ROUTED:  # the router's own choices ([B*S, k] per layer)
        counts = [
            torch.bincount(
                c[valid.reshape(-1)].reshape(-1), minlength=tiny_moe.FAMILIES[family]["num_experts"]
            )
            for c in ref["router"]
        ]
    else:
        counts = [tiny_moe.expert_counts(logits, valid, top_k) for logits in ref["router"]]
    expected = dict(zip(_moe_layers(family), counts, strict=True))
    seen = set()
    rows = [r for r in results["forward"] if r["name"] == family]
    for r in rows:
        if len(r["layout"]) == 5:  # sequence parallelism: each TP rank routes its share of the tokens
            tp = r["layout"][0]
            group = [o for o in rows if o["layout"] == r["layout"] and o["rank"] // tp == r["rank"] // tp]
            r = {**r, "load": {layer: sum(o["load"][layer] for o in group) for layer in r["load"]}}
        for layer, counts in r["load"].items():
            seen.add(layer)
            assert torch.equal(counts, expected[layer]), (r["layout"], layer, counts, expected[layer])
            assert int(counts.sum()) == top_k * int(valid.sum())  # padding tokens are not counted
    assert seen == set(expected)


@pytest.mark.slow
@pytest.mark.parametrize("family", TRAIN_FAMILIES)
def test_training_step_at_ep2_and_ep4_equals_ep1(results, family):
    per_rank = [r[family] for r in results["train"]]
    for rank, runs in enumerate(per_rank):
        assert all(runs[ep]["update_ok"] for ep in TRAIN_EP)
        for ep in TRAIN_EP[1:]:
            assert runs[ep]["losses"] == pytest.approx(runs[1]["losses"], rel=1e-6, abs=0), (rank, ep)
            assert runs[ep]["aux"] == pytest.approx(runs[1]["aux"], rel=1e-6), (rank, ep)

    def merged(ep, what):  # every global parameter once: experts from the EP rank that holds them
        out = {}
        for runs in per_rank:
            out.update(runs[ep][what])
        return out

    weights, grads = merged(1, "weights"), merged(1, "grads")
    for ep in TRAIN_EP[1:]:
        other_weights, other_grads = merged(ep, "weights"), merged(ep, "grads")
        assert set(other_weights) == set(weights)
        _assert_same_step(weights, grads, other_weights, other_grads, f"EP{ep}")
    # The step moved the experts and the routers (the load-balancing loss reaches the router).
    router = results["refs"][family]["model"].state_dict()["model.layers.0.mlp.gate.weight"]
    assert not torch.equal(weights["decoder.layers.0.mlp.router.weight"], router)
    assert grads["decoder.layers.0.mlp.router.weight"].abs().max() > 0


def _assert_same_step(weights, grads, other_weights, other_grads, where, names=None):
    for name in names or grads:
        g = grads[name]
        scale = g.abs().max().item()
        torch.testing.assert_close(
            other_grads[name],
            g,
            rtol=1e-5,
            atol=1e-5 * scale,
            msg=f"{where} {name} {other_grads[name].norm() / g.norm()} {(other_grads[name] - g).norm() / g.norm()}",
        )
        # Adam's first step moves w by lr * g / (|g| + eps) (plus decay): rounding differences
        # between the layouts' gradients move w by at most lr * |dg| / (min |g| + eps).
        g2, w1, w2 = other_grads[name], weights[name], other_weights[name]
        bound = 1e-6 + 1e-5 * w1.abs() + LR * (g2 - g).abs() / (torch.minimum(g.abs(), g2.abs()) + ADAM_EPS)
        worst = ((w2 - w1).abs() - bound).max().item()
        assert worst <= 0, (where, name, worst)


@pytest.mark.slow
def test_training_step_at_tp2_ep2_with_sequence_parallelism_equals_ep1(results):
    """Sequence parallelism splits each micro-batch's tokens over the TP ranks: the norms' and
    routers' gradients are partial per rank and must be summed (models/norms.py on CPU)."""
    per_rank = [r["qwen3_moe"] for r in results["train"]]
    ep1_losses = sorted(loss for runs in per_rank for loss in runs[1]["losses"])
    sp_losses = sorted(
        loss for runs in per_rank[::2] for loss in runs[TRAIN_TP_SP]["losses"]
    )  # one per TP group
    assert sp_losses == pytest.approx(ep1_losses, rel=1e-6)
    for runs in per_rank:
        assert runs[TRAIN_TP_SP]["update_ok"]
        # every TP shard counted once (models.builder.mark_tensor_parallel_weights), so the norm and
        # with it clipping are EP1's
        assert runs[TRAIN_TP_SP]["grad_norm"] == pytest.approx(runs[1]["grad_norm"], rel=1e-5)
        assert runs[TRAIN_TP_SP]["aux"] == pytest.approx(runs[1]["aux"], rel=1e-5)
    weights, grads = {}, {}
    for runs in per_rank:
        weights.update(runs[1]["weights"])
        grads.update(runs[1]["grads"])
    for rank, runs in enumerate(per_rank):
        mine = runs[TRAIN_TP_SP]
        # parameters TP does not split: norms (sequence-parallel), routers, experts (ETP 1)
        whole = [n for n in mine["weights"] if n not in mine["tp_split"]]
        assert any("layernorm" in n for n in whole) and any("router" in n for n in whole)
        assert any("experts" in n for n in whole), whole
        _assert_same_step(weights, grads, mine["weights"], mine["grads"], f"TP2xEP2 SP rank {rank}", whole)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_tracked_aux_loss_equals_independent_computation(results, family):
    ref = results["refs"][family]
    ids, mask, pos = ref["train_batch"]
    top_k = tiny_moe.SIZES["top_k"]
    expected, hf_aux = {}, []
    # megatron: per rank and micro-batch (one row), then averaged over both.
    for row in range(ids.shape[0]):
        one = (ids[row : row + 1], mask[row : row + 1], pos[row : row + 1])
        _, router = tiny_moe.hf_outputs(ref["model"], *one)
        for layer, logits in zip(_moe_layers(family), router):
            value = tiny_moe.megatron_aux_loss(logits, one[1].bool(), top_k)
            expected[layer] = expected.get(layer, 0.0) + value / ids.shape[0]
        with torch.no_grad():
            out = ref["model"](one[0], attention_mask=one[1], position_ids=one[2], output_router_logits=True)
        hf_aux.append(out.aux_loss)
    run = results["train"][0][family][1]
    assert run["coeff"] == pytest.approx(0.01)  # router_aux_loss_coef of the tiny checkpoint
    assert run["aux"].keys() == expected.keys()
    for layer, value in expected.items():
        assert run["aux"][layer] == pytest.approx(value, rel=1e-5), (layer, run["aux"][layer], value)
    if family == "qwen2_moe":  # one sparse layer: transformers' aux_loss is exactly top_k x megatron's
        assert float(torch.stack(hf_aux).mean()) / top_k == pytest.approx(expected[0], rel=1e-5)
