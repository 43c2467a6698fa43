"""Schema of ``reward.judge``: an LLM judge, served by vLLM, that scores responses.

Role: declarations and their own checks (``JudgeConfig.validate``), like the other schema
modules; ``schema.RewardConfig`` holds it as ``reward.judge``. The judge itself is
``rewards/judge.py`` (prompts, parsing, retries, metrics) and ``workers/judge.py`` (the engine).

Boundaries: pure Python; imports nothing but the config's own modules.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from typing import Any

from rlhf_megatron.choices import Dtype, JudgeCombine, JudgePlacement

__all__ = ["DEFAULT_JUDGE_TEMPLATE", "JUDGE_TEMPLATE_FIELDS", "JudgeConfig", "template_fields"]

JUDGE_TEMPLATE_FIELDS = ("prompt", "response", "ground_truth")
"""The fields a judge prompt template may use."""

DEFAULT_JUDGE_TEMPLATE = (
    "You are grading a response to a question.\n\n"
    "Question:\n{prompt}\n\n"
    "Reference answer (may be empty):\n{ground_truth}\n\n"
    "Response:\n{response}\n\n"
    "Rate the response from 0 to 10, where 10 is a fully correct and helpful answer. "
    'End your reply with a line of the form "Score: <number>".'
)


def template_fields(template: str) -> set[str]:
    """The ``{field}`` names of a ``str.format`` template (``{{`` and ``}}`` are literal braces)."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


@dataclass
class JudgeConfig:
    """``reward.judge``: score responses with a judge model served by vLLM (a generative reward
    model: verl's GenRM, ROLL's LLM judge). Every row of a step is rendered through
    ``prompt_template``, all rows go to the judge in one batched generation, and a score is read
    from each verdict with ``score_pattern``. Our extension."""

    enable: bool = False
    """Score responses with the judge."""

    model_path: str | None = None
    """The judge model's Hugging Face directory (its tokenizer comes from the same directory).
    Required when enabled."""

    prompt_template: str = DEFAULT_JUDGE_TEMPLATE
    """The judge's prompt, a Python format string with the fields ``{prompt}`` (the policy's
    prompt, decoded without special tokens), ``{response}`` (required) and ``{ground_truth}``
    (``reward_model.ground_truth`` of the row; empty when absent). Write literal braces as ``{{``
    and ``}}``. The default asks for a 0-10 grade ending in ``Score: <number>``."""

    apply_chat_template: bool = True
    """Wrap the rendered prompt as one user message in the judge tokenizer's chat template (with
    the generation prompt); false sends the rendered text as it is."""

    score_pattern: str = r"Score: *([0-9.]+)"
    """Regular expression with exactly one group, searched in the judge's output (the last match
    counts, so a verdict may reason before it concludes); the group must parse as a number. An
    output without a match is an invalid verdict."""

    score_range: list[float] = field(default_factory=lambda: [0.0, 10.0])
    """``[low, high]``: a parsed score outside it is an invalid verdict."""

    normalize: bool = True
    """Map a valid score linearly from ``score_range`` to [0, 1] (false: keep the raw number)."""

    invalid_score: float = 0.0
    """The score of an invalid verdict (no match, not a number, out of range, or a prompt too long
    for ``max_model_len``); such rows are counted in ``reward/judge_invalid``, never raised."""

    max_new_tokens: int = 64
    """Most tokens the judge generates per verdict."""

    temperature: float = 0.0
    """Sampling temperature of the judge; 0 is greedy (deterministic verdicts)."""

    seed: int = 0
    """Sampling seed (row ``i`` of a call samples with ``seed + i``); unused when greedy."""

    placement: JudgePlacement = JudgePlacement.colocated
    """colocated: the engine lives in the driver process (no extra processes; on GPU it takes
    ``gpu_memory_utilization`` of the driver's first GPU, beside the training ranks). pool: a Ray
    worker group on a resource pool of its own (``tensor_parallel_size`` processes, one GPU each on
    GPU), started with the run and shut down at its end."""

    tensor_parallel_size: int = 1
    """vLLM tensor parallel size of the judge; with ``placement=pool`` also the pool's process
    count. Colocated judges run one process (1)."""

    dtype: Dtype = Dtype.bfloat16
    """Weight dtype inside vLLM (float32 on CPU, whatever is set)."""

    gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory the judge's vLLM may use (GPU only)."""

    max_model_len: int = 4096
    """The judge's context length: rendered prompt plus ``max_new_tokens``."""

    max_num_seqs: int = 256
    """Verdicts vLLM generates at once; on CPU it also sizes the KV cache."""

    timeout_s: float = 600.0
    """Seconds one batched generation may take. The engine is stepped and checked between steps:
    verdicts unfinished at the deadline are aborted and retried (``max_retries``), then handled by
    ``reward.on_error`` (raise: the step fails naming the judge; zero: ``invalid_score``, counted
    in ``reward/judge_timeouts``)."""

    max_retries: int = 1
    """Further generations for the verdicts a timed-out one left unfinished (counted in
    ``reward/judge_retries``)."""

    combine: JudgeCombine = JudgeCombine.replace
    """replace: the reward is ``weight`` x the judge's score. add: it is the rule-based (or custom
    function's) score plus ``weight`` x the judge's."""

    weight: float = 1.0
    """Multiplies the judge's score."""

    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for ``vllm.LLM``; free-form."""

    def validate(self, key: str = "reward.judge") -> list[str]:
        """A model, a template with ``{response}`` and known fields, a pattern with one group, a
        range, positive sizes and limits. Nothing is checked while disabled."""
        if not self.enable:
            return []
        out = []
        if not self.model_path:
            out.append(f"{key}.model_path is required when {key}.enable=true: the judge model's HF directory")
        try:
            names = template_fields(self.prompt_template)
        except ValueError as err:
            out.append(
                f"{key}.prompt_template is not a valid format string ({err}); write literal braces as {{{{ }}}}"
            )
        else:
            if "response" not in names:
                out.append(
                    f"{key}.prompt_template has no {{response}} field: the judge would never see the response"
                )
            unknown = sorted(names - set(JUDGE_TEMPLATE_FIELDS))
            if unknown:
                out.append(
                    f"{key}.prompt_template uses unknown fields {unknown}; the fields are "
                    f"{list(JUDGE_TEMPLATE_FIELDS)} (write literal braces as {{{{ }}}})"
                )
        try:
            groups = re.compile(self.score_pattern).groups
        except re.error as err:
            out.append(f"{key}.score_pattern={self.score_pattern!r} is not a regular expression: {err}")
        else:
            if groups != 1:
                out.append(
                    f"{key}.score_pattern={self.score_pattern!r} has {groups} groups; it needs exactly one, "
                    r"around the number (e.g. 'Score: *([0-9.]+)')"
                )
        if len(self.score_range) != 2 or not self.score_range[0] < self.score_range[1]:
            out.append(f"{key}.score_range={list(self.score_range)} must be [low, high] with low < high")
        for name in ("max_new_tokens", "tensor_parallel_size", "max_num_seqs"):
            if getattr(self, name) < 1:
                out.append(f"{key}.{name}={getattr(self, name)} must be >= 1")
        if self.max_model_len <= self.max_new_tokens:
            out.append(
                f"{key}.max_model_len={self.max_model_len} leaves no room for a prompt beside "
                f"max_new_tokens={self.max_new_tokens}"
            )
        if self.temperature < 0:
            out.append(f"{key}.temperature={self.temperature} must be >= 0 (0: greedy)")
        if not self.timeout_s > 0:
            out.append(f"{key}.timeout_s={self.timeout_s} must be > 0")
        if self.max_retries < 0:
            out.append(f"{key}.max_retries={self.max_retries} must be >= 0")
        if self.placement == "colocated" and self.tensor_parallel_size != 1:
            out.append(
                f"{key}.tensor_parallel_size={self.tensor_parallel_size} needs {key}.placement=pool: "
                "a colocated judge is one engine in the driver process"
            )
        return out
