"""The agent endpoint over the real vLLM engine: agents written only with the ``openai`` SDK call the
tool quickstart's policy, run its calculator calls themselves, and answer; every call is recorded,
the calls of an episode merge into one sample, and that sample is token for token what the policy
sampled: transformers' log-probs over the merged sequence equal the engine's recorded ones.
"""

import asyncio
import os
import re
import threading

import pytest

from rlhf_megatron.agent.proxy_protocol import SamplingDefaults
from rlhf_megatron.agent.proxy_records import assemble_samples
from rlhf_megatron.agent.proxy_server import GenerationQueue, ProxyEndpoint, ProxyServer
from rlhf_megatron.agent.tools.calculator import CalculatorTool
from rlhf_megatron.platform.multiproc import run_on_ranks

pytestmark = pytest.mark.slow
EPISODES = 8
RESPONSE = 32


async def _agent(base_url: str, key: str, question: str, seed: int) -> list[str]:
    """A user's agent: the openai SDK alone; it runs the policy's calculator calls itself."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": question}]
    finishes = []
    try:
        for _ in range(3):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CalculatorTool.default_tool_schema], seed=seed
            )
            choice = reply.choices[0]
            finishes.append(choice.finish_reason)
            messages.append(choice.message.model_dump(exclude_none=True))
            if choice.finish_reason != "tool_calls":
                break
            for call in choice.message.tool_calls:
                numbers = [int(x) for x in re.findall(r"\d+", call.function.arguments)[:2]]
                result = str(numbers[0] * numbers[1]) if len(numbers) == 2 else "error: give a*b"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    finally:
        await client.close()
    return finishes


def _serve_agents(rank, world_size, model_path):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_megatron.config.schema import RolloutConfig
    from rlhf_megatron.rollout import RolloutSampling, build_rollout_engine

    engine = build_rollout_engine(
        "vllm",
        model_path,
        RolloutConfig(dtype="float32", max_num_seqs=8),
        max_model_len=128,
        seed=0,
        pad_token_id=0,
    )
    tok = AutoTokenizer.from_pretrained(model_path)
    sampling = RolloutSampling(temperature=1.0, response_length=RESPONSE)
    queue = GenerationQueue()
    endpoint = ProxyEndpoint(tok, queue, SamplingDefaults(1.0, 1.0, RESPONSE), engine.max_model_len)
    episodes = [endpoint.open_episode(row=i, budget=48) for i in range(EPISODES)]
    finished, out = threading.Event(), {}

    with ProxyServer(endpoint) as server:

        async def everyone():
            return await asyncio.gather(
                *(
                    _agent(server.base_url, e.key, f"What is {12 + i}*{31 + i}?", seed=i)
                    for i, e in enumerate(episodes)
                )
            )

        def agents():
            try:
                out["finishes"] = asyncio.run(everyone())
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                out["error"] = repr(exc)
            finally:
                finished.set()

        thread = threading.Thread(target=agents)
        thread.start()
        # This thread owns vLLM, as the rollout worker's does: it serves the agents' turns.
        out["engine_calls"] = queue.serve(
            lambda turns: engine.generate_turn(turns, sampling), lambda: 5, finished.is_set
        )
        thread.join()
    queue.close()

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out["episodes"] = []
    for episode in (endpoint.close_episode(e.key) for e in episodes):
        samples, counts = assemble_samples(episode.calls)
        checked = []
        for sample in samples:
            ids = torch.tensor([sample.full_ids()])
            with torch.no_grad():
                logits = hf(input_ids=ids).logits.float()[0]
            p = len(sample.prompt_ids)
            lp = torch.log_softmax(logits[p - 1 : -1], dim=-1).gather(-1, ids[0, p:, None])[:, 0]
            mask = torch.tensor(sample.response_mask, dtype=torch.bool)
            checked.append(
                {
                    "max_diff": float((lp[mask] - torch.tensor(sample.log_probs)[mask]).abs().max()),
                    "sampled": int(mask.sum()),
                    "masked": int((~mask).sum()),
                    "versions": sorted(set(sample.versions)),
                }
            )
        out["episodes"].append({"counts": counts, "samples": checked, "continued": episode.continued})
    return out


def test_sdk_agents_on_the_vllm_policy_are_recorded_token_for_token(tool_run_inputs):
    res = run_on_ranks(_serve_agents, 1, tool_run_inputs["model"], init_process_group=False, timeout_s=600)[0]
    assert "error" not in res, res.get("error")
    finishes = res["finishes"]
    assert len(finishes) == EPISODES and all(f[-1] in ("stop", "length") for f in finishes), finishes
    calls = sum(len(f) for f in finishes)
    assert res["engine_calls"] < calls, "concurrent episodes share engine calls"
    with_tools = [e for e, f in zip(res["episodes"], finishes) if "tool_calls" in f]
    assert with_tools, f"the policy called its tool in no episode: {finishes}"
    for episode, finish in zip(res["episodes"], finishes):
        # Each follow-up continues the reply in tokens, so an episode is one merged sample.
        assert episode["counts"]["calls"] == len(finish)
        assert episode["counts"]["samples"] == 1 and episode["continued"] == len(finish) - 1, episode
        (sample,) = episode["samples"]
        assert sample["max_diff"] < 1e-4, sample
        assert sample["versions"] == ([-1, 5] if len(finish) > 1 else [5])
    for episode in with_tools:
        assert episode["samples"][0]["masked"] > 0, "the tool's turn is in the sample, masked out"
