"""An LLM-judge reward: render each rollout into a judge prompt, read a score from the verdict.

`JudgeRewardFn` is a `RewardFn`. Per call (one training step's rollouts, or a validation batch):

1. each row's prompt and response are decoded with the policy's tokenizer, rendered through
   ``reward.judge.prompt_template`` with the row's ``reward_model.ground_truth`` (`render_prompt`),
   and tokenised with the judge's own tokenizer (its chat template unless
   ``apply_chat_template=false``);
2. every row goes to the judge in ONE batched generation (a `JudgeClient`: the vLLM engine in the
   driver or on a Ray pool, ``workers/judge.py``). Rows a generation leaves unfinished at its
   deadline are generated again, up to ``max_retries`` times (`generate_with_retries`);
3. ``score_pattern`` is searched in each verdict (`parse_verdict`). No match, a match that is not
   a number, or a number outside ``score_range`` is an *invalid verdict*: the row scores
   ``invalid_score`` and is counted in ``reward/judge_invalid``. That is the judge's failure to
   follow its instructions, not the policy's, so it never stops training.
4. rows still unfinished after the retries are timeouts: ``reward.on_error=raise`` stops the step
   with an error naming the judge model and the call; ``zero`` scores them ``invalid_score`` and
   counts them in ``reward/judge_timeouts``.

The score sits on the last valid response token, as `RewardManager`'s does; with
``combine=add`` it is added to the rule-based manager's scores.

Metrics: ``reward/judge_invalid``, ``reward/judge_timeouts``, ``reward/judge_retries``,
``reward/judge_too_long`` (prompts past ``max_model_len``; also counted invalid),
``reward/judge_score_mean`` (mean normalised score over valid verdicts; absent when none),
``reward/judge_time_s``.

Boundaries: no vLLM or Ray (the engine is behind `JudgeClient`); needs the policy's tokenizer,
the judge's tokenizer and a `Batch`.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rlhf_megatron.config.schema_reward import JudgeConfig
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.rewards.manager import RewardFn, RewardResult, response_lengths

logger = logging.getLogger(__name__)

__all__ = [
    "JudgeClient",
    "JudgeRewardFn",
    "JudgeTimeoutError",
    "Verdict",
    "deadline_stop",
    "generate_with_retries",
    "parse_verdict",
    "render_prompt",
]


class JudgeClient(Protocol):
    """Where verdicts are generated (``workers/judge.py``: in the driver or on a Ray pool)."""

    model_path: str

    def start(self) -> None:
        """Build the engine (idempotent)."""

    def generate(self, prompts: list[list[int]], timeout_s: float) -> list[list[int] | None]:
        """One batched generation: the verdict's token ids per prompt, None where the deadline
        (``timeout_s`` from the call's start) cut it short."""

    def close(self) -> None:
        """Stop the engine and its processes (idempotent)."""


class JudgeTimeoutError(TimeoutError):
    """Verdicts still unfinished after every retry, with ``reward.on_error=raise``."""


@dataclass(frozen=True)
class Verdict:
    """One judge output, parsed. ``score`` is None for an invalid verdict (``reason`` says why)."""

    text: str
    score: float | None
    raw: float | None = None
    """The number the pattern read, before normalisation."""
    reason: str = ""


def render_prompt(template: str, prompt: str, response: str, ground_truth: Any = None) -> str:
    """The judge prompt of one row (``ground_truth`` None renders as an empty string)."""
    truth = "" if ground_truth is None else str(ground_truth)
    return template.format(prompt=prompt, response=response, ground_truth=truth)


def parse_verdict(
    text: str, pattern: str | re.Pattern, score_range: Sequence[float], normalize: bool = True
) -> Verdict:
    """The score in ``text``: the last match of ``pattern``'s one group, which must be a finite
    number within ``score_range`` (inclusive), mapped to [0, 1] when ``normalize``."""
    regex = re.compile(pattern) if isinstance(pattern, str) else pattern
    matches = list(regex.finditer(text))
    if not matches:
        return Verdict(text, None, reason="no match")
    group = matches[-1].group(1)
    try:
        raw = float(group)
    except (TypeError, ValueError):
        return Verdict(text, None, reason=f"not a number: {group!r}")
    low, high = float(score_range[0]), float(score_range[1])
    if not (math.isfinite(raw) and low <= raw <= high):
        return Verdict(text, None, raw=raw, reason=f"{raw} outside [{low}, {high}]")
    score = (raw - low) / (high - low) if normalize else raw
    return Verdict(text, score, raw=raw)


def deadline_stop(timeout_s: float, clock: Callable[[], float] = time.monotonic) -> Callable[[], bool]:
    """A ``stop()`` for a stepped engine: True once ``timeout_s`` has passed since this call."""
    deadline = clock() + timeout_s
    return lambda: clock() >= deadline


def generate_with_retries(
    generate: Callable[[list[list[int]]], list[list[int] | None]], prompts: list[list[int]], max_retries: int
) -> tuple[list[list[int] | None], int]:
    """``generate`` all ``prompts`` in one batch, then the ones it left unfinished again, up to
    ``max_retries`` more times. Returns (outputs, retries made); None marks a row that never
    finished."""
    outputs: list[list[int] | None] = [None] * len(prompts)
    pending, retries = list(range(len(prompts))), 0
    for attempt in range(max_retries + 1):
        if not pending:
            break
        if attempt:
            retries += 1
            logger.warning(
                "LLM judge: %d verdicts timed out; retry %d of %d", len(pending), attempt, max_retries
            )
        for row, out in zip(pending, generate([prompts[i] for i in pending])):
            outputs[row] = out
        pending = [i for i in pending if outputs[i] is None]
    return outputs, retries


class JudgeRewardFn(RewardFn):
    """Scores rollouts with an LLM judge; see the module docstring."""

    def __init__(
        self,
        config: JudgeConfig,
        client: JudgeClient,
        tokenizer: Any,
        judge_tokenizer: Any,
        on_error: str = "raise",
        base: RewardFn | None = None,
        reward_fn_key: str = "data_source",
    ):
        """``tokenizer``: the policy's (decodes rollouts); ``judge_tokenizer``: the judge's (encodes
        its prompts, decodes verdicts). ``base``: the rule-based reward added to the judge's
        (``combine=add``); None for ``replace``."""
        problems = config.validate()
        if problems:
            raise ValueError("reward.judge: " + "; ".join(problems))
        self.config, self.client = config, client
        self.tokenizer, self.judge_tokenizer = tokenizer, judge_tokenizer
        self.on_error, self.base, self.reward_fn_key = on_error, base, reward_fn_key
        self.pattern = re.compile(config.score_pattern)
        self.calls = 0
        self.last_verdicts: list[Verdict] = []
        """The verdicts of the latest call, in row order (for logs and tests)."""

    def close(self) -> None:
        """Close the base manager; the client is closed by whoever started it (it may be shared)."""
        close = getattr(self.base, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ prompts
    def judge_prompts(self, batch: Batch, lengths: torch.Tensor) -> list[list[int]]:
        """The judge's token ids for every row."""
        responses = batch["responses"]
        texts = self.tokenizer.batch_decode(
            [responses[i, : int(n)].tolist() for i, n in enumerate(lengths)], skip_special_tokens=True
        )
        prompts = self._prompt_texts(batch)
        truths = [
            rm.get("ground_truth") if isinstance(rm, Mapping) else None
            for rm in (
                batch["reward_model"] if "reward_model" in batch.non_tensor_keys else [None] * len(batch)
            )
        ]
        rendered = [
            render_prompt(self.config.prompt_template, p, r, t) for p, r, t in zip(prompts, texts, truths)
        ]
        if self.config.apply_chat_template and getattr(self.judge_tokenizer, "chat_template", None):
            # Rendered as text, then encoded: the template already holds any special tokens.
            rendered = [
                self.judge_tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
                )
                for text in rendered
            ]
        return [self.judge_tokenizer.encode(text, add_special_tokens=False) for text in rendered]

    def _prompt_texts(self, batch: Batch) -> list[str]:
        if "prompts" not in batch.tensor_keys:
            return [""] * len(batch)
        width = batch["prompts"].shape[1]
        ids = batch["prompts"]
        mask = batch["attention_mask"][:, :width].bool() if "attention_mask" in batch.tensor_keys else None
        rows = [ids[i][mask[i]].tolist() if mask is not None else ids[i].tolist() for i in range(len(batch))]
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True)

    # ------------------------------------------------------------------ scoring
    def __call__(self, batch: Batch) -> RewardResult:
        self.calls += 1
        start = time.perf_counter()
        lengths = response_lengths(batch)
        prompts = self.judge_prompts(batch, lengths)
        room = self.config.max_model_len - self.config.max_new_tokens
        fits = [i for i, p in enumerate(prompts) if len(p) <= room]
        outputs: list[list[int] | None] = [None] * len(prompts)
        # One batched generation for every row that fits (a too-long prompt cannot be judged).
        fitted, retries = generate_with_retries(
            lambda rows: self.client.generate(rows, self.config.timeout_s),
            [prompts[i] for i in fits],
            self.config.max_retries,
        )
        for i, out in zip(fits, fitted):
            outputs[i] = out
        timed_out = [i for i in fits if outputs[i] is None]
        if timed_out and self.on_error == "raise":
            step = batch.meta_info.get("global_step")
            where = f"step {step}" if step is not None else f"reward call {self.calls}"
            raise JudgeTimeoutError(
                f"LLM judge {self.client.model_path}: {len(timed_out)} of {len(prompts)} verdicts at {where} did not "
                f"finish within reward.judge.timeout_s={self.config.timeout_s} after {self.config.max_retries} "
                "retries (reward.judge.max_retries). Raise the timeout, lower reward.judge.max_new_tokens, or set "
                "reward.on_error=zero to score such rows reward.judge.invalid_score."
            )
        verdicts = self._verdicts(outputs, set(fits))
        self.last_verdicts = verdicts
        judge = torch.tensor(
            [v.score if v.score is not None else self.config.invalid_score for v in verdicts],
            dtype=torch.float32,
        )
        if self.base is not None:
            result = self.base(batch)
            scores, metrics, extra = (
                result.token_level_scores.clone(),
                dict(result.metrics),
                dict(result.extra),
            )
        else:
            scores, metrics, extra = torch.zeros(batch["responses"].shape, dtype=torch.float32), {}, {}
        rows = torch.arange(len(batch))
        scores[rows, (lengths - 1).clamp(min=0)] += self.config.weight * judge
        valid = [v.score for v in verdicts if v.score is not None]
        invalid = [i for i, v in enumerate(verdicts) if v.score is None and i not in timed_out]
        metrics.update(
            {
                "reward/judge_invalid": float(len(invalid)),
                "reward/judge_timeouts": float(len(timed_out)),
                "reward/judge_retries": float(retries),
                "reward/judge_too_long": float(len(prompts) - len(fits)),
                "reward/judge_time_s": time.perf_counter() - start,
            }
        )
        if valid:
            metrics["reward/judge_score_mean"] = float(sum(valid) / len(valid))
        extra["judge_score"] = [v.score for v in verdicts]
        if invalid:
            first = verdicts[invalid[0]]
            logger.warning(
                "LLM judge %s: %d of %d verdicts invalid (scored %s); e.g. row %d: %s in %r",
                self.client.model_path,
                len(invalid),
                len(verdicts),
                self.config.invalid_score,
                invalid[0],
                first.reason,
                first.text[:200],
            )
        return RewardResult(scores, metrics, extra)

    def _verdicts(self, outputs: list[list[int] | None], fits: set[int]) -> list[Verdict]:
        verdicts = []
        for i, out in enumerate(outputs):
            if i not in fits:
                verdicts.append(Verdict("", None, reason="prompt longer than max_model_len - max_new_tokens"))
            elif out is None:
                verdicts.append(Verdict("", None, reason="timed out"))
            else:
                text = self.judge_tokenizer.decode(out, skip_special_tokens=True)
                verdicts.append(
                    parse_verdict(text, self.pattern, self.config.score_range, self.config.normalize)
                )
        return verdicts
