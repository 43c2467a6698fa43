"""The hybrid actor + rollout + reference worker: one process per device, three jobs.

Per process: the Megatron actor (trained), optionally the Megatron reference
policy (frozen, same layout; built when the run's ``RolePlan`` has a KL term),
and the rollout engine (vLLM colocated, or the transformers fallback). The
driver calls ``update_weights`` right after every ``update_actor``, which streams
the new weights into the rollout engine through the weight converter
(``rlhf_megatron.weights``); ``generate_sequences`` syncs first only when the
weights changed some other way (a checkpoint was loaded).

Dispatch layouts: ``megatron`` (data-parallel rank of the actor) for log-
probs and updates; ``rollout`` (data-parallel rank of the rollout engine:
consecutive groups of ``rollout.tensor_model_parallel_size`` ranks share one
engine and receive the same prompts) for generation.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from rlhf_megatron.algorithms import agg_loss, get_policy_loss_fn, kl_penalty
from rlhf_megatron.algorithms.bypass_correction import (
    compute_bypass_correction,
    compute_policy_loss_reinforce,
    corrects_at_loss_time,
)
from rlhf_megatron.algorithms.distillation import compute_distillation_loss
from rlhf_megatron.config.context import RunContext
from rlhf_megatron.config.schema import ActorRolloutRefConfig
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.models.forward import (
    vocab_parallel_entropy,
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_at,
)
from rlhf_megatron.models.lora import adapters_disabled
from rlhf_megatron.models.lora_io import merge_adapters
from rlhf_megatron.models.routing_replay import ROUTES_KEY
from rlhf_megatron.platform import ParallelGroups
from rlhf_megatron.platform.faults import fault_point
from rlhf_megatron.rollout import RolloutEngine
from rlhf_megatron.rollout.teacher import TEACHER_COLUMNS, TeacherScorer
from rlhf_megatron.scheduling.dispatch import Dispatch, dispatch
from rlhf_megatron.weights import TrainLayout, WeightSyncer, build_sync_plan
from rlhf_megatron.weights.cross_pool import CrossPoolRoute, open_sync_group, send_buckets
from rlhf_megatron.workers.megatron_engine import MODEL_KEYS, MegatronEngine, pad_responses, response_outputs
from rlhf_megatron.workers.role import MegatronRoleWorker
from rlhf_megatron.workers.rollout import build_agent, build_engine, sample

UPDATE_KEYS = ("responses", "response_mask", "old_log_probs", "advantages")


class ActorRolloutRefWorker(MegatronRoleWorker):
    """``init_model``, ``generate_sequences``, ``update_weights``, ``compute_log_prob``,
    ``compute_ref_log_prob``, ``update_actor``."""

    section: ActorRolloutRefConfig

    def __init__(
        self,
        role: str,
        rank: int,
        world_size: int,
        section: ActorRolloutRefConfig,
        context: RunContext,
        env: dict[str, str] | None = None,
    ):
        super().__init__(role, rank, world_size, section, context, env)
        rollout = section.rollout
        # vLLM's TP groups are consecutive ranks; the transformers engine is one process each.
        self.rollout_tp = rollout.tensor_model_parallel_size if rollout.name == "vllm" else 1
        # Engines in these processes: the colocated rollout's, or the teachers' that share its TP.
        # A rollout on its own pool gets full tensors, whatever the trainer's process count.
        hosts_engines = section.hybrid_engine or context.distillation.in_actor()
        if hosts_engines and world_size % self.rollout_tp:
            raise ValueError(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={self.rollout_tp} does not divide "
                f"the actor's {world_size} processes"
            )
        self.actor: MegatronEngine | None = None
        self.ref: MegatronEngine | None = None
        self.rollout_engine: RolloutEngine | None = None
        self.agent = None
        """The multi-turn agent loop, on the colocated engine's leader (``workers.rollout.build_agent``)."""
        self.syncer: WeightSyncer | None = None
        self.adapter_version = 0
        """LoRA adapter sync: the id of the adapter the rollout engine serves (one per sync)."""
        self.sync_group = None
        """Disaggregated rollout, rank 0: the process group spanning the trainer and the rollout pool."""
        self.weights_stale = False
        """The actor's weights changed since the rollout engine last received them."""
        self.teacher: TeacherScorer | None = None
        """On-policy distillation: the teachers' vLLM engines in this process (``distillation.*``)."""

    def init_model(self) -> None:
        arc = self.section
        parallel = self.setup_parallel(arc.actor.megatron)
        self.path = os.path.expanduser(arc.model.path)
        self.arch = self.load_arch(self.path, "lm", arc.model.override_config)
        self.actor = MegatronEngine(
            self.arch,
            parallel,
            self.path,
            arc.actor.megatron,
            arc.actor.optim,
            total_steps=self.context.total_steps,
            variable_seq_lengths=arc.actor.use_dynamic_bsz and parallel.pipeline_model_parallel_size > 1,
            freeze_vision_tower=arc.model.freeze_vision_tower,
            routing_replay=arc.actor.router_replay.mode != "disabled",
            pack_prompts=bool(arc.model.shared_prompt_packing),
            lora=arc.model.lora,
        )
        self.engines = {"actor": self.actor}
        self._recorded_routes: tuple[torch.Tensor, torch.Tensor] | None = None
        """R2: (input_ids, routed_experts) of the last old-log-prob pass, kept on this rank."""
        # LoRA: the reference policy is the actor's frozen base, its adapters off (no second copy).
        if self.context.plan.ref and self.actor.lora is None:
            self.ref = MegatronEngine(
                self.arch,
                parallel,
                self.path,
                arc.ref.megatron,
                pack_prompts=bool(arc.model.shared_prompt_packing),
            )
        self._init_rollout()
        self._init_teacher()

    def _init_teacher(self) -> None:
        """The teachers' engines, after the rollout's: they join the vLLM parallel groups the rollout
        set up (same TP), so every rollout replica has its own copy of each teacher."""
        distillation = self.context.distillation
        if not distillation.in_actor():  # a pool's teachers are TeacherWorkers
            return
        rollout = self.section.rollout
        self.teacher = TeacherScorer(
            distillation,
            tensor_parallel_size=self.rollout_tp,
            context_len=rollout.prompt_length + rollout.response_length,
            key_column=self.context.reward_fn_key,
            seed=self.context.seeds.rollout_engine(self.rank // self.rollout_tp),
        )

    # ------------------------------------------------------------------ rollout
    def _init_rollout(self) -> None:
        """The colocated engine (hybrid engine) and the weight syncer; disaggregated, only the syncer
        (its buckets go to the rollout pool through ``send_weights``)."""
        arc = self.section
        if arc.hybrid_engine:
            self.rollout_engine = build_engine(arc, self.context, self.rank, self.rollout_tp)
            self.agent = build_agent(arc, self.rollout_engine, lambda: self.updates)
        groups = ParallelGroups.current()
        p = self.parallel
        merged = self.actor.lora is not None and arc.lora_sync == "merged"
        if self.actor.lora is not None:
            # Adapters on a fresh base: the engine serves the base until it gets them.
            self.weights_stale = True
        plan = build_sync_plan(
            self.arch,
            TrainLayout.of(p),
            self.rollout_tp,
            "hf" if merged else arc.rollout.load_format,  # adapters fold in on HF names
            arc.rollout.update_weights_bucket_megabytes * 2**20,
            dtype_bytes=next(self.actor.chunks[0].parameters()).element_size(),
        )
        self.syncer = WeightSyncer.of(plan, self.actor.chunks, p, groups)

    def dispatch_info(self, layout: str = "megatron") -> tuple[int, int, bool]:
        if layout == "rollout":
            return (
                self.rank // self.rollout_tp,
                self.world_size // self.rollout_tp,
                self.rank % self.rollout_tp == 0,
            )
        return super().dispatch_info(layout)

    @dispatch(Dispatch.RANK0)
    def update_weights(self) -> dict[str, float]:
        """Stream the actor's current weights into the rollout engine (collective over the actor).
        Returns the converter's per-phase seconds and peak bucket bytes as ``sync/*``."""
        self.rollout_engine.wake_up()
        lora = self.actor.lora
        if lora is not None and self.section.lora_sync == "adapter":
            self.adapter_version += 1
            self.rollout_engine.load_adapter(self.actor.full_adapters(), lora, self.adapter_version)
        elif lora is not None:
            self.rollout_engine.update_weights(
                merge_adapters(self.syncer.iter_weights(), self.actor.full_adapters(), lora.scale)
            )
        else:
            self.rollout_engine.update_weights(self.syncer.iter_weights())
        # Mid-call, not at its start: a kill as a queued call starts can lose the reply of the
        # call before it (Ray sends it after that call returns), and the death would surface there.
        fault_point("actor.sync", step=self.updates, rank=self.rank)
        self.weights_stale = False
        return {f"sync/{k}": float(v) for k, v in self.syncer.stats.items()}

    # ------------------------------------------------------------------ disaggregated rollout
    def join_sync_group(self, host: str, port: int, route: CrossPoolRoute) -> None:
        """Rank 0 hosts and joins the process group spanning both pools; the other ranks only
        help gather (``send_weights``)."""
        rank = route.group_rank("trainer", self.rank)
        if rank is not None:
            self.sync_group = open_sync_group(host, port, rank, route.group_size)

    @dispatch(Dispatch.RANK0)
    def send_weights(self, version: int) -> dict[str, float]:
        """Every rank executes the plan (gathers inside the trainer's world); rank 0 streams the
        buckets to the rollout pool (``RolloutWorker.receive_weights``), bucket ``k+1`` gathered while
        bucket ``k`` is on the wire. Returns ``sync/*`` as ``update_weights`` does, plus the wire's."""
        fault_point("actor.sync", step=self.updates, rank=self.rank)
        start = time.perf_counter()
        buckets = self.syncer.iter_buckets()
        if self.actor.lora is not None:  # the wire carries full tensors: adapters folded in
            adapters, scale = self.actor.full_adapters(), self.actor.lora.scale
            buckets = (list(merge_adapters(bucket, adapters, scale)) for bucket in buckets)
        if self.sync_group is not None:
            wire = send_buckets(self.sync_group, buckets, version)
        else:
            wire = {}
            for _ in buckets:
                pass
        stats = {f"sync/{k}": float(v) for k, v in self.syncer.stats.items()}
        stats.update({f"sync/wire_{k}": float(v) for k, v in wire.items()})
        stats["sync/send_s"] = time.perf_counter() - start
        return stats

    def on_weights_loaded(self) -> None:
        self.weights_stale = True

    @dispatch(Dispatch.DP_COMPUTE, layout="rollout")
    def generate_sequences(
        self,
        prompts: Batch,
        validate: bool = False,
        greedy: bool = False,
        seed: int | None = None,
        log_probs: tuple[str, ...] = (),
    ) -> Batch:
        """``n`` responses per prompt (``val_kwargs`` when ``validate``, one greedy sample when
        ``greedy``); syncs stale weights first. ``seed`` makes the samples a function of
        (weights, prompts, seed): the driver passes one per step so resumed runs match. The
        batch's ``meta_info`` carries the generation's wall-clock ``gen_start``/``gen_end``
        (the driver may have queued the call before this rank was free to run it).

        ``log_probs``: passes to run on the rows right after generating them, in the same call
        (``old_log_probs``, ``ref_log_probs``), where they need no other rank's rows: the
        rollout's TP groups are the actor's and there is one pipeline stage (``fuses_passes``).
        Each comes back as its column, its wall-clock span in ``meta_info[<name>_span]``;
        otherwise the driver runs the pass as its own call."""
        if self.rollout_engine is None:
            raise RuntimeError(
                f"[actor] rank {self.rank}: generate_sequences on the actor, but the rollout runs on its own "
                "pool (actor_rollout_ref.hybrid_engine=false)"
            )
        start = time.time()
        if self.weights_stale:
            self.update_weights()
        megatron = self.section.actor.megatron
        with self.actor.offloaded(megatron.param_offload, megatron.grad_offload, megatron.optimizer_offload):
            replica = self.rank // self.rollout_tp
            out = sample(
                self.rollout_engine,
                self.section,
                prompts,
                replica,
                validate=validate,
                greedy=greedy,
                seed=seed,
                agent=self.agent,
            )
        if not (validate or greedy):  # after sampling (see update_weights' fault point)
            fault_point("actor.generate", step=self.updates + 1, rank=self.rank)
        elif validate:
            fault_point("actor.validate", step=self.updates, rank=self.rank)
        out.meta_info.update(gen_start=start, gen_end=time.time())
        if log_probs and self.fuses_passes() and "multi_modal_data" not in out.non_tensor_keys:
            passes = {"old_log_probs": self.compute_log_prob, "ref_log_probs": self.compute_ref_log_prob}
            for name in log_probs:
                begin = time.time()
                result = passes[name](out)
                if result is not None:  # None off the output ranks, whose rows the driver drops
                    out[name] = result[name]
                    out.meta_info[f"{name}_span"] = (begin, time.time())
        return out

    def fuses_passes(self) -> bool:
        """Whether the log-prob passes over this rank's generated rows can run where they were
        generated: each rollout TP group is an actor TP group holding the same rows, on one
        pipeline stage without context parallelism."""
        p = self.parallel
        return self.rollout_tp == p.tp_size and p.pp_size == 1 and p.cp_size == 1

    # ------------------------------------------------------------------ log-probs
    def _log_prob_fn(self):
        vocab = self.arch.vocab_size

        def fn(logits, micro):
            resp_logits = response_outputs(logits, micro)  # (b, w, V/tp): position t predicts token t+1
            labels = micro["responses"][:, : resp_logits.shape[1]]
            return {"log_probs": pad_responses(vocab_parallel_log_probs(resp_logits, labels, vocab), micro)}

        return fn

    def _forward_log_probs(self, engine: MegatronEngine, batch: Batch, extra_keys: tuple[str, ...] = ()):
        rollout = self.section.rollout
        max_tokens = rollout.log_prob_max_token_len_per_gpu if rollout.log_prob_use_dynamic_bsz else None
        return self.forward_rows(
            engine,
            batch,
            self._log_prob_fn(),
            rollout.log_prob_micro_batch_size_per_gpu,
            max_tokens,
            extra_keys=("responses", *extra_keys),
        )

    @dispatch(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch | None:
        """``old_log_probs`` [B, R] of the current actor. (No entropy: the update pass logs it, and
        over a real vocabulary it costs as much as the log-probs.) Routing replay: R3 replays the
        rollout's ``routed_experts``; R2 records this pass's choices for the updates."""
        mode = self.section.actor.router_replay.mode
        if mode == "R3":
            self._require_routes(batch, "compute_log_prob")
            out = self._forward_log_probs(self.actor, batch, (ROUTES_KEY,))
        elif mode == "R2":
            self.actor.routing.recording = True
            try:
                out = self._forward_log_probs(self.actor, batch)
                routes = self.actor.routing.take_recorded(len(batch))
            finally:
                self.actor.routing.recording = False
                self.actor.routing.discard_recorded()
            self._recorded_routes = (batch["input_ids"].clone(), routes)
        else:
            out = self._forward_log_probs(self.actor, batch)
        return None if out is None else Batch.from_dict({"old_log_probs": out["log_probs"]})

    def _require_routes(self, batch: Batch, method: str) -> None:
        if ROUTES_KEY not in batch:
            raise ValueError(
                f"[actor] rank {self.rank} {method}: router_replay.mode=R3 needs the rollout's {ROUTES_KEY!r} "
                f"in the batch; it has {sorted(batch.keys())}"
            )

    def _routes_for_update(self, batch: Batch) -> Batch:
        """The batch with the routes the update replays (R2: recorded by ``compute_log_prob``)."""
        mode = self.section.actor.router_replay.mode
        if mode == "R3":
            self._require_routes(batch, "update_actor")
        if mode != "R2":
            return batch
        if self._recorded_routes is None:
            raise RuntimeError(
                f"[actor] rank {self.rank} update_actor: router_replay.mode=R2 replays the routes of "
                "compute_log_prob, which has not run on this batch"
            )
        input_ids, routes = self._recorded_routes
        self._recorded_routes = None
        if input_ids.shape != batch["input_ids"].shape or not torch.equal(input_ids, batch["input_ids"]):
            raise RuntimeError(
                f"[actor] rank {self.rank} update_actor: router_replay.mode=R2 got other rows than "
                "compute_log_prob recorded routes for; both must see the same batch on each rank"
            )
        batch = batch.union(Batch.from_dict({ROUTES_KEY: routes}))
        return batch

    @dispatch(Dispatch.DP_COMPUTE, layout="rollout")
    def compute_teacher_log_probs(self, batch: Batch) -> Batch:
        """On-policy distillation: the teachers' log-probs of the batch's sampled tokens,
        ``teacher_log_probs`` [B, R] (and, for ``forward_kl_topk``, ``teacher_topk_ids`` and
        ``teacher_topk_log_probs`` [B, R, K]). Dispatched like a generation: every rank of a rollout
        TP group scores the same rows on its shard of the teacher's engine."""
        if self.teacher is None:
            raise RuntimeError(
                f"[actor] rank {self.rank}: compute_teacher_log_probs, but distillation.enabled=false "
                "(no teacher was built)"
            )
        return self.teacher.score(batch)

    @dispatch(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch | None:
        """``ref_log_probs`` [B, R] of the reference policy."""
        if self.ref is None and self.actor.lora is not None:
            with adapters_disabled(self.actor.chunks):  # the base model is the reference
                out = self._forward_log_probs(self.actor, batch)
            return None if out is None else Batch.from_dict({"ref_log_probs": out["log_probs"]})
        if self.ref is None:
            raise RuntimeError(
                "[actor] the reference model was not built (the run's RolePlan has no KL term)"
            )
        out = self._forward_log_probs(self.ref, batch)
        return None if out is None else Batch.from_dict({"ref_log_probs": out["log_probs"]})

    # ------------------------------------------------------------------ update
    def _policy_loss_fn(self):
        actor = self.section.actor
        policy_loss = get_policy_loss_fn(actor.policy_loss.loss_mode)
        vocab = self.arch.vocab_size
        mode = actor.loss_agg_mode
        # The variants' own keys (clip_cov_*, kl_cov_ratio, dro_beta, SAPO's taus); each loss
        # reads those it names and ignores the rest.
        options = {**actor.policy_loss.options(), "tau_pos": actor.tau_pos, "tau_neg": actor.tau_neg}
        # Bypass mode: old_log_probs are the rollout's, and the weights and rejection mask come
        # from the current policy against them, here rather than on the driver.
        corr = self.context.rollout_correction
        at_loss_time = corrects_at_loss_time(corr)
        distill = self.context.distillation.distillation_loss if self.context.distillation.enabled else None

        def fn(logits, micro):
            resp_logits = response_outputs(logits, micro)  # (b, w, V/tp); w <= R after trimming
            labels = micro["responses"][:, : resp_logits.shape[1]]
            mask = micro["response_mask"].to(torch.float32)
            log_prob = pad_responses(vocab_parallel_log_probs(resp_logits, labels, vocab), micro)  # (b, R)
            pg_mask, is_weights, corr_metrics = mask, micro.get("rollout_is_weights"), {}
            if at_loss_time:
                is_weights, pg_mask, corr_metrics = compute_bypass_correction(
                    log_prob, micro["old_log_probs"], mask, corr
                )
            if corr.bypass_mode and corr.loss_type == "reinforce":
                pg_loss, ppo_kl = compute_policy_loss_reinforce(
                    log_prob, micro["old_log_probs"], micro["advantages"], pg_mask, mode, is_weights
                )
                clipfrac = clipfrac_lower = torch.zeros_like(ppo_kl)  # nothing is clipped
            else:
                pg_loss, clipfrac, ppo_kl, clipfrac_lower = policy_loss(
                    old_log_prob=micro["old_log_probs"],
                    log_prob=log_prob,
                    advantages=micro["advantages"],
                    response_mask=pg_mask,
                    cliprange=actor.clip_ratio,
                    cliprange_low=actor.clip_ratio_low,
                    cliprange_high=actor.clip_ratio_high,
                    clip_ratio_c=actor.clip_ratio_c,
                    loss_agg_mode=mode,
                    rollout_is_weights=is_weights,  # (b, R), from the driver's rollout correction
                    **options,
                )
            loss = pg_loss
            if distill is not None:
                d_loss, d_metrics = self._distillation_loss(distill, resp_logits, log_prob, micro, is_weights)
                # Without the task's rewards the distillation loss replaces the policy loss.
                loss = loss + distill.distillation_loss_coef * d_loss if distill.use_task_rewards else d_loss
                corr_metrics = {**corr_metrics, **d_metrics}
            metrics = {
                "actor/pg_loss": pg_loss.detach(),
                "actor/pg_clipfrac": clipfrac.detach(),
                "actor/ppo_kl": ppo_kl.detach(),
                "actor/pg_clipfrac_lower": clipfrac_lower.detach(),
                **corr_metrics,
            }
            # Without an entropy bonus the entropy is only a metric: no graph, no saved activations.
            with contextlib.nullcontext() if actor.entropy_coeff else torch.no_grad():
                entropy = agg_loss(
                    pad_responses(vocab_parallel_entropy(resp_logits, vocab), micro), mask, mode
                )
            metrics["actor/entropy"] = entropy.detach()
            if actor.entropy_coeff:
                loss = loss - actor.entropy_coeff * entropy
            if actor.use_kl_loss:
                kl = agg_loss(kl_penalty(log_prob, micro["ref_log_probs"], actor.kl_loss_type), mask, mode)
                loss = loss + actor.kl_loss_coef * kl
                metrics["actor/kl_loss"] = kl.detach()
                metrics["actor/kl_coef"] = torch.tensor(actor.kl_loss_coef)
            return loss * micro["_weight"], {k: float(v) for k, v in metrics.items()}

        return fn

    def _distillation_loss(self, distill, resp_logits, log_prob, micro, is_weights):
        """``algorithms.compute_distillation_loss`` of a micro-batch against the teacher's columns;
        ``forward_kl_topk`` gathers the student's log-probs at the teacher's top-k ids from the
        vocabulary-parallel logits. Metrics as ``actor/distillation/*``."""
        student_topk = teacher_topk = None
        if distill.loss_mode == "forward_kl_topk":
            ids = micro["teacher_topk_ids"][:, : resp_logits.shape[1]]  # (b, w, K)
            student_topk = pad_responses(
                vocab_parallel_log_probs_at(resp_logits, ids, self.arch.vocab_size), micro
            )
            teacher_topk = micro["teacher_topk_log_probs"]
        actor = self.section.actor
        loss, metrics = compute_distillation_loss(
            distill.loss_mode,
            log_prob,
            micro["old_log_probs"],
            micro["teacher_log_probs"],
            micro["response_mask"].to(torch.float32),
            loss_agg_mode=actor.loss_agg_mode,
            use_policy_gradient=distill.use_policy_gradient,
            loss_max_clamp=distill.loss_max_clamp,
            log_prob_min_clamp=distill.log_prob_min_clamp,
            clip_ratio=distill.clip_ratio,
            clip_ratio_low=distill.clip_ratio_low,
            clip_ratio_high=distill.clip_ratio_high,
            student_topk_log_probs=student_topk,
            teacher_topk_log_probs=teacher_topk,
            rollout_is_weights=is_weights,
        )
        return loss, {f"actor/distillation/{k}": v.detach() for k, v in metrics.items()}

    @dispatch(Dispatch.DP_COMPUTE)
    def update_actor(self, batch: Batch, step: int = 0) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches; returns averaged metrics (on output ranks)."""
        fault_point("actor.update", step=self.updates + 1, rank=self.rank, batch=batch)
        actor = self.section.actor
        keys = (*MODEL_KEYS, *UPDATE_KEYS, *(("ref_log_probs",) if actor.use_kl_loss else ()))
        if "rollout_is_weights" in batch.tensor_keys:  # set by the driver's apply_rollout_correction
            keys = (*keys, "rollout_is_weights")
        if self.context.distillation.enabled:  # compute_teacher_log_probs' columns
            keys = (*keys, *(k for k in TEACHER_COLUMNS if k in batch.tensor_keys))
        if actor.router_replay.mode != "disabled":
            batch = self._routes_for_update(batch)
            keys = (*keys, ROUTES_KEY)
        metrics = self.train_ppo_epochs(self.actor, batch, keys, self._policy_loss_fn(), actor, step)
        self.weights_stale = True
        return metrics

    def shutdown(self) -> None:
        if self.teacher is not None:
            self.teacher.shutdown()
        if self.rollout_engine is not None and hasattr(self.rollout_engine, "shutdown"):
            self.rollout_engine.shutdown()
        super().shutdown()
