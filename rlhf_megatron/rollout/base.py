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
``routed_experts``     [B*n, P+R,   (vLLM, when asked: routing replay R3) the experts each
                       L, k]        token went to per layer, -1 where none (``assemble_routes``)
``rollout_unfinished`` [B*n] bool   (partial rollout: a generation interrupted by ``stop``) the
                                    row was cut short and ``continue_sequences`` finishes it
=====================  ===========  ==============================================

Every non-tensor column of the input (``data_source``, ``index``, ...) is
repeated ``n`` times, interleaved, so row ``i*n + j`` belongs to prompt ``i``.

Boundaries: engines know vLLM or transformers, never Megatron. Weights arrive
through ``update_weights(iterator of (hf_name, tensor))`` from ``weights/``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from rlhf_megatron.config.schema import RolloutConfig
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.data.rope_index import extend_positions
from rlhf_megatron.planning.model_arch import ModelArch

UNFINISHED_KEY = "rollout_unfinished"
"""Per-row bool column of an interrupted generation (partial rollout): the response is cut short."""


@dataclass(frozen=True)
class RolloutSampling:
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
    def from_config(
        cls, rollout: RolloutConfig, validate: bool = False, greedy: bool = False, seed: int | None = None
    ) -> RolloutSampling:
        """Training sampling from ``actor_rollout_ref.rollout``; ``validate`` applies ``val_kwargs``,
        ``greedy`` forces one greedy sample per prompt (ReMax's baseline)."""
        source = rollout.val_kwargs if validate else rollout
        common = dict(ignore_eos=rollout.ignore_eos, response_length=rollout.response_length, seed=seed)
        if greedy or not source.do_sample or source.temperature == 0.0:
            # Greedy decoding has one answer per prompt, whatever n says.
            return cls(n=1, temperature=0.0, do_sample=False, **common)
        return cls(
            n=source.n,
            temperature=source.temperature,
            top_k=source.top_k,
            top_p=source.top_p,
            do_sample=True,
            **common,
        )


class RolloutEngine(Protocol):
    """The interface every rollout backend implements (vLLM, transformers)."""

    def generate_sequences(self, prompts: Batch, sampling: RolloutSampling) -> Batch: ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


def prompt_token_lists(prompts: Batch, expanded: bool = False) -> list[list[int]]:
    """Unpadded prompt ids per row: ``raw_prompt_ids`` if present (unless ``expanded``), else
    ``input_ids`` under the mask. For image prompts the two differ: ``raw_prompt_ids`` hold one
    image placeholder per image (what vLLM expands itself), ``input_ids`` one per image token."""
    if "raw_prompt_ids" in prompts.non_tensor_keys and not expanded:
        return [list(map(int, ids)) for ids in prompts["raw_prompt_ids"]]
    ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
    return [row[m].tolist() for row, m in zip(ids, mask)]


def prompt_media(prompts: Batch) -> list[dict] | None:
    """Each row's images and videos as vLLM's ``multi_modal_data`` takes them (``{"image": [PIL,
    ...], "video": [(frames [T, H, W, 3], timing), ...]}``, kinds a row lacks left out; ``{}`` for
    a row with neither), or None for a text-only batch."""
    if "multi_modal_data" not in prompts.non_tensor_keys:
        return None
    return [
        {
            kind: list(items)
            for kind, items in (data or {}).items()
            if kind in ("image", "video") and len(items)
        }
        for data in prompts["multi_modal_data"]
    ]


def vision_token_bias(arch: ModelArch) -> dict[int, float] | None:
    """Sampling bias that keeps a vision-language policy from emitting its image/video markers.

    A response holding ``<|image_pad|>`` would read, in the training forward passes, as a
    placeholder for an image that does not exist (transformers refuses such input too). vLLM's
    reported log-probs are the raw ones (``logprobs_mode=raw_logprobs``), so the bias changes
    what can be sampled, not the log-probs the trainer compares with. None for text models.
    """
    if arch.vision is None:
        return None
    ids = (arch.image_token_id, arch.video_token_id, arch.vision_start_token_id, arch.vision_end_token_id)
    return {i: -100.0 for i in ids if i is not None}  # vLLM's most negative bias


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
    # Responses continue counting from the last prompt position, as transformers' generate
    # does (for M-RoPE's [B, 3, P] positions, in all three streams), so engines and trainer agree.
    positions = extend_positions(expanded["position_ids"], response_length)
    tensors = {
        "prompts": prompt_ids,
        "responses": resp,
        "response_mask": resp_mask,
        "input_ids": torch.cat([prompt_ids, resp], dim=1),
        "attention_mask": torch.cat([prompt_mask, resp_mask], dim=1),
        "position_ids": positions,
        "rollout_log_probs": resp_lp,
    }
    non_tensors = {k: expanded.non_tensors[k] for k in expanded.non_tensor_keys}
    for key in expanded.tensor_keys:
        if key not in tensors and key not in ("input_ids", "attention_mask", "position_ids"):
            tensors[key] = expanded[key]
    return Batch(tensors, non_tensors, dict(prompts.meta_info))


def assemble_routes(
    routes: Sequence[np.ndarray | None],
    prompt_lengths: Sequence[int],
    prompt_width: int,
    response_length: int,
) -> torch.Tensor:
    """Per-sample expert routes from the rollout engine, ``[tokens, L, k]`` each (the prompt's and
    the response's tokens in order, as far as the engine fed them through the model), laid out
    like ``input_ids``: ``[rows, prompt_width + response_length, L, k]`` int16, the prompt
    right-aligned, ``-1`` where a column has no route (padding, the last sampled token).
    ``prompt_lengths`` are per row (prompts already repeated ``n`` times)."""
    if len(routes) != len(prompt_lengths):
        raise ValueError(f"{len(routes)} route arrays for {len(prompt_lengths)} rollout rows")
    shape = next((r.shape[1:] for r in routes if r is not None), None)
    if shape is None:
        raise ValueError("the rollout engine returned no expert routes (is routed-expert capture on?)")
    width = prompt_width + response_length
    out = torch.full((len(routes), width, *shape), -1, dtype=torch.int16)
    for row, (r, length) in enumerate(zip(routes, prompt_lengths)):
        if r is None:
            raise ValueError(f"the rollout engine returned no expert routes for row {row}")
        start = prompt_width - length
        count = min(len(r), width - start)
        out[row, start : start + count] = torch.as_tensor(np.asarray(r[:count]), dtype=torch.int16)
    return out
