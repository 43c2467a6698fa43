"""The agent quickstart's config through the real CLI: an agent program written only against the
``openai`` SDK, in a file outside the project, named by ``agent_cls``, trains the tool quickstart's
policy with GRPO (actor and vLLM at TP=2, two gloo processes under Ray; or one-step-off, the
endpoint in a rollout pool's process generating the next batch while a one-process actor trains). Every call
goes through the endpoint over the policy and is recorded token for token, so the actor's log-probs
over the merged samples match vLLM's as in the tool loop; an agent that raises on some rows is
counted and the run goes on. The rows name the endpoint (verl's ``agent_name: openai_proxy``).
"""

import subprocess
import sys

import pytest
from trainer_helpers import ONE_PROCESS, ROOT, run_train, train_overrides

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

FLAKY = '''

class FlakyAgent(CalculatorAgent):
    """The example agent, failing on the odd rows as a buggy agent would."""

    async def run(self, sample, **kwargs):
        if int(sample["extra_info"]["index"]) % 2 == 1:
            raise RuntimeError("the agent's own bug")
        return await super().run(sample, **kwargs)
'''


MODES = {
    "colocated": {},
    # The endpoint in a rollout pool's own process, generating the next batch while the actor (one
    # process: the endpoint at TP=2 is the colocated run's) trains.
    "one_step_off": {
        **ONE_PROCESS,
        "actor_rollout_ref.hybrid_engine": False,
        "trainer.rollout_mode": "one_step_off",
    },
}


@pytest.mark.parametrize("mode", list(MODES))
def test_an_sdk_agent_outside_the_project_trains_and_its_failures_are_counted(
    tool_run_inputs, tmp_path, mode
):
    agent = tmp_path / "my_agent.py"  # the example agent as a user's own file, plus a flaky subclass
    agent.write_text((ROOT / "examples/agents/calculator_agent.py").read_text() + FLAKY)
    data = tmp_path / "data"  # the task's rows naming the endpoint, as the quickstart writes them
    subprocess.run(
        [sys.executable, str(ROOT / "tools/data/tool_mult.py"), "--output-dir", str(data)]
        + ["--agent-name", "openai_proxy", "--train-size", "64", "--test-size", "8"],
        check=True,
        capture_output=True,
    )
    proc, records = run_train(
        "quickstart_agent_cpu",
        train_overrides(
            tool_run_inputs,
            tmp_path / "run",
            **{
                "data.max_prompt_length": 40,
                "data.max_response_length": 32,
                "actor_rollout_ref.rollout.agent.openai_proxy.agent_cls": f"{agent}:FlakyAgent",
                "data.train_files": str(data / "train.parquet"),
                "data.val_files": str(data / "test.parquet"),
                **MODES[mode],
            },
        ),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["agent/episodes"] == 32, "8 prompts x rollout.n 4, one episode each"
        assert r["agent/calls"] >= 1 - r["agent/failed"], "every episode that did not fail called the policy"
        assert r["agent/timed_out"] == 0 and r["agent/request_errors"] == 0
        assert r["reward/agent_mean"] == pytest.approx(r["critic/score/mean"], abs=1e-6), (
            "the agents' rewards"
        )
        assert 0 <= r["agent/pad_rows"] < 16, "padded to the mini-batch: 4 prompts x rollout.n 4 rows"
        assert 0 < r["agent/failed"] < 1, "the odd rows hit the agent's bug, and the run went on"
    # Token in, token out through the endpoint: the trained ids are vLLM's (the first step samples
    # with the actor's current weights).
    assert records[0]["training/rollout_probs_diff_mean"] < 0.005, records[0][
        "training/rollout_probs_diff_mean"
    ]
    if mode == "one_step_off":  # both batches sampled by the starting weights, the second off-policy
        assert [r["async/staleness_mean"] for r in records] == [0, 1], [
            r["async/staleness_mean"] for r in records
        ]
    assert sum(r["agent/merged"] for r in records) > 0, "a tool call then an answer: one merged sample"
    assert any(r["response/masked_token_share"] > 0 for r in records), "the tool turns are masked"
