"""Step metrics as verl users know them: data statistics, timings, throughput and MFU.

Pure functions of a finished step's ``Batch`` and timings; the loop calls them
once per step.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator

import torch

from rlhf_megatron.data.batch import Batch


class StepTimer:
    """The one timing channel of a step, as verl's ``marked_timer``: ``with timer("reward"):`` times
    a phase (``timing_s/reward``, summed if it runs twice) and keeps its wall-clock span for the
    timeline (``timeline/trainer/reward/{start,end}_s``); ``record`` enters a phase timed elsewhere
    (the rollout's own clock, a log-prob pass fused into the generation's call)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.spans: dict[str, tuple[float, float]] = {}
        """``<role>/<phase>`` -> (start, end), wall clock."""

    @contextlib.contextmanager
    def __call__(self, name: str, role: str = "trainer") -> Iterator[None]:
        wall, start = time.time(), time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.spans[f"{role}/{name}"] = (wall, time.time())

    def record(self, name: str, begin: float, end: float, role: str = "trainer") -> None:
        """A phase that ran from ``begin`` to ``end`` (wall clock) without this timer around it."""
        self.seconds[name] = end - begin
        self.spans[f"{role}/{name}"] = (begin, end)

    def metrics(self, t0: float) -> dict[str, float]:
        """``timing_s/<phase>`` and ``timeline/<role>/<phase>/{start,end}_s`` (seconds since ``t0``)."""
        out = {f"timing_s/{name}": seconds for name, seconds in self.seconds.items()}
        for span, (begin, end) in self.spans.items():
            out[f"timeline/{span}/start_s"] = begin - t0
            out[f"timeline/{span}/end_s"] = end - t0
        return out


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    values = values.float()
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/max": float(values.max()),
        f"{prefix}/min": float(values.min()),
    }


def compute_data_metrics(batch: Batch, use_critic: bool) -> dict[str, float]:
    """critic/score, critic/rewards, critic/advantages, critic/returns, critic/values, lengths."""
    mask = batch["response_mask"].bool()
    prompt_width = batch["prompts"].shape[1]
    # Every token after the prompt (a multi-turn response's tool turns too), as verl counts it.
    response_len = batch["attention_mask"][:, prompt_width:].sum(-1).float()
    prompt_len = batch["attention_mask"][:, :prompt_width].sum(-1).float()
    metrics = {
        **_stats("critic/score", batch["token_level_scores"].sum(-1)),
        **_stats("critic/rewards", batch["token_level_rewards"].sum(-1)),
        **_stats("critic/advantages", batch["advantages"][mask]),
        **_stats("critic/returns", batch["returns"][mask]),
        **_stats("response_length", response_len),
        **_stats("prompt_length", prompt_len),
        "response_length/clip_ratio": float((response_len == batch["responses"].shape[1]).float().mean()),
    }
    if use_critic:
        metrics.update(_stats("critic/values", batch["values"][mask]))
    return metrics


def compute_agent_metrics(batch: Batch) -> dict[str, float]:
    """A multi-turn rollout's turns, tool calls, their errors, timeouts and latency, how samples
    ended, and the share of response tokens masked out of the loss (tool and user turns)."""
    if "agent_num_turns" not in batch.tensor_keys:
        return {}
    turns, calls = batch["agent_num_turns"].float(), batch["agent_tool_calls"].float()
    n_calls = float(calls.sum())
    valid = batch["attention_mask"][:, -batch["responses"].shape[1] :].float()
    out = {
        "num_turns/mean": float(turns.mean()),
        "num_turns/min": float(turns.min()),
        "num_turns/max": float(turns.max()),
        "tool_calls/mean": float(calls.mean()),
        "tool_calls/max": float(calls.max()),
        "tool_calls/error_rate": float(batch["agent_tool_errors"].sum()) / max(n_calls, 1.0),
        "tool_calls/timeout_rate": float(batch["agent_tool_timeouts"].sum()) / max(n_calls, 1.0),
        "tool_calls/latency_s": float(batch["agent_tool_seconds"].sum()) / max(n_calls, 1.0),
        "tool_calls/rate": float((calls > 0).float().mean()),
        "response/masked_token_share": 1.0
        - float(batch["response_mask"].float().sum()) / max(float(valid.sum()), 1.0),
    }
    if "agent_end" in batch.non_tensor_keys:
        ends = list(batch["agent_end"])
        for reason in ("stop", "length", "max_turns", "tool_error"):
            out[f"agent/end_{reason}"] = ends.count(reason) / max(len(ends), 1)
    return out


def compute_rollout_mismatch_metrics(batch: Batch) -> dict[str, float]:
    """How far the rollout engine's log-probs of the sampled tokens are from the actor's.

    ``rollout_log_probs`` (vLLM's, raw) and ``old_log_probs`` (the Megatron actor's, same
    weights) should agree; the gap is kernel and precision noise in fp32, a few 1e-3 in bf16,
    and larger when something is wrong (stale weights, a different MoE routing, a bad
    conversion). ``training/rollout_probs_diff_mean``/``_max``: |p_rollout - p_actor| over
    response tokens; ``training/rollout_actor_kl``: the k3 estimate of KL(rollout || actor)
    per token, averaged (0 when they agree).
    """
    if "rollout_log_probs" not in batch.tensor_keys or "old_log_probs" not in batch.tensor_keys:
        return {}
    mask = batch["response_mask"].bool()
    if not mask.any():
        return {}
    rollout, actor = batch["rollout_log_probs"][mask].double(), batch["old_log_probs"][mask].double()
    diff = (rollout.exp() - actor.exp()).abs()
    log_ratio = actor - rollout  # log(p_actor / p_rollout), under samples from the rollout
    kl = (log_ratio.exp() - 1 - log_ratio).mean()  # k3: unbiased, >= 0
    return {
        "training/rollout_probs_diff_mean": float(diff.mean()),
        "training/rollout_probs_diff_max": float(diff.max()),
        "training/rollout_actor_kl": float(kl),
    }


def mean_over_ranks(results: list[dict[str, float]]) -> dict[str, float]:
    """Average per-DP-rank metric dicts (each rank reports means over its own data)."""
    keys = sorted({k for r in results for k in r})
    return {k: sum(r[k] for r in results if k in r) / sum(1 for r in results if k in r) for k in keys}


@functools.cache
def peak_flops_per_device() -> float:
    """Dense bf16 peak of this device (known GPUs), or a measured fp32 matmul rate on CPU."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, flops in (
            ("H200", 989e12),
            ("H100", 989e12),
            ("A100", 312e12),
            ("L40", 181e12),
            ("A10", 125e12),
            ("V100", 125e12),
        ):
            if key in name:
                return flops
        return 100e12
    a = torch.randn(512, 512)
    torch.mm(a, a)
    start = time.perf_counter()
    reps = 20
    for _ in range(reps):
        torch.mm(a, a)
    return 2 * 512**3 * reps / (time.perf_counter() - start)


def compute_perf_metrics(
    batch: Batch,
    step_seconds: float,
    world_size: int,
    n_params: int,
    ppo_epochs: int,
    use_critic: bool,
    use_ref: bool,
) -> dict[str, float]:
    """Tokens per second per device, and model FLOPs utilisation.

    FLOPs use the 2N-per-token rule for a forward pass (6N with backward):
    generation (2N per response token), old log-prob and reference passes
    (2N each per token), the critic's value pass and update, and the actor's
    update (6N x epochs). Attention's sequence-quadratic term is left out, as
    is usual for short RL sequences.
    """
    tokens = float(batch["attention_mask"].sum())
    response_tokens = float(batch["response_mask"].sum())
    forward_passes = 1 + int(use_ref) + (1 + 3 * ppo_epochs if use_critic else 0)
    flops = n_params * (2 * response_tokens + 2 * tokens * forward_passes + 6 * tokens * ppo_epochs)
    return {
        "perf/total_num_tokens": tokens,
        "perf/throughput": tokens / step_seconds / world_size,
        "perf/mfu": flops / step_seconds / world_size / peak_flops_per_device(),
    }
