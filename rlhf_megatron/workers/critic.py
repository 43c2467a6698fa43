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
import time

import torch

from rlhf_megatron.algorithms import compute_value_loss
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.workers.faults import fault_requested
from rlhf_megatron.workers.megatron_engine import MODEL_KEYS, MegatronEngine
from rlhf_megatron.workers.role import MegatronRoleWorker


def _response_values(values: torch.Tensor, response_len: int) -> torch.Tensor:
    """(b, P+R) per-position values -> (b, R) values of the states that emit each response token."""
    return values[:, -response_len - 1 : -1]


class CriticWorker(MegatronRoleWorker):
    """``init_model``, ``compute_values``, ``update_critic``."""

    def init_model(self, total_steps: int = 1) -> None:
        critic = self.cfg.critic
        parallel = self.setup_parallel(critic.megatron)
        self.path = os.path.expanduser(critic.model.path)
        arch = self.load_arch(self.path, "value")
        self.critic = MegatronEngine(
            arch, parallel, self.path, train=True, optim_cfg=critic.optim, megatron_cfg=critic.megatron,
            params_dtype=self.params_dtype(critic.megatron), total_steps=total_steps,
            variable_seq_lengths=bool(critic.use_dynamic_bsz) and parallel.pipeline_model_parallel_size > 1,
        )  # fmt: skip
        self.engines = {"critic": self.critic}
        self.update_count = 0

    def model_path(self, engine_name: str) -> str:
        return self.path

    def compute_values(self, batch: Batch) -> Batch | None:
        critic = self.cfg.critic
        start = time.perf_counter()
        out = self.forward_rows(
            self.critic, batch,
            lambda values, micro: {"values": _response_values(values, micro["responses"].shape[1]).float().detach()},
            critic.forward_micro_batch_size_per_gpu or critic.ppo_micro_batch_size_per_gpu,
            int(critic.forward_max_token_len_per_gpu) if critic.use_dynamic_bsz else None,
            extra_keys=("responses",),
        )  # fmt: skip
        if out is None:
            return None
        result = Batch.from_dict({"values": out["values"]})
        result.meta_info["timing_s/values"] = time.perf_counter() - start
        return result

    def update_critic(self, batch: Batch, step: int = 0) -> dict[str, float]:
        critic = self.cfg.critic
        start = time.perf_counter()
        mode, clip = str(critic.loss_agg_mode), float(critic.cliprange_value)
        if fault_requested("critic_nan", self.update_count + 1, self.rank):  # test hook (RLHF_FAULT)
            batch["returns"] = torch.full_like(batch["returns"], float("inf"))

        def loss_fn(values, micro):
            vpreds = _response_values(values, micro["responses"].shape[1]).float()
            mask = micro["response_mask"].float()
            vf_loss, clipfrac = compute_value_loss(
                vpreds, micro["returns"], micro["values"], mask, clip, mode
            )
            metrics = {"critic/vf_loss": float(vf_loss), "critic/vf_clipfrac": float(clipfrac),
                       "critic/vpred_mean": float((vpreds * mask).sum() / mask.sum().clamp(min=1))}  # fmt: skip
            return vf_loss * micro["_weight"], metrics

        keys = (*MODEL_KEYS, "responses", "response_mask", "values", "returns")
        seed = int(self.cfg.trainer.seed) * 1000033 + step
        metrics = self.train_ppo_epochs(self.critic, batch, keys, loss_fn, critic, step, seed)
        self.update_count += 1
        metrics["timing_s/update_critic"] = time.perf_counter() - start
        return metrics


class RewardModelWorker(MegatronRoleWorker):
    """``init_model``, ``compute_rm_score``: a Megatron scalar-head reward model."""

    def init_model(self) -> None:
        rm = self.cfg.reward_model
        parallel = self.setup_parallel(rm.megatron)
        self.path = os.path.expanduser(rm.model.path)
        arch = self.load_arch(self.path, "reward")
        self.rm = MegatronEngine(arch, parallel, self.path, train=False, megatron_cfg=rm.megatron,
                                 params_dtype=self.params_dtype(rm.megatron))  # fmt: skip
        self.engines = {"reward_model": self.rm}
        from transformers import AutoTokenizer

        self.rm_tokenizer = AutoTokenizer.from_pretrained(self.path)
        source = rm.model.input_tokenizer
        self.input_tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(source)) if source else None
        self.retemplate = self.input_tokenizer is not None and (
            self.input_tokenizer.get_vocab() != self.rm_tokenizer.get_vocab()
        )

    def model_path(self, engine_name: str) -> str:
        return self.path

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
        max_len = int(self.cfg.reward_model.max_length or max(len(r) for r in rows))
        ids = torch.full((len(rows), max_len), int(tok_rm.pad_token_id or 0), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            r = r[-max_len:]
            ids[i, max_len - len(r) :] = torch.as_tensor(r)
            mask[i, max_len - len(r) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return Batch.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos})

    def compute_rm_score(self, batch: Batch) -> Batch | None:
        start = time.perf_counter()
        rm = self.cfg.reward_model
        inputs = self._retemplated(batch) if self.retemplate else batch

        def last_token_score(values, micro):
            last = micro["attention_mask"].long().cumsum(-1).argmax(-1)  # index of the last real token
            return {"score": values.float().gather(1, last[:, None]).squeeze(1).detach()}

        out = self.forward_rows(self.rm, inputs, last_token_score, rm.micro_batch_size_per_gpu,
                                int(rm.forward_max_token_len_per_gpu) if rm.use_dynamic_bsz else None)  # fmt: skip
        if out is None:
            return None
        scores = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        last_resp = (batch["response_mask"].sum(-1) - 1).clamp(min=0)
        scores[torch.arange(len(batch)), last_resp] = out["score"]
        result = Batch.from_dict({"rm_scores": scores})
        result.meta_info["timing_s/reward_model"] = time.perf_counter() - start
        return result
