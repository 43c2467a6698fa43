"""The worker of the stages before RL: one Megatron model, trained with the stage's loss.

``StageWorker`` is a ``MegatronRoleWorker`` like the actor and the critic, so a stage gets the
same engine (layouts, DDP, the distributed optimizer, NaN policy), checkpoints and process
placement. Two losses:

- SFT (``kind="sft"``, an LM head, saved as ``actor``): next-token cross-entropy on the tokens
  ``loss_mask`` marks, averaged over every such token of the optimizer step's whole batch, all
  data-parallel ranks together (the driver passes the step's count as ``loss_tokens``). A packed
  row's first token of a segment is never predicted from the segment before it. A
  vision-language model's rows bring their images (``multi_modal_inputs``) and M-RoPE
  ``position_ids`` [B, 3, S]: ``split_micro_batches`` hands each micro-batch its rows' images and
  the engine's forward runs the vision tower, exactly as for the RL actor.
- Reward model (``kind="rm"``, a one-output head, saved as ``reward_model``): Bradley-Terry on
  the scores at each row's last token, rows being (chosen, rejected) pairs
  (``algorithms.bradley_terry_loss``), averaged over the step's pairs.

Either way the checkpoint is the role's usual ``<step>/<name>/model`` (dist-checkpoint): an SFT
checkpoint loads as an RL run's actor and both export to Hugging Face (``convert mcore-to-hf``;
the reward model as ``*ForSequenceClassification``, the layout the RL reward-model worker reads).
"""

from __future__ import annotations

import os

import torch

from rlhf_megatron.algorithms import bradley_terry_loss
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.models.forward import vocab_parallel_log_probs
from rlhf_megatron.scheduling.dispatch import Dispatch, dispatch
from rlhf_megatron.workers.megatron_engine import MODEL_KEYS, MegatronEngine, split_micro_batches
from rlhf_megatron.workers.role import MegatronRoleWorker

__all__ = ["ENGINE_NAMES", "StageWorker"]

ENGINE_NAMES = {"sft": "actor", "rm": "reward_model"}
"""Where each stage's checkpoint keeps its model: an SFT checkpoint reads as an actor's."""


class StageWorker(MegatronRoleWorker):
    """``init_model``, ``train_batch``, ``eval_batch`` (plus the role's checkpoint calls)."""

    def __init__(self, role, rank, world_size, section, context, env=None, kind: str = "sft"):
        super().__init__(role, rank, world_size, section, context, env)
        self.kind = kind

    def init_model(self) -> None:
        cfg = self.section  # the stage's whole config (SFTConfig / RMConfig)
        parallel = self.setup_parallel(cfg.megatron)
        self.path = os.path.expanduser(cfg.model.partial_pretrain)
        head = "lm" if self.kind == "sft" else "reward"
        arch = self.load_arch(self.path, head, cfg.model.override_config)
        self.model = MegatronEngine(
            arch,
            parallel,
            self.path,
            cfg.megatron,
            cfg.optim,
            total_steps=self.context.total_steps,
            variable_seq_lengths=parallel.pipeline_model_parallel_size > 1,
        )
        self.engines = {ENGINE_NAMES[self.kind]: self.model}

    # ------------------------------------------------------------------ losses
    def _sft_loss(self, scale: float):
        vocab = self.model.arch.vocab_size

        def fn(logits, micro):
            ids = micro["input_ids"]
            # Filler rows only (one token each, trimmed to one column): nothing to predict.
            if ids.shape[1] < 2:
                zero = logits.sum() * 0.0  # a graph for the schedule's backward
                return zero, {"nll_sum": zero.detach(), "tokens": zero.detach()}
            mask = micro["loss_mask"][:, 1:].float()  # token t+1 is predicted at position t
            if "segment_ids" in micro:  # never across a packed row's sample boundary
                seg = micro["segment_ids"]
                mask = mask * (seg[:, 1:] == seg[:, :-1]).float()
            nll = -vocab_parallel_log_probs(logits[:, :-1], ids[:, 1:], vocab).float()
            total = torch.where(mask > 0, nll, 0.0).sum()  # a masked position's value never counts
            return total * scale, {"nll_sum": total.detach(), "tokens": mask.sum().detach()}

        return fn

    def _rm_loss(self, scale: float):
        def fn(values, micro):
            last = micro["attention_mask"].long().cumsum(-1).argmax(-1)  # each row's last token
            scores = values.float().gather(1, last[:, None]).squeeze(1)
            valid = micro["pair_mask"][0::2] > 0  # padding pairs carry pair_mask 0
            chosen, rejected = scores[0::2][valid], scores[1::2][valid]
            n = int(valid.sum())
            if n == 0:  # a micro-batch of padding: no loss, but a graph for the schedule's backward
                zero = scores.sum() * 0.0
                return zero, {"loss_sum": zero.detach(), "pairs": 0.0, "correct": 0.0, "margin_sum": 0.0}
            mean, metrics = bradley_terry_loss(chosen, rejected)
            total = mean * n  # the sum over this micro-batch's pairs
            return total * scale, {
                "loss_sum": total.detach(),
                "pairs": float(n),
                "correct": (metrics["accuracy"] * n).detach(),
                "margin_sum": (metrics["margin"] * n).detach(),
            }

        return fn

    def _loss(self, batch: Batch, n_micro: int, dp: int):
        # megatron divides each micro-batch's loss by the micro-batch count, and DDP averages the
        # gradients over data-parallel ranks: scale both back so the step's loss is the sum over
        # every token (pair) of the global batch divided by their count.
        if self.kind == "sft":
            count = float(batch["loss_tokens"][0])
            return self._sft_loss(n_micro * dp / max(count, 1.0)), ("loss_mask", "segment_ids")
        count = float(batch["loss_pairs"][0])
        return self._rm_loss(n_micro * dp / max(count, 1.0)), ("pair_mask",)

    def _micros(self, batch: Batch, keys: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
        size = self.section.data.micro_batch_size_per_gpu * (2 if self.kind == "rm" else 1)
        present = tuple(k for k in keys if k in batch.tensor_keys)
        return split_micro_batches(batch, (*MODEL_KEYS, *present), size)

    @dispatch(Dispatch.DP_COMPUTE)
    def train_batch(self, batch: Batch) -> dict[str, float] | None:
        """One optimizer step on this rank's rows; sums for the driver's metrics (output ranks)."""
        dp = self.parallel.dp_size
        size = self.section.data.micro_batch_size_per_gpu * (2 if self.kind == "rm" else 1)
        n_micro = -(-len(batch) // size)
        loss_fn, keys = self._loss(batch, n_micro, dp)
        self.updates += 1
        lr = self.model.lr  # the rate this step trains at (the schedule moves on after it)
        result = self.model.train_step(
            self._micros(batch, keys), loss_fn, where=f"[{self.role}] rank {self.rank}"
        )
        return self._sums(result["metrics"], grad_norm=result["grad_norm"], lr=lr)

    @dispatch(Dispatch.DP_COMPUTE)
    def eval_batch(self, batch: Batch) -> dict[str, float] | None:
        """Forward only on this rank's rows: the same sums as ``train_batch``."""
        loss_fn, keys = self._loss(batch, 1, 1)
        collected = self.model.run(self._micros(batch, keys), loss_fn, forward_only=True)
        return self._sums(collected)

    @staticmethod
    def _sums(collected: list[dict], **extra: float) -> dict[str, float] | None:
        if not collected:  # not an output rank (pipeline stage without the loss)
            return None
        keys = [k for k in collected[0] if not k.startswith("_")]
        return {**{k: float(sum(float(c[k]) for c in collected)) for k in keys}, **extra}
