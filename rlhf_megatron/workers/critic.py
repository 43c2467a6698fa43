"""The critic (value model) and the reward model: Megatron models with a one-output head.

Both reuse ``MegatronRoleWorker``/``MegatronEngine``; only the head and the
loss differ.

- ``CriticWorker``: ``compute_values`` gives ``values`` [B, R], the value of
  the state before each response token (position ``t`` of the response is
  predicted from the hidden state at ``t - 1``, as for log-probs);
  ``update_critic`` minimises the clipped value loss over PPO epochs and
  mini-batches with its own optimizer.
- ``RewardModelWorker``: a scalar head that scores the last valid token;
  the score goes on the last response token of ``token_level_scores``. When
  the reward model has its own tokenizer (``reward_model.model.input_tokenizer``
  names the actor's), prompts and responses are decoded and re-templated for
  it first.
"""

from __future__ import annotations

import os

import torch

from rlhf_megatron.algorithms import compute_value_loss
from rlhf_megatron.config.schema import CriticConfig, RewardModelConfig
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.platform.faults import fault_point
from rlhf_megatron.rewards.manager import response_lengths
from rlhf_megatron.scheduling.dispatch import Dispatch, dispatch
from rlhf_megatron.workers.megatron_engine import MODEL_KEYS, MegatronEngine, pad_responses, response_outputs
from rlhf_megatron.workers.role import MegatronRoleWorker


def _response_values(values: torch.Tensor, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """(b, S) per-position values -> (b, R) values of the states that emit each response token
    (zeros past the response columns the model saw, see ``trim_padding``)."""
    return pad_responses(response_outputs(values, micro).float(), micro)


class CriticWorker(MegatronRoleWorker):
    """``init_model``, ``compute_values``, ``update_critic``."""

    section: CriticConfig

    def init_model(self) -> None:
        critic = self.section
        parallel = self.setup_parallel(critic.megatron)
        self.path = os.path.expanduser(critic.model.path)
        arch = self.load_arch(self.path, "value")
        self.critic = MegatronEngine(
            arch,
            parallel,
            self.path,
            critic.megatron,
            critic.optim,
            total_steps=self.context.total_steps,
            variable_seq_lengths=critic.use_dynamic_bsz and parallel.pipeline_model_parallel_size > 1,
            pack_prompts=bool(critic.model.shared_prompt_packing),
        )
        self.engines = {"critic": self.critic}

    @dispatch(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: Batch) -> Batch | None:
        """``values`` [B, R]: the value of the state before each response token."""
        critic = self.section

        def values_fn(values, micro):
            # zero past each response's end whatever the micro-batch's width was, as verl's critic gives them
            return {"values": (_response_values(values, micro) * micro["response_mask"]).detach()}

        out = self.forward_rows(
            self.critic,
            batch,
            values_fn,
            critic.forward_micro_batch_size_per_gpu or critic.ppo_micro_batch_size_per_gpu,
            critic.forward_max_token_len_per_gpu if critic.use_dynamic_bsz else None,
            extra_keys=("responses", "response_mask"),
        )
        return None if out is None else Batch.from_dict({"values": out["values"]})

    @dispatch(Dispatch.DP_COMPUTE)
    def update_critic(self, batch: Batch, step: int = 0) -> dict[str, float]:
        """PPO epochs x mini-batches of the clipped value loss; averaged metrics (on output ranks)."""
        critic = self.section
        fault_point("critic.update", step=self.updates + 1, rank=self.rank, batch=batch)

        def loss_fn(values, micro):
            vpreds = _response_values(values, micro)
            mask = micro["response_mask"].float()
            vf_loss, clipfrac = compute_value_loss(
                vpreds, micro["returns"], micro["values"], mask, critic.cliprange_value, critic.loss_agg_mode
            )
            metrics = {
                "critic/vf_loss": float(vf_loss),
                "critic/vf_clipfrac": float(clipfrac),
                "critic/vpred_mean": float((vpreds * mask).sum() / mask.sum().clamp(min=1)),
            }
            return vf_loss * micro["_weight"], metrics

        keys = (*MODEL_KEYS, "responses", "response_mask", "values", "returns")
        return self.train_ppo_epochs(self.critic, batch, keys, loss_fn, critic, step)


class RewardModelWorker(MegatronRoleWorker):
    """``init_model``, ``compute_rm_score``: a Megatron scalar-head reward model."""

    section: RewardModelConfig

    def init_model(self) -> None:
        from transformers import AutoTokenizer

        rm = self.section
        parallel = self.setup_parallel(rm.megatron)
        self.path = os.path.expanduser(rm.model.path)
        arch = self.load_arch(self.path, "reward", rm.model.override_config)
        self.rm = MegatronEngine(arch, parallel, self.path, rm.megatron)
        self.engines = {"reward_model": self.rm}
        self.rm_tokenizer = AutoTokenizer.from_pretrained(self.path)
        source = rm.model.input_tokenizer
        self.input_tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(source)) if source else None
        self.retemplate = self.input_tokenizer is not None and (
            self.input_tokenizer.get_vocab() != self.rm_tokenizer.get_vocab()
        )

    def _retemplated(self, batch: Batch) -> Batch:
        """Decode with the actor's tokenizer, re-apply the RM's chat template, re-tokenize (left-padded)."""
        tok_in, tok_rm = self.input_tokenizer, self.rm_tokenizer
        rows = []
        for i in range(len(batch)):
            prompt_mask = batch["attention_mask"][i, : batch["prompts"].shape[1]].bool()
            prompt = tok_in.decode(batch["prompts"][i][prompt_mask], skip_special_tokens=True)
            resp_mask = batch["response_mask"][i].bool()
            response = tok_in.decode(batch["responses"][i][resp_mask], skip_special_tokens=True)
            if "raw_prompt" in batch.non_tensor_keys:
                messages = list(batch["raw_prompt"][i])
            else:
                messages = [{"role": "user", "content": prompt}]
            chat = [*messages, {"role": "assistant", "content": response}]
            text = tok_rm.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
            rows.append(tok_rm(text, add_special_tokens=False).input_ids)
        max_len = self.section.max_length or max(len(r) for r in rows)
        ids = torch.full((len(rows), max_len), tok_rm.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            r = r[-max_len:]
            ids[i, max_len - len(r) :] = torch.as_tensor(r)
            mask[i, max_len - len(r) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return Batch.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos})

    @dispatch(Dispatch.DP_COMPUTE)
    def compute_rm_score(self, batch: Batch) -> Batch | None:
        """``rm_scores`` [B, R]: the reward model's score on the last response token."""
        rm = self.section
        inputs = self._retemplated(batch) if self.retemplate else batch

        def last_token_score(values, micro):
            last = micro["attention_mask"].long().cumsum(-1).argmax(-1)  # index of the last real token
            return {"score": values.float().gather(1, last[:, None]).squeeze(1).detach()}

        max_tokens = rm.forward_max_token_len_per_gpu if rm.use_dynamic_bsz else None
        out = self.forward_rows(self.rm, inputs, last_token_score, rm.micro_batch_size_per_gpu, max_tokens)
        if out is None:
            return None
        scores = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        # The last token the policy sampled (a multi-turn response's mask has holes: tool turns).
        last_resp = (response_lengths(batch) - 1).clamp(min=0)
        scores[torch.arange(len(batch)), last_resp] = out["score"]
        return Batch.from_dict({"rm_scores": scores})
