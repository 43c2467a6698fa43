"""The reward interface (`RewardFn` → `RewardResult`) and the rule-based `RewardManager`.

Any reward source, rule-based or a reward-model worker, is a `RewardFn`: it takes a `Batch`
of rollouts and returns ``token_level_scores`` ``[B, R]`` plus metrics, so the trainer does not
care which one it holds.

`RewardManager` decodes each response (``responses`` ``[B, R]``, valid tokens from
``response_mask`` or the response part of ``attention_mask``, special tokens skipped), scores it
with ``compute_score(data_source=, solution_str=, ground_truth=, extra_info=)`` and puts the
score on the last valid response token (of a multi-turn trajectory: the last token the policy
sampled, plus its tools' and interactions' rewards, ``tool_rewards``, as verl adds them). A scorer
may return a float or a dict with ``"score"``
plus extra values (logged as metrics and returned per row in ``RewardResult.extra``). EasyR1's
scorers return ``{"overall", "format", "accuracy"}`` without ``"score"``: ``overall`` is then
the score, and the batch means of those three are logged as ``reward/overall``,
``reward/format`` and ``reward/accuracy`` (EasyR1's metric names).

DAPO's overlong shaping (``overlong``: ``reward_model.overlong_buffer`` with
``reward_manager=dapo``): ``overlong_penalty`` of each response's length is added to its score.

Failure policy (``on_error``): 'raise' turns a scorer exception, a NaN/inf score or a timeout
into an error naming the function, row and data source; 'zero' scores such rows 0.0 and counts
them in ``reward/errors`` and ``reward/timeouts``. Timeouts need ``num_workers > 0``: a
stuck function can only be stopped by killing the process that runs it (see `pool`).

Boundaries: needs a tokenizer and a `Batch`; no Ray, Megatron or model code.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import pickle
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlhf_megatron.choices import OnError
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.rewards.pool import Outcome, ScoringPool
from rlhf_megatron.rewards.registry import default_compute_score

logger = logging.getLogger(__name__)

__all__ = [
    "OverlongBuffer",
    "RewardFn",
    "RewardFunctionError",
    "RewardManager",
    "RewardResult",
    "overlong_penalty",
    "response_lengths",
]

# EasyR1's score parts: logged as batch means under reward/<key> when a scorer returns them.
EASYR1_SCORE_KEYS = ("overall", "format", "accuracy")


@dataclass(frozen=True)
class OverlongBuffer:
    """DAPO's soft overlong punishment: the last ``length`` of ``max_response_length`` tokens
    cost up to ``penalty_factor``; ``log`` adds its metrics."""

    length: int
    penalty_factor: float
    max_response_length: int
    log: bool = False


def overlong_penalty(response_length: int, buffer: OverlongBuffer) -> float:
    """``min(0, -(length - (max_response_length - buffer)) / buffer * penalty_factor)``: 0 up to the
    buffer's start, falling linearly to ``-penalty_factor`` at ``max_response_length`` (verl's DAPO)."""
    expected = buffer.max_response_length - buffer.length
    return min(-(response_length - expected) / buffer.length * buffer.penalty_factor, 0.0)


@dataclass
class RewardResult:
    """Output of a `RewardFn`."""

    token_level_scores: torch.Tensor
    """[B, R] float32; rule-based rewards put the sequence score on the last valid response token."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Scalars to log, e.g. ``reward/<data_source>/mean``."""
    extra: dict[str, list] = field(default_factory=dict)
    """Per-row values (length B) returned by the scorer besides the score; None where absent."""


class RewardFn(ABC):
    """Anything that turns a batch of rollouts into token-level scores."""

    @abstractmethod
    def __call__(self, batch: Batch) -> RewardResult: ...


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something that is not a score."""


def response_lengths(batch: Batch) -> torch.Tensor:
    """[B] number of tokens up to and including the last valid response token."""
    responses = batch["responses"]
    if "response_mask" in batch.tensor_keys:
        mask = batch["response_mask"]
    elif "attention_mask" in batch.tensor_keys:
        mask = batch["attention_mask"][:, -responses.shape[1] :]
    else:
        raise KeyError(
            "response_lengths: the batch needs 'response_mask' or 'attention_mask' to find where responses end; "
            f"tensors are {batch.tensor_keys}."
        )
    positions = torch.arange(1, responses.shape[1] + 1, device=mask.device)
    # Last valid position rather than a count: a mask may have holes (e.g. tool-output tokens).
    return ((mask != 0).long() * positions).max(dim=-1).values


def _function_name(fn: Callable) -> str:
    if isinstance(fn, functools.partial):
        return f"partial({_function_name(fn.func)})"
    if hasattr(fn, "__qualname__") and hasattr(fn, "__module__"):
        return f"{fn.__module__}.{fn.__qualname__}"
    return repr(fn)


class RewardManager(RewardFn):
    """Rule-based (or custom-function) rewards for a batch of rollouts; see the module docstring."""

    def __init__(
        self,
        tokenizer: Any,
        compute_score: Callable[..., Any] | None = None,
        num_examine: int = 1,
        reward_fn_key: str = "data_source",
        on_error: str = "raise",
        timeout_s: float | None = None,
        num_workers: int = 0,
        overlong: OverlongBuffer | None = None,
    ):
        if on_error not in OnError.values():
            allowed = " or ".join(repr(v) for v in OnError.values())
            raise ValueError(f"RewardManager: on_error must be {allowed}, got {on_error!r}.")
        if timeout_s is not None and num_workers <= 0:
            raise ValueError(
                f"RewardManager: timeout_s={timeout_s} needs num_workers >= 1; a stuck reward function can only be "
                "stopped by killing the worker process that runs it."
            )
        self.tokenizer = tokenizer
        self.compute_score = compute_score if compute_score is not None else default_compute_score
        self.fn_name = _function_name(self.compute_score)
        self.num_examine = num_examine
        self.reward_fn_key = reward_fn_key
        self.on_error = on_error
        self.timeout_s = timeout_s
        self.overlong = overlong
        self._pool: ScoringPool | None = None
        if num_workers > 0:
            try:
                pickle.dumps(self.compute_score)
            except Exception as err:
                raise TypeError(
                    f"RewardManager: reward function {self.fn_name} cannot be pickled to send it to "
                    "num_workers scoring processes; define it at module level in a file and load it with "
                    "load_custom_reward_fn (custom_reward_function.path/name), or use num_workers=0."
                ) from err
            self._pool = ScoringPool(self.compute_score, num_workers, timeout_s)

    def close(self) -> None:
        """Stop the scoring processes, if any."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            # Best effort: at interpreter exit, modules the pool needs may already be gone.
            with contextlib.suppress(Exception):
                pool.close()

    # ------------------------------------------------------------------ inputs
    def _inputs(self, batch: Batch, lengths: torch.Tensor) -> list[dict]:
        for key in (self.reward_fn_key, "reward_model"):
            if key not in batch.non_tensor_keys:
                raise KeyError(
                    f"RewardManager: the batch has no non-tensor column '{key}'; columns are {batch.non_tensor_keys}."
                )
        responses = batch["responses"]
        texts = self.tokenizer.batch_decode(
            [responses[i, : int(n)].tolist() for i, n in enumerate(lengths)], skip_special_tokens=True
        )
        extra_infos = batch["extra_info"] if "extra_info" in batch.non_tensor_keys else [None] * len(batch)
        inputs = []
        for i, text in enumerate(texts):
            reward_model = batch["reward_model"][i]
            if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
                raise KeyError(
                    f"RewardManager: row {i}: 'reward_model' must be a dict with 'ground_truth', got {reward_model!r:.200}."
                )
            inputs.append(
                {
                    "data_source": batch[self.reward_fn_key][i],
                    "solution_str": text,
                    "ground_truth": reward_model["ground_truth"],
                    "extra_info": extra_infos[i],
                }
            )
        return inputs

    def _outcomes(self, inputs: list[dict]) -> list[Outcome]:
        if self._pool is not None:
            return self._pool.map(inputs)
        outcomes = []
        for kwargs in inputs:
            try:
                outcomes.append(Outcome("ok", value=self.compute_score(**kwargs)))
            except Exception as err:
                outcomes.append(Outcome("error", error=err))
        return outcomes

    # ------------------------------------------------------------------ scoring
    def _to_score(self, outcome: Outcome, row: int, source: str) -> tuple[float, dict]:
        """The float score and extras of one row, or an exception describing what went wrong."""
        where = f"row {row} (data_source={source!r})"
        if outcome.status == "timeout":
            raise TimeoutError(
                f"RewardManager: reward function {self.fn_name} took more than {self.timeout_s} s on {where}; "
                "its worker process was killed. Raise timeout_s or fix the function."
            )
        if outcome.status == "error":
            raise RewardFunctionError(
                f"RewardManager: reward function {self.fn_name} raised on {where}: "
                f"{type(outcome.error).__name__}: {outcome.error}"
            ) from outcome.error
        value, extras = outcome.value, {}
        if isinstance(value, Mapping):
            # "overall" is EasyR1's name for the score; it stays among the extras to be logged.
            key = "score" if "score" in value else "overall" if "overall" in value else None
            if key is None:
                raise RewardFunctionError(
                    f"RewardManager: reward function {self.fn_name} returned a dict without 'score' (or EasyR1's "
                    f"'overall') on {where}: keys {sorted(value)}."
                )
            extras = {k: v for k, v in value.items() if k != "score"}
            value = value[key]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, (bool, int, float, np.integer, np.floating)):
            raise RewardFunctionError(
                f"RewardManager: reward function {self.fn_name} returned {type(value).__name__} on {where}; "
                "expected a number or a dict with a 'score' number."
            )
        score = float(value)
        if not math.isfinite(score):
            raise ValueError(f"RewardManager: reward function {self.fn_name} returned {score} on {where}.")
        return score, extras

    def __call__(self, batch: Batch, return_dict: bool = False) -> RewardResult | dict[str, Any]:
        """Score every row. ``return_dict=True`` gives verl's form: {reward_tensor, reward_extra_info, metrics}."""
        lengths = response_lengths(batch)
        inputs = self._inputs(batch, lengths)
        outcomes = self._outcomes(inputs)

        scores = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        extra: dict[str, list] = {}
        per_source: dict[str, list[float]] = defaultdict(list)
        extras_per_source: dict[tuple[str, str], list[float]] = defaultdict(list)
        errors = timeouts = 0
        penalties: list[float] = []
        for row, (kwargs, outcome) in enumerate(zip(inputs, outcomes)):
            source = str(kwargs["data_source"])
            try:
                score, extras = self._to_score(outcome, row, source)
            except (TimeoutError, RewardFunctionError, ValueError) as err:
                if self.on_error == "raise":
                    raise
                logger.warning("%s Scoring it 0.0 (on_error='zero').", err)
                score, extras = 0.0, {}
                timeouts += outcome.status == "timeout"
                errors += outcome.status != "timeout"
            if self.overlong is not None:
                penalty = overlong_penalty(int(lengths[row]), self.overlong)
                score += penalty
                penalties.append(penalty)
                if self.overlong.log:
                    extras = {**extras, "overlong_reward": penalty, "overlong": penalty < 0}
            # An empty response has no last token; position 0 keeps the score in the row sum
            # (outcome-based estimators) while the response mask hides it from token-level ones.
            scores[row, max(int(lengths[row]) - 1, 0)] = score
            per_source[source].append(score)
            for key, value in extras.items():
                extra.setdefault(key, [None] * len(batch))[row] = value
                if isinstance(value, (bool, int, float, np.integer, np.floating)) and math.isfinite(
                    float(value)
                ):
                    extras_per_source[(source, key)].append(float(value))

        metrics: dict[str, float] = {"reward/errors": float(errors), "reward/timeouts": float(timeouts)}
        if penalties and self.overlong.log:
            metrics["reward/overlong_reward/mean"] = float(np.mean(penalties))
            metrics["reward/overlong/mean"] = float(np.mean([p < 0 for p in penalties]))
        if "tool_rewards" in batch.tensor_keys:  # a multi-turn rollout's tools and interactions
            tool = batch["tool_rewards"].float()
            positions = (lengths - 1).clamp(min=0)
            scores[torch.arange(len(batch)), positions] += tool
            metrics["reward/tool_mean"] = float(tool.mean())
        for key in EASYR1_SCORE_KEYS:
            values = [v for (_, k), vs in extras_per_source.items() if k == key for v in vs]
            if values:
                metrics[f"reward/{key}"] = float(np.mean(values))
        for source, values in per_source.items():
            metrics[f"reward/{source}/mean"] = float(np.mean(values))
            metrics[f"reward/{source}/max"] = float(np.max(values))
            metrics[f"reward/{source}/min"] = float(np.min(values))
        for (source, key), values in extras_per_source.items():
            metrics[f"reward/{source}/{key}/mean"] = float(np.mean(values))
        self._examine(batch, inputs, scores.sum(-1))

        if return_dict:
            return {"reward_tensor": scores, "reward_extra_info": extra, "metrics": metrics}
        return RewardResult(scores, metrics, extra)

    def _examine(self, batch: Batch, inputs: list[dict], row_scores: torch.Tensor) -> None:
        """Log up to ``num_examine`` decoded examples per data source."""
        if self.num_examine <= 0:
            return
        shown: dict[str, int] = defaultdict(int)
        for row, kwargs in enumerate(inputs):
            source = str(kwargs["data_source"])
            if shown[source] >= self.num_examine:
                continue
            shown[source] += 1
            prompt = ""
            if "prompts" in batch.tensor_keys:
                ids = batch["prompts"][row]
                if "attention_mask" in batch.tensor_keys:
                    ids = ids[batch["attention_mask"][row, : ids.shape[0]].bool()]
                prompt = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
            logger.info(
                "[%s] prompt: %r\n[%s] response: %r\n[%s] ground_truth: %r\n[%s] score: %s",
                source,
                prompt,
                source,
                kwargs["solution_str"],
                source,
                kwargs["ground_truth"],
                source,
                float(row_scores[row]),
            )
