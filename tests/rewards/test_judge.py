"""The LLM judge's logic without an engine: templates, parsing, config checks, retries and
timeouts (a fake clock, a fake client), and how verdicts become scores and metrics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf_megatron.config.schema_reward import DEFAULT_JUDGE_TEMPLATE, JudgeConfig
from rlhf_megatron.rewards import RewardManager
from rlhf_megatron.rewards.judge import (
    JudgeRewardFn,
    JudgeTimeoutError,
    deadline_stop,
    generate_with_retries,
    parse_verdict,
    render_prompt,
)

ROWS = [("1+1=", "2", "arith", "2"), ("2+2=", "5", "arith", "4"), ("3+3=", "6", "arith", "6")]


def test_render_prompt_fills_fields_and_keeps_literal_braces():
    text = render_prompt("Q {prompt} | A {response} | T {ground_truth} | {{json}}", "1+1=", "2", 2)
    assert text == "Q 1+1= | A 2 | T 2 | {json}"
    assert render_prompt("{response}/{ground_truth}", "", "x") == "x/"  # no ground truth: empty
    default = render_prompt(DEFAULT_JUDGE_TEMPLATE, "PROMPT", "RESPONSE", "TRUTH")
    assert "PROMPT" in default and "RESPONSE" in default and "TRUTH" in default


@pytest.mark.parametrize(
    ("text", "score", "raw", "reason"),
    [
        ("good. Score: 7", 0.7, 7.0, ""),
        ("Score: 2 ... on reflection Score:9.5", 0.95, 9.5, ""),  # the last match counts
        ("Score: 10", 1.0, 10.0, ""),
        ("no verdict here", None, None, "no match"),
        ("Score: 1.2.3", None, None, "not a number: '1.2.3'"),
        ("Score: 11", None, 11.0, "11.0 outside [0.0, 10.0]"),
    ],
)
def test_parse_verdict(text, score, raw, reason):
    verdict = parse_verdict(text, r"Score: *([0-9.]+)", [0, 10])
    assert verdict.score == pytest.approx(score) if score is not None else verdict.score is None
    assert verdict.raw == raw and verdict.reason == reason


def test_parse_verdict_without_normalisation_keeps_the_number():
    assert parse_verdict("Score: 3", r"Score: *([0-9.]+)", [1, 5], normalize=False).score == 3.0
    assert parse_verdict("Score: 3", r"Score: *([0-9.]+)", [1, 5]).score == 0.5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_path": None}, "reward.judge.model_path is required"),
        ({"score_pattern": r"Score: [0-9]+"}, "has 0 groups; it needs exactly one"),
        ({"score_pattern": r"(a)(b)"}, "has 2 groups"),
        ({"score_pattern": r"Score: ([0-9]"}, "is not a regular expression"),
        ({"prompt_template": "Grade {prompt}"}, "has no {response} field"),
        ({"prompt_template": "{response} {answer}"}, "unknown fields ['answer']"),
        ({"prompt_template": "{response} {"}, "is not a valid format string"),
        ({"score_range": [5.0, 5.0]}, "low < high"),
        ({"max_model_len": 64, "max_new_tokens": 64}, "leaves no room for a prompt"),
        ({"timeout_s": 0.0}, "timeout_s=0.0 must be > 0"),
        ({"max_retries": -1}, "max_retries=-1 must be >= 0"),
        ({"tensor_parallel_size": 2}, "needs reward.judge.placement=pool"),
    ],
)
def test_bad_config_names_the_key(change, message):
    config = dataclasses.replace(JudgeConfig(enable=True, model_path="/judge"), **change)
    problems = config.validate("reward.judge")
    assert any(message in p for p in problems), problems
    with pytest.raises(ValueError, match="reward.judge"):
        JudgeRewardFn(config, FakeClient([]), None, None)


def test_a_disabled_judge_is_not_checked():
    assert JudgeConfig(enable=False, model_path=None, score_pattern="(").validate() == []
    assert JudgeConfig(enable=True, model_path="/judge").validate() == []


def test_deadline_stop_follows_the_clock():
    now = [100.0]
    stop = deadline_stop(5.0, clock=lambda: now[0])
    assert not stop()
    now[0] = 104.9
    assert not stop()
    now[0] = 105.0
    assert stop()


def test_retries_regenerate_only_unfinished_rows():
    calls = []

    def generate(prompts):  # row [2] finishes on its second try, row [3] never
        calls.append([p[0] for p in prompts])
        attempt = len(calls)
        return [None if p[0] == 3 or (p[0] == 2 and attempt == 1) else [p[0] * 10] for p in prompts]

    outputs, retries = generate_with_retries(generate, [[1], [2], [3]], max_retries=2)
    assert outputs == [[10], [20], None]
    assert retries == 2
    assert calls == [[1, 2, 3], [2, 3], [3]]
    assert generate_with_retries(generate, [[1]], max_retries=5) == ([[10]], 0)  # no retry needed
    _, retries = generate_with_retries(lambda ps: [None] * len(ps), [[1]], max_retries=0)
    assert retries == 0


class FakeClient:
    """Answers each prompt with a scripted verdict (None: the attempt's deadline cut it)."""

    model_path = "/models/fake-judge"

    def __init__(self, script, tokenizer=None):
        self.script, self.tokenizer, self.calls = list(script), tokenizer, []

    def generate(self, prompts, timeout_s):
        self.calls.append((len(prompts), timeout_s))
        answers = self.script.pop(0)
        return [None if a is None else self.tokenizer.encode(a, add_special_tokens=False) for a in answers]


def _judge(tokenizer, script, on_error="zero", base=None, **change):
    config = JudgeConfig(
        enable=True,
        model_path="/models/fake-judge",
        prompt_template="{prompt}{response} vs {ground_truth}",
        apply_chat_template=False,
        timeout_s=3.0,
        **change,
    )
    client = FakeClient(script, tokenizer)
    return JudgeRewardFn(config, client, tokenizer, tokenizer, on_error=on_error, base=base), client


def test_verdicts_become_scores_on_the_last_token_with_metrics(tokenizer, make_rollout):
    batch = make_rollout(ROWS)
    fn, client = _judge(tokenizer, [["Score: 8", "bad", "Score: 12"]])
    prompts = fn.judge_prompts(batch, batch["response_mask"].sum(-1))
    assert [tokenizer.decode(p) for p in prompts] == ["1+1=2 vs 2", "2+2=5 vs 4", "3+3=6 vs 6"]
    result = fn(batch)
    lengths = batch["response_mask"].sum(-1)
    expected = torch.zeros_like(result.token_level_scores)
    expected[0, lengths[0] - 1] = 0.8
    torch.testing.assert_close(result.token_level_scores, expected)
    assert client.calls == [(3, 3.0)], "one batched call for all rows, with the configured timeout"
    assert result.metrics["reward/judge_invalid"] == 2.0  # no match, and 12 out of [0, 10]
    assert result.metrics["reward/judge_timeouts"] == 0.0
    assert result.metrics["reward/judge_retries"] == 0.0
    assert result.metrics["reward/judge_score_mean"] == pytest.approx(0.8)
    assert result.extra["judge_score"] == [pytest.approx(0.8), None, None]
    assert [v.reason for v in fn.last_verdicts] == ["", "no match", "12.0 outside [0.0, 10.0]"]


def test_a_timeout_is_retried_then_zero_counts_it(tokenizer, make_rollout):
    batch = make_rollout(ROWS)
    fn, client = _judge(tokenizer, [["Score: 5", None, None], ["Score: 10", None], [None]], max_retries=2)
    result = fn(batch)
    assert [n for n, _ in client.calls] == [3, 2, 1]
    assert result.metrics["reward/judge_retries"] == 2.0
    assert result.metrics["reward/judge_timeouts"] == 1.0
    assert result.metrics["reward/judge_invalid"] == 0.0, "a timeout is not an invalid verdict"
    assert result.extra["judge_score"] == [0.5, 1.0, None]
    assert result.token_level_scores.sum(-1).tolist() == pytest.approx([0.5, 1.0, 0.0])


def test_a_timeout_with_on_error_raise_names_the_judge_and_step(tokenizer, make_rollout):
    batch = make_rollout(ROWS)
    batch.meta_info["global_step"] = 7
    fn, _ = _judge(tokenizer, [[None, "Score: 1", "Score: 1"], [None]], on_error="raise", max_retries=1)
    with pytest.raises(JudgeTimeoutError, match=r"LLM judge /models/fake-judge: 1 of 3 verdicts at step 7"):
        fn(batch)


def test_combine_add_weights_the_judge_onto_the_rule_reward(tokenizer, make_rollout):
    batch = make_rollout(ROWS)
    base = RewardManager(tokenizer, num_examine=0)  # arith: 1 for a right answer
    fn, _ = _judge(tokenizer, [["Score: 10", "Score: 0", "nothing"]], base=base, weight=0.5)
    result = fn(batch)
    assert result.token_level_scores.sum(-1).tolist() == pytest.approx([1.5, 0.0, 1.0])
    assert result.metrics["reward/arith/mean"] == pytest.approx(2 / 3), "the rule reward's metrics stay"
    assert result.metrics["reward/judge_invalid"] == 1.0


def test_a_prompt_too_long_for_the_judge_is_invalid_not_sent(tokenizer, make_rollout):
    batch = make_rollout([("1+1=", "2", "arith", "2"), ("1+1=", "2" * 10, "arith", "2")])
    fn, client = _judge(tokenizer, [["Score: 3"]], max_model_len=12, max_new_tokens=2, invalid_score=-1.0)
    result = fn(batch)
    assert client.calls == [(1, 3.0)]
    assert result.metrics["reward/judge_too_long"] == 1.0
    assert result.metrics["reward/judge_invalid"] == 1.0
    assert result.token_level_scores.sum(-1).tolist() == pytest.approx([0.3, -1.0])


def test_a_run_wraps_both_reward_functions_around_one_judge_client(tokenizer, tmp_path):
    from rlhf_megatron.config.schema import RunConfig
    from rlhf_megatron.trainer.run import _with_judge
    from rlhf_megatron.workers.judge import LocalJudgeClient, PoolJudgeClient

    tokenizer.save_pretrained(tmp_path)
    run = RunConfig()
    run.reward.judge = JudgeConfig(enable=True, model_path=str(tmp_path), combine="add")
    base = (RewardManager(tokenizer), RewardManager(tokenizer))
    (train, val), client = _with_judge(run, tokenizer, base)
    assert isinstance(client, LocalJudgeClient) and client.engine is None, "built, not started"
    assert train.client is client and val.client is client
    assert (train.base, val.base) == base
    run.reward.judge = JudgeConfig(enable=True, model_path=str(tmp_path), placement="pool")
    (train, _), client = _with_judge(run, tokenizer, base)
    assert isinstance(client, PoolJudgeClient) and train.base is None  # replace
    run.reward.judge = JudgeConfig()
    assert _with_judge(run, tokenizer, base) == (base, None)
