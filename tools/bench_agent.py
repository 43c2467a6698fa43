"""How much of a multi-turn step's tool time hides behind the other samples: one generation phase
of ``--samples`` trajectories that each call a tool sleeping ``--sleep-s`` seconds ``--calls``
times, on the real vLLM engine, against the same prompts generated single-turn. Prints JSON.

    .venv/bin/python tools/bench_agent.py                    # 64 samples x 2 calls x 1 s
    .venv/bin/python tools/bench_agent.py --samples 16 --calls 3 --sleep-s 0.5

The policy is the tool quickstart's, pre-trained to always call (``tools/make_tiny_tool_model.py
--tool-share 1.0 --max-rounds 3``, built on first use under ``outputs/``): it calls the
``calculator`` and copies its answer, for each of up to three questions in a row. An interaction (verl's ``BaseInteraction``) asks a new question after each answer
until the sample has answered ``--calls`` times, so every sample calls the tool about ``--calls``
times (the JSON reports how many it really did). The tool sleeps with ``asyncio.sleep``, like a
tool waiting on a server.

Reported: ``single_turn_s`` (one ``generate_sequences`` call, the same prompts), ``multi_turn_s``
(the whole multi-turn generation), ``engine_s`` (the part inside the engine's turns), the tool
calls made, ``serial_tool_s`` (calls x sleep: what running them one after another would add),
``tool_wait_s`` (``multi_turn_s - engine_s``: what the tools did add) and ``overlap`` (``1 -
tool_wait_s / serial_tool_s``: 1.0 is perfect overlap).

Also reported, under ``sandbox``: the code sandbox's cost per call, ``print(1)`` through
``run_python`` (``--sandbox-runs`` calls after one warm-up: median and 90th percentile in ms, and
the layers that held). ``--sandbox-only`` measures just that, without vLLM:

    .venv/bin/python tools/bench_agent.py --sandbox-only

Boundaries: one process, vLLM at TP=1 on this machine's device; no Megatron, no Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=64, help="trajectories in the phase (prompts x n)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument(
        "--calls", type=int, default=2, help="tool calls per sample (answers the interaction asks for)"
    )
    p.add_argument("--sleep-s", type=float, default=1.0, help="seconds each tool call sleeps")
    p.add_argument("--model", default=None, help="a tool-calling policy (default: built under outputs/)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sandbox-runs", type=int, default=100, help="print(1) calls through the code sandbox")
    p.add_argument("--sandbox-only", action="store_true", help="measure only the code sandbox (no vLLM)")
    return p.parse_args(argv)


def measure_sandbox(runs: int) -> dict:
    """``print(1)`` through ``run_python``, ``runs`` times after a warm-up (which also pays for the
    layer probe and the per-process directory)."""
    from rlhf_megatron.agent.sandbox import run_python, sandbox_layers

    layers = sandbox_layers()
    run_python("print(1)")
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = run_python("print(1)")
        times.append((time.perf_counter() - start) * 1000)
        if result.stdout != "1\n":
            raise RuntimeError(f"the sandbox did not print 1: {result}")
    times.sort()
    return {
        "runs": runs,
        "print1_ms_median": round(statistics.median(times), 2),
        "print1_ms_p90": round(times[int(0.9 * (runs - 1))], 2),
        "layers": {k: v for k, v in layers.items()},
    }


def build_model() -> tuple[str, str]:
    """The always-calling policy and its tool_mult data, built once (the builder keeps a stamp)."""
    out, data = ROOT / "outputs/bench_tool_model", ROOT / "outputs/data/tool_mult_bench"
    cmd = [sys.executable, str(ROOT / "tools/make_tiny_tool_model.py"), "--out", str(out)]
    cmd += ["--data-dir", str(data), "--tool-share", "1.0", "--max-rounds", "3"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return str(out), str(data)


def make_agent(tokenizer, response_length: int, calls: int, sleep_s: float):
    from rlhf_megatron.agent import BaseInteraction, ToolResponse
    from rlhf_megatron.agent.loop import ToolAgentLoop
    from rlhf_megatron.agent.tools.calculator import CalculatorTool

    class SleepyCalculator(CalculatorTool):
        """The calculator behind a ``sleep_s`` wait (a remote service)."""

        async def execute(self, instance_id, parameters, **kwargs):
            await asyncio.sleep(sleep_s)
            return await super().execute(instance_id, parameters, **kwargs)

    class AskAgain(BaseInteraction):
        """After each answer, another two-digit product, until ``calls`` answers."""

        def __init__(self):
            super().__init__({"name": "ask_again"})
            self.answers: dict[str, int] = {}

        async def start_interaction(self, instance_id=None, **kwargs):
            instance_id = instance_id or str(len(self.answers))
            self.answers[instance_id] = 0
            return instance_id

        async def generate_response(self, instance_id, messages, **kwargs):
            self.answers[instance_id] += 1
            if self.answers[instance_id] >= calls:
                return True, "", 0.0, {}
            a, b = 11 + self.answers[instance_id], 23 + len(messages)
            return False, f"What is {a}*{b}?", 0.0, {}

    del ToolResponse
    return ToolAgentLoop(
        tokenizer,
        [SleepyCalculator({})],
        {"ask_again": AskAgain()},
        response_length,
        max_assistant_turns=3 * calls,
        max_parallel_calls=1,
        tool_timeout_s=60.0,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.sandbox_only:
        print(json.dumps({"sandbox": measure_sandbox(args.sandbox_runs)}))
        return 0
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from rlhf_megatron.config.schema import DataConfig, RolloutConfig
    from rlhf_megatron.data import RLHFDataset, collate_fn
    from rlhf_megatron.rollout.base import RolloutSampling
    from rlhf_megatron.rollout.multi_turn import generate_multi_turn
    from rlhf_megatron.rollout.vllm_engine import VLLMEngine

    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    model, data = (args.model, None) if args.model else build_model()
    if data is None:
        data = str(ROOT / "outputs/data/tool_mult_bench")
    prompt_length, response_length = 40, 24 * args.calls + 16
    data_cfg = OmegaConf.to_object(
        OmegaConf.merge(
            OmegaConf.structured(DataConfig),
            {
                "max_prompt_length": prompt_length,
                "return_raw_chat": True,
                "train_files": "x",
                "val_files": "x",
            },
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset = RLHFDataset(os.path.join(data, "test.parquet"), tokenizer, data_cfg)
    prompts = collate_fn([dataset[i] for i in range(args.samples // args.n)])
    prompts.non_tensors["extra_info"] = np.array(
        [{**info, "interaction_kwargs": {"name": "ask_again"}} for info in prompts["extra_info"]],
        dtype=object,
    )
    rollout = RolloutConfig(
        dtype="float32",
        n=args.n,
        max_num_seqs=256,
        prompt_length=prompt_length,
        response_length=response_length,
        enable_sleep_mode=False,
    )
    engine = VLLMEngine(model, rollout, max_model_len=prompt_length + response_length, seed=args.seed)
    sampling = RolloutSampling.from_config(rollout, seed=args.seed)
    agent = make_agent(tokenizer, response_length, args.calls, args.sleep_s)

    engine.generate_sequences(prompts, sampling)  # warm-up: compile and cache
    t0 = time.perf_counter()
    engine.generate_sequences(prompts, sampling)
    single_s = time.perf_counter() - t0

    engine_s = [0.0]
    generate_turn = engine.generate_turn

    def timed_turn(requests, turn_sampling):
        start = time.perf_counter()
        try:
            return generate_turn(requests, turn_sampling)
        finally:
            engine_s[0] += time.perf_counter() - start

    engine.generate_turn = timed_turn
    t0 = time.perf_counter()
    batch = generate_multi_turn(engine, agent, prompts, sampling, prompt_length)
    multi_s = time.perf_counter() - t0

    calls = batch["agent_tool_calls"].float()
    serial = float(calls.sum()) * args.sleep_s
    tool_wait = multi_s - engine_s[0]
    print(
        json.dumps(
            {
                "samples": len(batch),
                "sleep_s": args.sleep_s,
                "calls_per_sample_asked": args.calls,
                "tool_calls": int(calls.sum()),
                "tool_calls_per_sample": {
                    "mean": round(float(calls.mean()), 3),
                    "min": int(calls.min()),
                    "max": int(calls.max()),
                },
                "tool_errors": int(batch["agent_tool_errors"].sum()),
                "turns_per_sample_mean": round(float(batch["agent_num_turns"].float().mean()), 3),
                "single_turn_s": round(single_s, 3),
                "multi_turn_s": round(multi_s, 3),
                "engine_s": round(engine_s[0], 3),
                "serial_tool_s": round(serial, 3),
                "tool_wait_s": round(tool_wait, 3),
                "overlap": round(1.0 - tool_wait / serial, 4) if serial else None,
                "added_over_single_turn_s": round(multi_s - single_s, 3),
                "device": "cuda" if torch.cuda.is_available() else "cpu",
                "sandbox": measure_sandbox(args.sandbox_runs),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
