"""The multi-turn agent loop's logic on the tiny tokenizer, with a scripted engine.

The engine is a recorder that answers each assistant turn with scripted text (token ids of the
tiny tokenizer) and a known log-prob, so every decision of the loop (tool calls, errors, budgets,
turn limits, interactions, rewards, concurrency) is checked exactly. The loop on the real stack
(vLLM, Megatron, Ray) is in tests/trainer/test_tool_e2e.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from rlhf_megatron.agent import BaseInteraction, BaseTool, OpenAIFunctionToolSchema, ToolResponse
from rlhf_megatron.agent.loop import ToolAgentLoop, Trajectory, render_turn_ids
from rlhf_megatron.agent.tools.calculator import CalculatorTool
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.data.tokenizer import build_tiny_tokenizer

WORDS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
LP = -0.5  # the scripted engine's log-prob of every sampled token


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(WORDS)


def _schema(name: str, **props) -> OpenAIFunctionToolSchema:
    return OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": name,
                "description": name,
                "parameters": {
                    "type": "object",
                    "properties": {p: {"type": t} for p, t in props.items()},
                    "required": list(props),
                },
            },
        }
    )


class _Recorder(BaseTool):
    """A user's tool in verl's shape: records what the loop asked of it."""

    def __init__(self, name="echo", sleep_s=0.0, fail=None, reward=0.0):
        super().__init__({}, _schema(name, text="string"))
        self.sleep_s, self.fail, self.reward = sleep_s, fail, reward
        self.created, self.executed, self.rewarded, self.released = [], [], [], []

    async def create(self, instance_id=None, **kwargs):
        if self.fail == "create":
            raise RuntimeError("no sandbox left")
        self.created.append(kwargs)
        return f"inst{len(self.created)}", ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        self.executed.append((instance_id, parameters, kwargs))
        if self.fail == "raise":
            raise ValueError("bad day")
        if self.sleep_s:
            await asyncio.sleep(self.sleep_s)
        return ToolResponse(text="echo:" + parameters["text"]), self.reward, {}

    async def calc_reward(self, instance_id, **kwargs):
        self.rewarded.append((instance_id, kwargs))
        return 1.0

    async def release(self, instance_id, **kwargs):
        self.released.append((instance_id, kwargs))


def _call(name: str, **arguments) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class _Engine:
    """Answers request ``k`` of turn ``t`` with ``script[sample][t]`` (+ EOS), ``sample`` found by order."""

    def __init__(self, tok, script: list[list[str]]):
        self.tok, self.script, self.turns, self.requests = tok, script, [0] * len(script), []

    def __call__(self, requests):
        self.requests.append(requests)
        outs = []
        for ids, max_new, _ in requests:
            sample = self._sample_of(ids)
            text = self.script[sample][self.turns[sample]]
            self.turns[sample] += 1
            new = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
            finish = "length" if len(new) > max_new else "stop"
            new = new[:max_new]
            outs.append((new, [LP] * len(new), finish))
        return outs

    def _sample_of(self, ids):
        for sample, prompt in enumerate(self.prompts):
            if ids[: len(prompt)] == prompt:
                return sample
        raise AssertionError("unknown request")


def _run(tok, tools, script, response_length=200, prompts=None, interactions=None, **kw):
    loop = ToolAgentLoop(tok, tools, interactions or {}, response_length, **kw)
    prompts = prompts or [
        tok.encode(f"<|user|>q{i}</s><|assistant|>", add_special_tokens=False) for i in range(len(script))
    ]
    engine = _Engine(tok, script)
    engine.prompts = prompts
    trajectories = [
        Trajectory(prompt_ids=list(p), messages=[{"role": "user", "content": "q"}]) for p in prompts
    ]
    return loop.run(trajectories, engine), engine


def _text(tok, t: Trajectory, mask: int | None = None) -> str:
    ids = [i for i, m in zip(t.response_ids, t.response_mask) if mask is None or m == mask]
    return tok.decode(ids, skip_special_tokens=True)


def test_a_tool_call_then_an_answer_masks_the_tool_turn_and_keeps_sampled_ids(tok):
    tool = CalculatorTool({}, None)
    (t,), engine = _run(tok, [tool], [[_call("calculator", expression="37*48"), "1776"]])
    assert t.end == "stop" and t.assistant_turns == 2 and t.user_turns == 1 and t.tool_calls == 1
    assert t.tool_errors == 0
    # The tool turn is the template's tool message, masked out of the loss, log-prob 0.
    expected_turn = render_turn_ids(tok, [{"role": "tool", "content": "1776"}])
    first = len(tok.encode(_call("calculator", expression="37*48"), add_special_tokens=False)) + 1
    assert t.response_ids[first : first + len(expected_turn)] == expected_turn
    assert t.response_mask == [1] * first + [0] * len(expected_turn) + [1] * (
        len(t.response_ids) - first - len(expected_turn)
    )
    assert t.log_probs == [LP if m else 0.0 for m in t.response_mask]
    assert _text(tok, t, mask=0) == "<tool_response>1776</tool_response>"
    # The second turn continued from everything before it.
    second_request = engine.requests[1][0][0]
    assert second_request == t.prompt_ids + t.response_ids[: first + len(expected_turn)]


def test_bad_calls_become_error_responses_and_the_sample_goes_on(tok):
    tool = _Recorder()
    script = [
        ["<tool_call>{not json</tool_call>", "done"],
        [_call("nope", text="x"), "done"],
        [_call("echo", txt="x"), "done"],
        [_call("echo", text=5), "done"],
    ]
    ts, _ = _run(tok, [tool], script)
    responses = [_text(tok, t, mask=0) for t in ts]
    assert "is not valid JSON" in responses[0]
    assert "unknown tool 'nope'" in responses[1] and "echo" in responses[1]
    assert "missing required argument 'text'" in responses[2] or "'text'" in responses[2]
    assert "Error" in responses[3]
    assert all(t.end == "stop" and t.tool_errors == 1 and t.tool_calls == 1 for t in ts)
    assert tool.executed == [], "no malformed call reached the tool"


def test_a_tool_that_raises_or_hangs_is_an_error_within_the_timeout(tok):
    raising, hanging = _Recorder("boom", fail="raise"), _Recorder("slow", sleep_s=60)
    start = time.monotonic()
    ts, _ = _run(
        tok,
        [raising, hanging],
        [[_call("boom", text="a"), "ok"], [_call("slow", text="b"), "ok"]],
        tool_timeout_s=0.5,
    )
    assert time.monotonic() - start < 5
    assert "bad day" in _text(tok, ts[0], mask=0) and ts[0].tool_errors == 1
    assert "timed out" in _text(tok, ts[1], mask=0) and ts[1].tool_timeouts == 1
    assert all(t.end == "stop" for t in ts)


def test_tool_calls_of_all_samples_run_concurrently(tok):
    tool = _Recorder(sleep_s=0.5)
    script = [[_call("echo", text=str(i)), _call("echo", text="again"), "done"] for i in range(8)]
    start = time.monotonic()
    ts, engine = _run(tok, [tool], script)
    elapsed = time.monotonic() - start
    assert all(t.tool_calls == 2 and t.end == "stop" for t in ts)
    assert len(engine.requests) == 3 and [len(r) for r in engine.requests] == [8, 8, 8], (
        "one engine call per turn"
    )
    assert elapsed < 2.5, f"16 calls of 0.5 s took {elapsed:.1f} s: the samples' tools did not overlap"


def test_budget_and_turn_limits_end_trajectories(tok):
    tool = _Recorder()
    long = "x" * 60
    ts, _ = _run(tok, [tool], [[long], [_call("echo", text="y" * 30), "z"]], response_length=50)
    assert ts[0].end == "length" and len(ts[0].response_ids) == 50
    # The tool turn does not fit what is left: the sample ends without it.
    assert ts[1].end == "length" and ts[1].user_turns == 0 and all(m == 1 for m in ts[1].response_mask)
    ts, _ = _run(
        tok,
        [tool],
        [[_call("echo", text="1"), _call("echo", text="2"), _call("echo", text="3")]],
        max_assistant_turns=2,
    )
    assert ts[0].end == "max_turns" and ts[0].assistant_turns == 2 and ts[0].tool_calls == 1


def test_tools_kwargs_rewards_and_release_follow_verls_protocol(tok):
    tool = _Recorder(reward=0.25)
    loop = ToolAgentLoop(tok, [tool], {}, 200)
    prompt = tok.encode("<|user|>q</s><|assistant|>", add_special_tokens=False)
    t = Trajectory(
        prompt_ids=prompt,
        messages=[],
        tools_kwargs={
            "echo": {
                "create_kwargs": {"ground_truth": "7"},
                "execute_kwargs": {"k": 1},
                "calc_reward_kwargs": {"c": 2},
                "release_kwargs": {"r": 3},
            }
        },
    )
    engine = _Engine(tok, [[_call("echo", text="a"), _call("echo", text="b"), "7"]])
    engine.prompts = [prompt]
    loop.run([t], engine)
    assert tool.created == [{"ground_truth": "7", "create_kwargs": {"ground_truth": "7"}}], (
        "one instance per trajectory, made on its first call, with create_kwargs in both verl forms"
    )
    assert [e[2] for e in tool.executed] == [{"k": 1}, {"k": 1}]
    assert tool.rewarded == [("inst1", {"c": 2})] and tool.released == [("inst1", {"r": 3})]
    assert t.reward == pytest.approx(0.25 * 2 + 1.0), "step rewards plus calc_reward"


def test_a_tool_that_cannot_start_ends_the_trajectory_with_tool_error(tok):
    ts, _ = _run(tok, [_Recorder(fail="create")], [[_call("echo", text="a"), "never"]])
    assert ts[0].end == "tool_error" and ts[0].tool_errors == 1 and ts[0].assistant_turns == 1


class _Teacher(BaseInteraction):
    """verl's interaction shape: asks once for a retry, then ends the conversation."""

    def __init__(self):
        super().__init__({"name": "teacher"})
        self.seen = []

    async def generate_response(self, instance_id, messages, **kwargs):
        self.seen.append([m["role"] for m in messages])
        if len(self.seen) == 1:
            return False, "try again", 0.1, {}
        return True, "", 1.0, {}


def test_an_interaction_adds_user_turns_and_scores(tok):
    teacher = _Teacher()
    loop = ToolAgentLoop(tok, [], {"teacher": teacher}, 200)
    prompt = tok.encode("<|user|>q</s><|assistant|>", add_special_tokens=False)
    t = Trajectory(
        prompt_ids=prompt, messages=[{"role": "user", "content": "q"}], interaction_kwargs={"name": "teacher"}
    )
    engine = _Engine(tok, [["first", "second"]])
    engine.prompts = [prompt]
    loop.run([t], engine)
    assert t.end == "stop" and t.assistant_turns == 2 and t.user_turns == 1
    assert _text(tok, t, mask=0) == "try again"
    assert teacher.seen == [["user", "assistant"], ["user", "assistant", "user", "assistant"]]
    assert t.reward == pytest.approx(0.1 + 1.0)


def test_assembled_batch_keeps_attention_over_tool_turns_and_loss_on_sampled_tokens(tok):
    from rlhf_megatron.rollout.multi_turn import _assemble

    tool = CalculatorTool({}, None)
    ts, _ = _run(tok, [tool], [[_call("calculator", expression="2*3"), "6"], ["7"]], response_length=120)
    ts[0].reward = 0.5
    prompts = Batch.from_dict(
        {
            "input_ids": torch.zeros(1, 4, dtype=torch.long),
            "attention_mask": torch.ones(1, 4, dtype=torch.long),
        },
        {"data_source": ["tool_mult"]},
    )
    batch = _assemble(prompts, ts, 2, prompt_length=24, response_length=120, pad_token_id=0)
    assert batch["responses"].shape == (2, 120) and batch["prompts"].shape == (2, 24)
    valid = batch["attention_mask"][:, 24:]
    assert valid.sum(-1).tolist() == [len(t.response_ids) for t in ts]
    assert batch["response_mask"].sum(-1).tolist() == [sum(t.response_mask) for t in ts]
    assert ((batch["response_mask"] == 1) <= (valid == 1)).all(), "loss tokens are valid tokens"
    assert torch.equal(batch["input_ids"][:, 24:], batch["responses"])
    last_prompt = int(batch["position_ids"][0, 23])
    assert batch["position_ids"][0, 24:].tolist() == list(range(last_prompt + 1, last_prompt + 121))
    assert batch["tool_rewards"].tolist() == [0.5, 0.0] and batch["agent_tool_calls"].tolist() == [1, 0]
    assert list(batch["agent_end"]) == ["stop", "stop"] and list(batch["data_source"]) == ["tool_mult"] * 2


def test_single_turn_agent_rows_end_after_their_first_turn(tok):
    tool = _Recorder()
    loop = ToolAgentLoop(tok, [tool], {}, 200)
    prompts = [tok.encode(f"<|user|>q{i}</s><|assistant|>", add_special_tokens=False) for i in range(2)]
    engine = _Engine(tok, [[_call("echo", text="a"), "done"], [_call("echo", text="b"), "done"]])
    engine.prompts = prompts
    ts = [
        Trajectory(prompt_ids=list(prompts[0]), messages=[], single_turn=True),
        Trajectory(prompt_ids=list(prompts[1]), messages=[]),
    ]
    loop.run(ts, engine)
    assert ts[0].end == "stop" and ts[0].assistant_turns == 1 and ts[0].tool_calls == 0
    assert ts[1].tool_calls == 1 and ts[1].assistant_turns == 2
    assert [p for _, p, _ in tool.executed] == [{"text": "b"}]
