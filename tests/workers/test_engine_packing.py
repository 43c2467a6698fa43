"""Shared-prompt packing in MegatronEngine: the packed passes give the unpacked rows' log-probs
(equal to transformers') and gradients, at TP=1 and at TP=2 with sequence parallelism.

Rollout-shaped rows: 3 prompts x 4 responses, left-padded prompts and right-padded responses
of different lengths, cut into micro-batches of 5 rows so that prompt groups straddle
micro-batch boundaries.
"""

import pytest
import torch

from rlhf_megatron.platform.multiproc import run_on_ranks

pytestmark = pytest.mark.slow

P, R, N = 8, 6, 4  # prompt width, response width, responses per prompt


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


def _rollout():
    g = torch.Generator().manual_seed(0)
    prompt_lens, rows, masks = [5, 8, 3], [], []
    for length in prompt_lens:
        prompt = torch.randint(3, 100, (length,), generator=g).tolist()
        for _ in range(N):
            n = int(torch.randint(1, R + 1, (1,), generator=g))
            response = torch.randint(3, 100, (n,), generator=g).tolist()
            rows.append([0] * (P - length) + prompt + response + [0] * (R - n))
            masks.append([0] * (P - length) + [1] * (length + n) + [0] * (R - n))
    ids, mask = torch.tensor(rows), torch.tensor(masks)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, P:],
        "response_mask": mask[:, P:].float(),
        "advantages": torch.randn(len(rows), 1, generator=g).expand(-1, R).contiguous(),
    }


def _run(rank, world, model, pack, sequence_parallel, attention_backend="local"):
    from rlhf_megatron.config.schema import MegatronConfig, OptimConfig
    from rlhf_megatron.data.batch import Batch
    from rlhf_megatron.models.attention import SDPAttention
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

    init_model_parallel(world, 1, seed=1)
    arch = ModelArch.from_hf_dir(model)
    sp = sequence_parallel and world > 1
    engine = MegatronEngine(
        arch,
        ParallelConfig(world, sequence_parallel=sp),
        model,
        MegatronConfig(
            params_dtype="float32",
            tensor_model_parallel_size=world,
            sequence_parallel=sp,
            attention_backend=attention_backend,
        ),
        OptimConfig(lr=1e-2),
        total_steps=10,
        pack_prompts=pack,
    )
    batch = Batch.from_dict(_rollout())
    keys = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages")
    micros = split_micro_batches(batch, keys, micro_batch_size=5)
    narrowed = [engine._narrow(m, 2 if sp else 1) for m in micros]
    columns = sum(m["input_ids"].numel() for m in narrowed)

    def log_probs(logits, micro):
        out = response_outputs(logits, micro)
        return pad_responses(
            vocab_parallel_log_probs(out, micro["responses"][:, : out.shape[1]], arch.vocab_size), micro
        )

    def forward_fn(logits, micro):
        return logits.new_zeros(()), {"log_probs": log_probs(logits, micro), "rows": micro["_rows"]}

    collected = engine.run(micros, forward_fn, forward_only=True)
    rows = torch.cat([c["rows"] for c in collected])
    lp = torch.cat([c["log_probs"] for c in collected])[torch.argsort(rows)]

    def loss_fn(logits, micro):
        mask = micro["response_mask"]
        loss = -(log_probs(logits, micro) * micro["advantages"] * mask).sum() / mask.sum()
        return loss * micro["_weight"], {}

    result = engine.train_step(micros, loss_fn)
    # the (clipped) gradients the step applied: compared directly, since Adam's first step divides
    # by their magnitude and so turns rounding in near-zero gradients into visible update noise
    grads = torch.cat([buf.grad_data.clone() for buf in engine._buffers()])
    sdpa_layers = sum(isinstance(m, SDPAttention) for chunk in engine.chunks for m in chunk.modules())
    return {
        "log_probs": lp,
        "grad_norm": result["grad_norm"],
        "grads": grads,
        "columns": columns,
        "sdpa_layers": sdpa_layers,
    }


def _hf_log_probs(model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    rollout = _rollout()
    with torch.no_grad():
        logits = hf(
            input_ids=rollout["input_ids"],
            attention_mask=rollout["attention_mask"],
            position_ids=rollout["position_ids"],
        ).logits
    logp = torch.log_softmax(logits[:, P - 1 : -1], -1)
    return logp.gather(-1, rollout["responses"][..., None])[..., 0]


def test_packed_passes_equal_unpacked_ones_and_transformers(tiny):
    (plain,) = run_on_ranks(_run, 1, tiny, False, False, timeout_s=300)
    (packed,) = run_on_ranks(_run, 1, tiny, True, False, timeout_s=300)
    mask = _rollout()["response_mask"].bool()
    # the point: fewer columns through the model (101 vs 156)
    assert packed["columns"] < 0.7 * plain["columns"]
    torch.testing.assert_close(packed["log_probs"][mask], plain["log_probs"][mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed["log_probs"][mask], _hf_log_probs(tiny)[mask], rtol=1e-5, atol=1e-5)
    assert packed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    torch.testing.assert_close(packed["grads"], plain["grads"], rtol=1e-4, atol=1e-7)


def test_packed_passes_at_tp2_with_sequence_parallelism_equal_tp1(tiny):
    (plain,) = run_on_ranks(_run, 1, tiny, False, False, timeout_s=300)
    mask = _rollout()["response_mask"].bool()
    for rank_result in run_on_ranks(_run, 2, tiny, True, True, timeout_s=300):
        torch.testing.assert_close(
            rank_result["log_probs"][mask], plain["log_probs"][mask], rtol=1e-5, atol=1e-5
        )
        assert rank_result["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)


def _sdpa_refuses_attention_dropout(rank, world, model):
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import init_model_parallel

    init_model_parallel(world, 1, seed=1)
    with pytest.raises(
        ValueError, match="does not support .*attention_dropout.*attention_backend=local"
    ) as err:
        build_gpt_model(
            ModelArch.from_hf_dir(model), ParallelConfig(1), attention_backend="sdpa", attention_dropout=0.1
        )
    return str(err.value)


def _assert_sdpa_equals_local(model, hf_tolerance):
    """Under ``attention_backend=sdpa`` at TP=1 (its two layers' attention SDPAttention) the same
    log-probs as the local attention and as transformers (within ``hf_tolerance``), the same
    gradients; at TP=2 with sequence parallelism the same log-probs and gradient norm."""
    mask = _rollout()["response_mask"].bool()
    (local,) = run_on_ranks(_run, 1, model, True, False, "local", timeout_s=300)
    (sdpa,) = run_on_ranks(_run, 1, model, True, False, "sdpa", timeout_s=300)
    assert (local["sdpa_layers"], sdpa["sdpa_layers"]) == (0, 2)
    torch.testing.assert_close(sdpa["log_probs"][mask], local["log_probs"][mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        sdpa["log_probs"][mask], _hf_log_probs(model)[mask], rtol=hf_tolerance, atol=hf_tolerance
    )
    assert sdpa["grad_norm"] == pytest.approx(local["grad_norm"], rel=1e-5)
    torch.testing.assert_close(sdpa["grads"], local["grads"], rtol=1e-4, atol=1e-7)
    for rank_result in run_on_ranks(_run, 2, model, True, True, "sdpa", timeout_s=300):
        torch.testing.assert_close(
            rank_result["log_probs"][mask], local["log_probs"][mask], rtol=1e-5, atol=1e-5
        )
        assert rank_result["grad_norm"] == pytest.approx(local["grad_norm"], rel=1e-5)


def test_sdpa_attention_equals_local_attention_with_gqa_packing_and_tp2_sequence_parallelism(tmp_path):
    """``megatron.attention_backend=sdpa``: the same log-probs (equal to transformers') and the same
    gradients as megatron's local attention, with grouped KV heads, shared-prompt segments in the mask
    and at TP=2 with sequence parallelism (one KV head per rank)."""
    from rlhf_megatron.models.tiny import make_tiny_hf_model

    gqa = str(
        make_tiny_hf_model(
            tmp_path / "gqa",
            "llama",
            num_layers=2,
            hidden_size=128,
            num_heads=4,
            num_kv_heads=2,
            ffn_hidden_size=256,
        )
    )
    _assert_sdpa_equals_local(gqa, hf_tolerance=1e-5)
    (message,) = run_on_ranks(_sdpa_refuses_attention_dropout, 1, gqa, timeout_s=300)
    assert "attention_dropout" in message


def test_multi_latent_attention_under_sdpa_and_at_tp2_equals_local_attention_at_tp1(tmp_path):
    """DeepSeek-V3's multi-latent attention under ``attention_backend=sdpa``: queries and keys of
    nope + rope width, narrower values and MLA's own scale go through one fused call, with the
    same log-probs (equal to transformers') and gradients as the local module; and at TP=2 with
    sequence parallelism the same gradient norm as at TP=1 (the rotary key's gradient summed over
    the heads of both ranks, ``models.latent_tp``: without it the norm was 0.3% off). Both layers
    are dense, so no routing decision rides on the rounding."""
    from rlhf_megatron.models.tiny import make_tiny_moe_model

    mla = str(make_tiny_moe_model(tmp_path / "mla", "deepseek_v3", num_layers=2, mlp_only_layers=(0, 1)))
    _assert_sdpa_equals_local(mla, hf_tolerance=1e-4)
