"""What every rollout engine shares: sampling settings and the output layout.

A rollout engine turns a `Batch` of left-padded prompts into a `Batch` of
``n`` sampled responses per prompt (rows interleaved: prompt 0's samples, then
prompt 1's, ...), in the layout the rest of the trainer expects (see
``rlhf_megatron.data.batch``):

=====================  ===========  ==============================================
``prompts``            [B*n, P]     the left-padded prompt, repeated
``responses``          [B*n, R]     sampled tokens, right-padded with pad_token_id
``response_mask``      [B*n, R]     1 on sampled tokens (EOS included), else 0
``input_ids``          [B*n, P+R]   prompts ++ responses
``attention_mask``     [B*n, P+R]   prompt mask ++ response_mask
``position_ids``       [B*n, P+R]   prompt positions, then last prompt position + 1, 2, ...
``rollout_log_probs``  [B*n, R]     the engine's log-prob of each sampled token
=====================  ===========  ==============================================

Every non-tensor column of the input (``data_source``, ``index``, ...) is
repeated ``n`` times, interleaved, so row ``i*n + j`` belongs to prompt ``i``.

Boundaries: engines know vLLM or transformers, never Megatron. Weights arrive
through ``update_weights(iterator of (hf_name, tensor))`` from ``weights/``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rlhf_megatron.data.batch import Batch


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings for one ``generate_sequences`` call."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    ignore_eos: bool = False
    response_length: int = 512
    seed: int | None = None
    """Per-call sampling seed: prompt ``i`` samples with ``seed + i``. Makes a rollout a pure
    function of (weights, prompts, seed), so a resumed run samples what an uninterrupted one
    would; None leaves the engine's own RNG stream in charge."""

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0

    def __post_init__(self):
        problems = []
        if self.n < 1:
            problems.append(f"n={self.n} must be >= 1")
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1 or self.top_k == 0:
            problems.append(f"top_k={self.top_k} must be -1 (off) or >= 1")
        if self.response_length < 1:
            problems.append(f"response_length={self.response_length} must be >= 1")
        if self.greedy and self.n > 1:
            problems.append(f"greedy decoding (do_sample=False or temperature=0) with n={self.n} > 1")
        if problems:
            raise ValueError("actor_rollout_ref.rollout sampling settings: " + "; ".join(problems))

    @classmethod
    def from_rollout_config(
        cls, rollout_cfg: Any, validate: bool = False, greedy: bool = False, seed: int | None = None
    ) -> SamplingConfig:
        """Training sampling from ``actor_rollout_ref.rollout``; ``validate`` applies ``val_kwargs``,
        ``greedy`` forces one greedy sample per prompt (ReMax's baseline)."""
        base = dict(
            n=int(_get(rollout_cfg, "n", 1)),
            temperature=float(_get(rollout_cfg, "temperature", 1.0)),
            top_k=int(_get(rollout_cfg, "top_k", -1)),
            top_p=float(_get(rollout_cfg, "top_p", 1.0)),
            do_sample=bool(_get(rollout_cfg, "do_sample", True)),
            ignore_eos=bool(_get(rollout_cfg, "ignore_eos", False)),
            response_length=int(_get(rollout_cfg, "response_length", 512)),
        )
        if validate:
            val = _get(rollout_cfg, "val_kwargs", None) or {}
            for key in ("n", "temperature", "top_k", "top_p", "do_sample"):
                value = _get(val, key, None)
                if value is not None:
                    base[key] = type(base[key])(value)
        if greedy or not base["do_sample"] or base["temperature"] == 0.0:
            base.update(do_sample=False, temperature=0.0, n=1)
        return cls(**base, seed=seed)


class RolloutEngine(Protocol):
    """The interface every rollout backend implements (vLLM, transformers)."""

    def generate_sequences(self, prompts: Batch, sampling: SamplingConfig) -> Batch: ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


def prompt_token_lists(prompts: Batch) -> list[list[int]]:
    """Unpadded prompt ids per row: ``raw_prompt_ids`` if present, else ``input_ids`` under the mask."""
    if "raw_prompt_ids" in prompts.non_tensor_keys:
        return [list(map(int, ids)) for ids in prompts["raw_prompt_ids"]]
    ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
    return [row[m].tolist() for row, m in zip(ids, mask)]


def assemble_rollout(
    prompts: Batch,
    responses: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]],
    n: int,
    response_length: int,
    pad_token_id: int,
) -> Batch:
    """Pack per-sample token lists into the padded layout in the module docstring.

    ``responses``/``log_probs`` hold ``len(prompts) * n`` rows, prompt-major.
    """
    rows = len(prompts) * n
    if len(responses) != rows or len(log_probs) != rows:
        raise ValueError(
            f"rollout produced {len(responses)} responses and {len(log_probs)} log-prob rows for "
            f"{len(prompts)} prompts x n={n} = {rows}"
        )
    resp = torch.full((rows, response_length), pad_token_id, dtype=torch.long)
    resp_mask = torch.zeros(rows, response_length, dtype=torch.long)
    resp_lp = torch.zeros(rows, response_length, dtype=torch.float32)
    for i, (tokens, lps) in enumerate(zip(responses, log_probs)):
        length = min(len(tokens), response_length)
        if length:
            resp[i, :length] = torch.as_tensor(list(tokens[:length]), dtype=torch.long)
            resp_lp[i, :length] = torch.as_tensor(list(lps[:length]), dtype=torch.float32)
            resp_mask[i, :length] = 1
    expanded = prompts.repeat(n, interleave=True)
    prompt_ids = expanded["input_ids"]
    prompt_mask = expanded["attention_mask"].long()
    prompt_pos = expanded["position_ids"]
    # Responses continue counting from the last prompt position, padding included,
    # as transformers' generate does, so every engine and the trainer agree.
    last = prompt_pos[:, -1:]
    resp_pos = last + torch.arange(1, response_length + 1, dtype=prompt_pos.dtype).unsqueeze(0)
    tensors = {
        "prompts": prompt_ids,
        "responses": resp,
        "response_mask": resp_mask,
        "input_ids": torch.cat([prompt_ids, resp], dim=1),
        "attention_mask": torch.cat([prompt_mask, resp_mask], dim=1),
        "position_ids": torch.cat([prompt_pos, resp_pos], dim=1),
        "rollout_log_probs": resp_lp,
    }
    non_tensors = {k: expanded.non_tensors[k] for k in expanded.non_tensor_keys}
    for key in expanded.tensor_keys:
        if key not in tensors and key not in ("input_ids", "attention_mask", "position_ids"):
            tensors[key] = expanded[key]
    return Batch(tensors, non_tensors, dict(prompts.meta_info))
