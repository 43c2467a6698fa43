"""A transformers rollout engine with the vLLM engine's interface (``rollout.name=hf``).

The fallback for models or platforms vLLM can't serve, and a second opinion
in tests. One process holds the whole model; generation is
``model.generate`` on left-padded prompts, and the log-prob of each sampled
token comes from the raw (pre-temperature) logits, as vLLM reports it.
Vision-language checkpoints (a ``vision_config`` in config.json) load as
image-text-to-text models and take each row's ``multi_modal_inputs``; their
M-RoPE positions are the rows' own (``position_ids``, numbered as vLLM and the
trainer number them), pinned into ``generate`` (``_pinned_mrope``): left to
itself transformers would number a prompt as plain text, or, given
``mm_token_type_ids``, number Qwen2.5-VL's clips differently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from rlhf_megatron.config.schema import RolloutConfig
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.data.multimodal import concat_vision_inputs
from rlhf_megatron.planning.model_arch import ModelArch
from rlhf_megatron.rollout.base import (
    RolloutSampling,
    assemble_rollout,
    prompt_token_lists,
    vision_token_bias,
)


class HFEngine:
    """transformers ``generate`` behind the ``RolloutEngine`` interface."""

    def __init__(
        self,
        model_path: str,
        rollout: RolloutConfig,
        *,
        seed: int = 0,
        pad_token_id: int = 0,
        eos_token_id: int | list[int] | None = None,
        trust_remote_code: bool = False,
        **_: Any,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        # fp32 on CPU, where bf16 matmuls are slow and the trainer computes in fp32 anyway.
        dtype = getattr(torch, rollout.dtype) if torch.cuda.is_available() else torch.float32
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.multimodal = getattr(config, "vision_config", None) is not None
        auto = AutoModelForImageTextToText if self.multimodal else AutoModelForCausalLM
        self.model = auto.from_pretrained(model_path, dtype=dtype, trust_remote_code=trust_remote_code).eval()
        if torch.cuda.is_available():
            self.model.cuda()
        self.device = next(self.model.parameters()).device
        self.pad_token_id = pad_token_id
        if eos_token_id is None:
            eos_token_id = self.model.generation_config.eos_token_id
        self.eos_token_ids = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        # As in the vLLM engine: a vision-language policy never emits its image/video markers.
        bias = vision_token_bias(ModelArch.from_hf_dir(model_path))
        self.bad_words_ids = [[token] for token in bias] if bias else None

    @torch.no_grad()
    def generate_sequences(self, prompts: Batch, sampling: RolloutSampling) -> Batch:
        # transformers takes image prompts with every image token spelled out, plus the pixels.
        vision = {}
        if "multi_modal_inputs" in prompts.non_tensor_keys:
            vision = {
                k: v.to(self.device) for k, v in concat_vision_inputs(prompts["multi_modal_inputs"]).items()
            }
        token_lists = prompt_token_lists(prompts, expanded=bool(vision))
        width = max(len(ids) for ids in token_lists)
        ids = torch.full((len(token_lists), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, toks in enumerate(token_lists):
            ids[row, width - len(toks) :] = torch.as_tensor(toks)
            mask[row, width - len(toks) :] = 1
        pinned = contextlib.nullcontext()
        if vision and prompts["position_ids"].dim() == 3:  # M-RoPE: the rows' own positions
            positions = torch.zeros(len(token_lists), 3, width, dtype=torch.long)
            for row, valid in enumerate(prompts["attention_mask"].bool()):
                positions[row, :, width - int(valid.sum()) :] = prompts["position_ids"][row][:, valid]
            pinned = _pinned_mrope(self.model, positions.to(self.device))
        # generate() draws from torch's global RNG; seed it from our own stream so a
        # run is reproducible without disturbing the caller's RNG state.
        state = torch.get_rng_state()
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        else:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator)))
        try:
            with pinned:
                out = self.model.generate(
                    input_ids=ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    max_new_tokens=sampling.response_length,
                    do_sample=not sampling.greedy,
                    temperature=sampling.temperature if not sampling.greedy else None,
                    top_p=sampling.top_p if not sampling.greedy else None,
                    top_k=(sampling.top_k if sampling.top_k > 0 else None) if not sampling.greedy else None,
                    num_return_sequences=sampling.n,
                    pad_token_id=self.pad_token_id,
                    eos_token_id=sorted(self.eos_token_ids) or None,
                    return_dict_in_generate=True,
                    output_logits=True,
                    bad_words_ids=self.bad_words_ids,
                    **vision,
                )
        finally:
            torch.set_rng_state(state)
        new = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()  # (B*n, R', V)
        lps = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        responses, log_probs = [], []
        for row in range(new.shape[0]):
            toks = new[row].tolist()
            end = len(toks)
            for t, tok in enumerate(toks):
                if tok in self.eos_token_ids:
                    end = t + 1
                    break
            responses.append(toks[:end])
            log_probs.append(lps[row, :end].tolist())
        return assemble_rollout(
            prompts, responses, log_probs, sampling.n, sampling.response_length, self.pad_token_id
        )

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in weights:
            if name not in params:
                if name == "lm_head.weight" and self.model.config.tie_word_embeddings:
                    continue  # tied to the embedding, which arrives under its own name
                raise KeyError(f"HFEngine.update_weights: the model has no parameter '{name}'")
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"HFEngine.update_weights: '{name}' has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(params[name].shape)}"
                )
            params[name].copy_(tensor)

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


@contextlib.contextmanager
def _pinned_mrope(model, positions: torch.Tensor):
    """Inside, ``model.generate`` places the prompt at ``positions`` ``[B, 3, W]`` (the left-padded
    prompts' M-RoPE positions; each row repeated as ``num_return_sequences`` repeats the prompts)
    and each generated token one past the previous, as vLLM does.

    transformers' Qwen-VL models build ``[4, B, S]`` position ids (a text row, then the three
    M-RoPE streams) in ``_prepare_position_ids_for_generation`` at the prefill and offset the text
    positions by ``model.model.rope_deltas`` at every later step: the prefill's streams are
    replaced by ``positions``, and the deltas set so the steps continue from each row's last one.
    """
    original = model._prepare_position_ids_for_generation

    def prepare(inputs_tensor, model_kwargs):
        cache = model_kwargs.get("past_key_values")
        if cache is not None and cache.get_seq_length() != 0:
            return original(inputs_tensor, model_kwargs)  # a decoding step: text positions + deltas
        plain = {k: v for k, v in model_kwargs.items() if k != "mm_token_type_ids"}
        ids = original(inputs_tensor, plain)  # [4, B', S]: text positions, the same in every row
        ours = positions.repeat_interleave(ids.shape[1] // positions.shape[0], dim=0)
        ids = torch.cat([ids[:1], ours.transpose(0, 1).to(ids.dtype)], dim=0)
        model.model.rope_deltas = (ours[:, 0, -1] - ids[0, :, -1])[:, None]
        return ids

    model._prepare_position_ids_for_generation = prepare
    try:
        yield
    finally:
        del model._prepare_position_ids_for_generation  # the class's method again
