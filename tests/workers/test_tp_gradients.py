"""Every text family's gradients at TP=2 with sequence parallelism, over two pipeline stages and
over two data-parallel ranks (experts split between them) equal one process's, parameter by
parameter (real megatron-core over gloo, ``MegatronEngine.train_step``).

A forward pass that matches transformers says little about the backward pass under TP: megatron-core
0.16's local multi-latent attention computed DeepSeek-V3's logits right at TP=2 and lost part of
the rotary key's gradient (``models.latent_tp``). Here one rollout-shaped mini-batch goes through
one step of each tiny family on one process and in each layout; for every parameter the squared
norm of its gradient (summed over the two shards of a TP-split one, each rank's own for a
replicated one, the stage's or expert-parallel rank's that holds it) must equal one process's.
Sparse layers route on weights drawn wide (``build_tiny_moe_model``), so rounding decides no
expert.
"""

from __future__ import annotations

import pytest

from rlhf_megatron.platform.multiproc import run_on_ranks

pytestmark = pytest.mark.slow

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3")
"""Dense with q/k/v biases, q/k norms or neither; softmax-routed experts with and without a gated
shared expert; sigmoid routers with shared experts under grouped-query and multi-latent attention."""


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    from rlhf_megatron.models.tiny import make_tiny_hf_model, make_tiny_moe_model

    root = tmp_path_factory.mktemp("families")
    sizes = dict(num_layers=2, num_heads=4, num_kv_heads=2)
    out = {}
    for family in FAMILIES:
        if family in ("llama", "qwen2", "qwen3"):
            path = make_tiny_hf_model(root / family, family, hidden_size=128, ffn_hidden_size=256, **sizes)
            if family == "llama":  # and the same with its LM head tied to the embedding
                tied = make_tiny_hf_model(
                    root / "llama_tied",
                    family,
                    hidden_size=128,
                    ffn_hidden_size=256,
                    tie_word_embeddings=True,
                    **sizes,
                )
                out["llama_tied"] = str(tied)
        else:  # layer 0 dense where the family has dense layers, layer 1 sparse
            dense = () if family == "qwen3_moe" else (0,)
            path = make_tiny_moe_model(root / family, family, mlp_only_layers=dense, **sizes)
        out[family] = str(path)
    return out


def _batch():
    """Six rows of 8 prompt + 6 response columns, left-padded prompts and right-padded responses."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows, masks = [], []
    for prompt, response in ((5, 6), (8, 2), (3, 4), (8, 6), (6, 1), (4, 5)):
        ids = torch.randint(3, 100, (prompt + response,), generator=g).tolist()
        rows.append([0] * (8 - prompt) + ids + [0] * (6 - response))
        masks.append([0] * (8 - prompt) + [1] * (prompt + response) + [0] * (6 - response))
    ids, mask = torch.tensor(rows), torch.tensor(masks)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, 8:],
        "response_mask": mask[:, 8:].float(),
        "advantages": torch.randn(len(rows), 1, generator=g).expand(-1, 6).contiguous(),
    }


LAYOUTS = {  # name -> (TP, PP, sequence parallelism, EP: data parallelism for a dense model)
    "tp1": (1, 1, False, 1),
    "tp2_sp": (2, 1, True, 1),
    "pp2": (1, 2, False, 1),
    "dp2_ep2": (1, 1, False, 2),
}


def _one_process_name(name: str, layer_offset: int, expert_offset: int, tied: bool) -> str:
    """The name a rank's parameter has on one process: local layer ``i`` is layer ``i +
    layer_offset`` (megatron numbers a stage's layers from 0), local expert ``j`` is expert ``j +
    expert_offset``, and a tied LM head the last stage holds apart (``output_layer.weight``, its
    gradient summed with the embedding's) is the embedding."""
    import re

    name = re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + layer_offset}.", name)
    name = re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m[1]) + expert_offset}.", name)
    if tied:
        name = name.replace("output_layer.weight", "embedding.word_embeddings.weight")
    return name


def _gradient_norms(rank, world, models, layout):
    """Per family: parameter name (as on one stage) -> (squared norm of this rank's gradient,
    whether TP splits it), after one step in ``layout``."""
    from rlhf_megatron.config.schema import MegatronConfig, OptimConfig
    from rlhf_megatron.data.batch import Batch
    from rlhf_megatron.models.builder import ParallelConfig
    from rlhf_megatron.models.forward import vocab_parallel_log_probs
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import init_model_parallel
    from rlhf_megatron.workers.megatron_engine import (
        MegatronEngine,
        pad_responses,
        response_outputs,
        split_micro_batches,
    )

    tp, pp, sp, ep = LAYOUTS[layout]
    rows = _batch()
    if ep > 1:  # data-parallel ranks: each its half of the rows (megatron averages over them)
        half = len(rows["input_ids"]) // 2
        rows = {k: v[rank * half : (rank + 1) * half] for k, v in rows.items()}
    batch = Batch.from_dict(rows)
    out = {}
    for family, model in models.items():
        arch = ModelArch.from_hf_dir(model)
        experts = ep if arch.moe is not None else 1  # a dense model's two ranks: data parallelism
        init_model_parallel(tp, pp, seed=1, expert_model_parallel_size=experts)
        engine = MegatronEngine(
            arch,
            ParallelConfig(tp, pp, sequence_parallel=sp, expert_model_parallel_size=experts),
            model,
            MegatronConfig(
                params_dtype="float32",
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                sequence_parallel=sp,
                expert_model_parallel_size=experts,
                use_distributed_optimizer=False,  # every rank keeps whole reduced gradients
            ),
            OptimConfig(lr=0.0, clip_grad=1e9),
            total_steps=1,
        )
        keys = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages")
        micros = split_micro_batches(batch, keys, micro_batch_size=3)

        def loss_fn(logits, micro, arch=arch):
            resp = response_outputs(logits, micro)
            labels = micro["responses"][:, : resp.shape[1]]
            logp = pad_responses(vocab_parallel_log_probs(resp, labels, arch.vocab_size), micro)
            mask = micro["response_mask"]
            return -(logp * micro["advantages"] * mask).sum() / mask.sum() * micro["_weight"], {}

        engine.train_step(micros, loss_fn)
        chunk = engine.chunks[0]
        # Each layer knows its global 1-based layer_number; rank r holds experts r*E/EP onwards.
        layer_offset = min(m.layer_number for m in chunk.modules() if hasattr(m, "layer_number")) - 1
        expert_offset = rank * arch.moe.num_experts // experts if experts > 1 else 0
        tied = arch.tie_word_embeddings and pp > 1
        out[family] = {}
        for name, p in chunk.named_parameters():
            if getattr(p, "main_grad", None) is None:
                continue
            glob = _one_process_name(name, layer_offset, expert_offset, tied)
            out[family][glob] = (
                float(p.main_grad.double().pow(2).sum()),
                bool(getattr(p, "tensor_model_parallel", False)),
            )
    return out


def _combined(ranks: list[dict], layout: str) -> dict[str, float]:
    """The two ranks' squared norms as one model's: TP-split parameters summed over the TP ranks,
    replicated ones equal on both; each pipeline stage's own parameters (a tied embedding on both
    stages with the same gradient)."""
    first, second = ranks
    out = {}
    for name in sorted(set(first) | set(second)):
        a, b = first.get(name), second.get(name)
        if a is not None and b is not None:
            if layout == "tp2_sp" and a[1]:
                out[name] = a[0] + b[0]
                continue
            assert a[0] == pytest.approx(b[0], rel=1e-6, abs=1e-12), f"{name}: the ranks' gradients differ"
        out[name] = (a or b)[0]
    return out


@pytest.fixture(scope="module")
def tp1(models):
    """Every family's gradients on one process: what each layout must reproduce."""
    (one,) = run_on_ranks(_gradient_norms, 1, models, "tp1", timeout_s=600)
    return one


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2", "dp2_ep2"])
def test_every_familys_gradients_equal_tp1s(models, tp1, layout):
    """At TP=2 with sequence parallelism; over two pipeline stages (a tied LM head among the
    models: the embedding's gradient summed over the first and last stage); and over two
    data-parallel ranks, each with half of the rows, a sparse layer's experts split between
    them (EP=2: each expert's gradient from both ranks' tokens)."""
    one = tp1
    ranks = run_on_ranks(_gradient_norms, 2, models, layout, timeout_s=600)
    for family in models:
        expected = {name: norm for name, (norm, _) in one[family].items()}
        got = _combined([r[family] for r in ranks], layout)
        assert set(got) == set(expected), f"{family}: {sorted(set(got) ^ set(expected))}"
        wrong = {
            n: (expected[n], got[n])
            for n in expected
            if got[n] != pytest.approx(expected[n], rel=1e-4, abs=1e-12)
        }
        assert not wrong, f"{family} at {layout}: gradients differ from TP=1's (squared norms): {wrong}"
        assert sum(expected.values()) > 0, family
