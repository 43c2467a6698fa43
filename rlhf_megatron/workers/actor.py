"""The hybrid actor + rollout + reference worker: one process per device, three jobs.

Per process: the Megatron actor (trained), optionally the Megatron reference
policy (frozen, same layout), and the rollout engine (vLLM colocated, or the
transformers fallback). After every actor update the weights are marked
stale; the next ``generate_sequences`` streams them into the rollout engine
through the weight converter (``rlhf_megatron.weights``) first.

Dispatch layouts: ``megatron`` (data-parallel rank of the actor) for log-
probs and updates; ``rollout`` (data-parallel rank of the rollout engine:
consecutive groups of ``rollout.tensor_model_parallel_size`` ranks share one
engine and receive the same prompts) for generation.
"""

from __future__ import annotations

import os
import time

import torch

from rlhf_megatron.algorithms import agg_loss, get_policy_loss_fn, kl_penalty
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.models.forward import vocab_parallel_entropy, vocab_parallel_log_probs
from rlhf_megatron.platform import ParallelGroups
from rlhf_megatron.rollout import SamplingConfig, build_rollout_engine
from rlhf_megatron.weights import CollectiveTransport, TrainLayout, WeightSyncer, build_sync_plan
from rlhf_megatron.workers.faults import fault_amount, fault_requested, kill_self_if_requested
from rlhf_megatron.workers.megatron_engine import MODEL_KEYS, MegatronEngine
from rlhf_megatron.workers.role import MegatronRoleWorker

UPDATE_KEYS = ("responses", "response_mask", "old_log_probs", "advantages")


class ActorRolloutRefWorker(MegatronRoleWorker):
    """``init_model``, ``generate_sequences``, ``compute_log_prob``, ``compute_ref_log_prob``, ``update_actor``."""

    def init_model(self, need_ref: bool = True, total_steps: int = 1) -> None:
        arc = self.cfg.actor_rollout_ref
        parallel = self.setup_parallel(arc.actor.megatron)
        self.path = os.path.expanduser(arc.model.path)
        self.arch = self.load_arch(self.path, "lm")
        dtype = self.params_dtype(arc.actor.megatron)
        self.actor = MegatronEngine(
            self.arch, parallel, self.path, train=True, optim_cfg=arc.actor.optim, megatron_cfg=arc.actor.megatron,
            params_dtype=dtype, total_steps=total_steps,
            variable_seq_lengths=bool(arc.actor.use_dynamic_bsz) and parallel.pipeline_model_parallel_size > 1,
        )  # fmt: skip
        self.engines = {"actor": self.actor}
        self.ref = (
            MegatronEngine(
                self.arch, parallel, self.path, train=False, megatron_cfg=arc.ref.megatron, params_dtype=dtype
            )  # fmt: skip
            if need_ref
            else None
        )
        self._init_rollout()
        self.weights_stale = False
        self.update_count = 0

    def model_path(self, engine_name: str) -> str:
        return self.path

    # ------------------------------------------------------------------ rollout
    def _init_rollout(self) -> None:
        rollout = self.cfg.actor_rollout_ref.rollout
        self.rollout_tp = int(rollout.tensor_model_parallel_size) if rollout.name == "vllm" else 1
        if self.world_size % self.rollout_tp:
            raise ValueError(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={self.rollout_tp} does not divide "
                f"the actor's {self.world_size} processes"
            )
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.path)
        max_len = int(self.cfg.data.max_prompt_length) + int(self.cfg.data.max_response_length)
        self.engine = build_rollout_engine(
            str(rollout.name), self.path, rollout, max_model_len=max_len,
            seed=int(self.cfg.trainer.seed) + self.rank // self.rollout_tp, pad_token_id=int(tok.pad_token_id),
            **({"tensor_parallel_size": self.rollout_tp} if rollout.name == "vllm" else
               {"eos_token_id": tok.eos_token_id}),
        )  # fmt: skip
        groups = ParallelGroups.current()
        p = self.parallel
        plan = build_sync_plan(
            self.arch,
            TrainLayout(p.tp_size, p.pp_size, p.vpp_size),
            self.rollout_tp,
            str(rollout.load_format),
            int(rollout.update_weights_bucket_megabytes) * 2**20,
            dtype_bytes=next(self.actor.chunks[0].parameters()).element_size(),
        )
        transport = CollectiveTransport(groups.tp_group, p.tp_size, groups.pp_group, groups.pp_ranks)
        self.syncer = WeightSyncer(plan, self.actor.chunks, p.tp_rank, p.pp_rank, transport,
                                   rollout_rank=self.rank % self.rollout_tp)  # fmt: skip
        self.last_sync: dict[str, float] = {}

    def dispatch_info(self, layout: str = "megatron") -> tuple[int, int, bool]:
        if layout == "rollout":
            return (
                self.rank // self.rollout_tp,
                self.world_size // self.rollout_tp,
                self.rank % self.rollout_tp == 0,
            )
        return super().dispatch_info(layout)

    def sync_weights(self) -> dict[str, float]:
        """Stream the actor's current weights into the rollout engine (collective over the actor)."""
        kill_self_if_requested("sync", self.update_count, self.rank)  # test hook (RLHF_FAULT)
        start = time.perf_counter()
        if drift_ms := fault_amount("sync_drift"):  # test hook (RLHF_FAULT)
            time.sleep(drift_ms * self.update_count / 1000)
        self.engine.wake_up()
        self.engine.update_weights(self.syncer.iter_weights())
        self.weights_stale = False
        self.last_sync = {"timing_s/sync_weights": time.perf_counter() - start,
                          **{f"sync/{k}": float(v) for k, v in self.syncer.stats.items()}}  # fmt: skip
        return self.last_sync

    def on_weights_loaded(self) -> None:
        self.weights_stale = True

    def generate_sequences(
        self, prompts: Batch, validate: bool = False, greedy: bool = False, seed: int | None = None
    ) -> Batch:
        """``n`` responses per prompt (``val_kwargs`` when ``validate``, one greedy sample when
        ``greedy``); syncs stale weights first. ``seed`` makes the samples a function of
        (weights, prompts, seed): the driver passes one per step so resumed runs match."""
        if not (validate or greedy):  # test hook (RLHF_FAULT): this process's (update_count+1)-th step
            kill_self_if_requested("gen", self.update_count + 1, self.rank)
        sync = self.sync_weights() if self.weights_stale else {}
        megatron = self.cfg.actor_rollout_ref.actor.megatron
        if seed is not None:  # distinct seeds for the prompts of different rollout DP groups
            seed = seed + (self.rank // self.rollout_tp) * len(prompts)
        sampling = SamplingConfig.from_rollout_config(
            self.cfg.actor_rollout_ref.rollout, validate=validate, greedy=greedy, seed=seed
        )
        start = time.perf_counter()
        with self.actor.offloaded(megatron.param_offload, megatron.grad_offload, megatron.optimizer_offload):
            self.engine.wake_up()
            out = self.engine.generate_sequences(prompts, sampling)
            self.engine.sleep()
        out.meta_info.update(sync)
        out.meta_info["timing_s/gen"] = time.perf_counter() - start
        return out

    # ------------------------------------------------------------------ log-probs
    def _log_prob_fn(self, with_entropy: bool):
        vocab = self.arch.vocab_size

        def fn(logits, micro):
            prompt_len = micro["input_ids"].shape[1] - micro["responses"].shape[1]
            resp_logits = logits[:, prompt_len - 1 : -1]  # (b, R, V/tp): position t predicts token t+1
            out = {"log_probs": vocab_parallel_log_probs(resp_logits, micro["responses"], vocab).detach()}
            if with_entropy:
                out["entropy"] = vocab_parallel_entropy(resp_logits, vocab).detach()
            return out

        return fn

    def _forward_log_probs(self, engine: MegatronEngine, batch: Batch, with_entropy: bool):
        rollout = self.cfg.actor_rollout_ref.rollout
        dynamic = bool(rollout.log_prob_use_dynamic_bsz)
        return self.forward_rows(
            engine, batch, self._log_prob_fn(with_entropy), rollout.log_prob_micro_batch_size_per_gpu,
            int(rollout.log_prob_max_token_len_per_gpu) if dynamic else None, extra_keys=("responses",),
        )  # fmt: skip

    def compute_log_prob(self, batch: Batch) -> Batch | None:
        """``old_log_probs`` (and ``entropy``) [B, R] of the current actor."""
        start = time.perf_counter()
        out = self._forward_log_probs(self.actor, batch, with_entropy=True)
        if out is None:
            return None
        result = Batch.from_dict({"old_log_probs": out["log_probs"], "entropy": out["entropy"]})
        result.meta_info["timing_s/old_log_prob"] = time.perf_counter() - start
        return result

    def compute_ref_log_prob(self, batch: Batch) -> Batch | None:
        if self.ref is None:
            raise RuntimeError("[actor] the reference model was not built (need_ref=False at init_model)")
        start = time.perf_counter()
        out = self._forward_log_probs(self.ref, batch, with_entropy=False)
        if out is None:
            return None
        result = Batch.from_dict({"ref_log_probs": out["log_probs"]})
        result.meta_info["timing_s/ref"] = time.perf_counter() - start
        return result

    # ------------------------------------------------------------------ update
    def _policy_loss_fn(self):
        actor = self.cfg.actor_rollout_ref.actor
        policy_loss = get_policy_loss_fn(str(actor.policy_loss.loss_mode))
        vocab = self.arch.vocab_size
        mode = str(actor.loss_agg_mode)

        def fn(logits, micro):
            prompt_len = micro["input_ids"].shape[1] - micro["responses"].shape[1]
            resp_logits = logits[:, prompt_len - 1 : -1]
            mask = micro["response_mask"].to(torch.float32)
            log_prob = vocab_parallel_log_probs(resp_logits, micro["responses"], vocab)
            pg_loss, clipfrac, ppo_kl, clipfrac_lower = policy_loss(
                old_log_prob=micro["old_log_probs"], log_prob=log_prob, advantages=micro["advantages"],
                response_mask=mask, cliprange=float(actor.clip_ratio), cliprange_low=actor.clip_ratio_low,
                cliprange_high=actor.clip_ratio_high, clip_ratio_c=float(actor.clip_ratio_c), loss_agg_mode=mode,
            )  # fmt: skip
            loss = pg_loss
            metrics = {"actor/pg_loss": pg_loss.detach(), "actor/pg_clipfrac": clipfrac.detach(),
                       "actor/ppo_kl": ppo_kl.detach(), "actor/pg_clipfrac_lower": clipfrac_lower.detach()}  # fmt: skip
            entropy = agg_loss(vocab_parallel_entropy(resp_logits, vocab), mask, mode)
            metrics["actor/entropy"] = entropy.detach()
            if float(actor.entropy_coeff):
                loss = loss - float(actor.entropy_coeff) * entropy
            if actor.use_kl_loss:
                kl = agg_loss(
                    kl_penalty(log_prob, micro["ref_log_probs"], str(actor.kl_loss_type)), mask, mode
                )
                loss = loss + float(actor.kl_loss_coef) * kl
                metrics["actor/kl_loss"] = kl.detach()
                metrics["actor/kl_coef"] = torch.tensor(float(actor.kl_loss_coef))
            return loss * micro["_weight"], {k: float(v) for k, v in metrics.items()}

        return fn

    def update_actor(self, batch: Batch, step: int = 0) -> dict[str, float]:
        """PPO epochs × mini-batches × micro-batches; returns averaged metrics (on output ranks)."""
        start = time.perf_counter()
        kill_self_if_requested("update", self.update_count + 1, self.rank)  # test hook (RLHF_FAULT)
        if fault_requested("nan", self.update_count + 1, self.rank):
            batch["advantages"] = torch.full_like(batch["advantages"], float("nan"))
        if leak_mib := fault_amount("leak"):  # test hook (RLHF_FAULT); bytes written, so resident
            self._leaked = [*getattr(self, "_leaked", []), b"\x01" * (leak_mib << 20)]
        actor = self.cfg.actor_rollout_ref.actor
        keys = (*MODEL_KEYS, *UPDATE_KEYS, *(("ref_log_probs",) if actor.use_kl_loss else ()))
        seed = int(self.cfg.trainer.seed) * 1000003 + step
        metrics = self.train_ppo_epochs(self.actor, batch, keys, self._policy_loss_fn(), actor, step, seed)
        self.weights_stale = True
        self.update_count += 1
        metrics["timing_s/update_actor"] = time.perf_counter() - start
        return metrics

    def shutdown(self) -> None:
        if hasattr(self, "engine") and hasattr(self.engine, "shutdown"):
            self.engine.shutdown()
        super().shutdown()
