"""What the Megatron roles share: parallel set-up, batched forward passes, PPO updates, checkpoints.

``MegatronRoleWorker`` is the base of the actor (+rollout +ref), the critic
and the reward model. Each receives its own typed config section (the
``actor_rollout_ref``, ``critic`` or ``reward_model`` dataclass) and the run's
``RunContext`` (seeds, NaN policy, responses per prompt, schedule length). It
sets up megatron's parallel groups from the section's ``megatron`` layout (the
only place a worker touches them is through ``platform``), builds
``MegatronEngine``s, and provides:

- ``forward_rows(engine, batch, fn, ...)``: forward-only over micro-batches,
  returning per-row tensors (in the batch's row order) on the ranks that own
  outputs; ``fn(output, micro)`` turns the last stage's output into
  ``{name: [b, ...]}``.
- ``train_ppo_epochs(...)``: the PPO epoch x mini-batch x micro-batch loop
  shared by the actor and the critic.
- ``save_checkpoint(dir)`` / ``load_checkpoint(dir)``: models through
  megatron's distributed checkpointing, optimizer/scheduler/RNG per rank,
  each file written to a temporary name and renamed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf_megatron.config.context import RunContext
from rlhf_megatron.config.schema import (
    ActorConfig,
    ActorRolloutRefConfig,
    CriticConfig,
    MegatronConfig,
    RewardModelConfig,
)
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.models.lora_io import ADAPTER_DIR, read_peft_adapter, write_peft_adapter
from rlhf_megatron.models.moe import ExpertLoadRecorder
from rlhf_megatron.models.parallel_config import ParallelConfig
from rlhf_megatron.planning.model_arch import HeadKind, ModelArch
from rlhf_megatron.platform import ParallelGroups, init_model_parallel
from rlhf_megatron.platform.faults import fault_point
from rlhf_megatron.scheduling.dispatch import Dispatch, dispatch
from rlhf_megatron.workers.base import Worker
from rlhf_megatron.workers.megatron_engine import MODEL_KEYS, LossFn, MegatronEngine, split_micro_batches

logger = logging.getLogger(__name__)

RoleSection = ActorRolloutRefConfig | CriticConfig | RewardModelConfig
"""The typed config section a Megatron role receives (``actor_rollout_ref``, ``critic``, ``reward_model``)."""
OutputFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
"""A forward-only pass's per-micro-batch outputs, from the last stage's output and the micro-batch."""
TrainedSection = ActorConfig | CriticConfig
"""A section with verl's PPO update keys (mini-batches, epochs, micro-batches, dynamic batching)."""


def parallel_config(megatron: MegatronConfig) -> ParallelConfig:
    """The model-parallel layout of a role's ``megatron`` section (SP needs TP > 1)."""
    sp = megatron.sequence_parallel and megatron.tensor_model_parallel_size > 1
    return ParallelConfig(
        tensor_model_parallel_size=megatron.tensor_model_parallel_size,
        pipeline_model_parallel_size=megatron.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=megatron.virtual_pipeline_model_parallel_size or None,
        context_parallel_size=megatron.context_parallel_size,
        sequence_parallel=sp,
        expert_model_parallel_size=megatron.expert_model_parallel_size,
        expert_tensor_parallel_size=megatron.expert_tensor_parallel_size,
    )


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    # Through a Python file object: a full disk then raises OSError "No space left on device"
    # (torch's own writer reports only "iostream error").
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MegatronRoleWorker(Worker):
    """Base of the Megatron-backed roles: ``section`` is the role's typed config section."""

    def __init__(
        self,
        role: str,
        rank: int,
        world_size: int,
        section: RoleSection,
        context: RunContext,
        env: dict[str, str] | None = None,
    ):
        super().__init__(role, rank, world_size, env)
        self.section = section
        self.context = context
        self.path = ""
        """The role's HF model directory (set by ``init_model``); checkpoints record it."""
        self.engines: dict[str, MegatronEngine] = {}
        self.updates = 0
        """Training steps this process has run (1 = the first after start or resume): fault
        points are addressed by it."""

    def setup_parallel(self, megatron: MegatronConfig) -> ParallelConfig:
        parallel = parallel_config(megatron)
        self.parallel = init_model_parallel(
            parallel.tensor_model_parallel_size,
            parallel.pipeline_model_parallel_size,
            parallel.virtual_pipeline_model_parallel_size,
            parallel.context_parallel_size,
            seed=self.context.seeds.model_parallel(megatron.seed),
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        )
        return parallel

    @staticmethod
    def load_arch(path: str, head: HeadKind, overrides: dict[str, Any] | None = None) -> ModelArch:
        """The architecture of ``<path>/config.json``; ``overrides`` (the role's
        ``model.override_config``) replace its keys first, e.g. ``router_aux_loss_coef``."""
        if not overrides:
            return ModelArch.from_hf_dir(os.path.expanduser(path), head=head)
        import json

        config_path = Path(os.path.expanduser(path)) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} does not exist; pass a Hugging Face model directory")
        config = {**json.loads(config_path.read_text()), **overrides}
        return ModelArch.from_hf_config(config, head=head, source=f"{config_path} with override_config")

    # ------------------------------------------------------------------ forward helpers
    def forward_rows(
        self,
        engine: MegatronEngine,
        batch: Batch,
        fn: OutputFn,
        micro_batch_size: int | None,
        max_tokens: int | None = None,
        extra_keys: tuple[str, ...] = (),
    ) -> dict[str, torch.Tensor] | None:
        """Forward-only over ``batch``; ``{name: [B, ...]}`` in row order on output ranks (in host
        memory: it goes back to the driver), else None."""
        micros = split_micro_batches(batch, (*MODEL_KEYS, *extra_keys), micro_batch_size, max_tokens)

        def loss_fn(output, micro):
            out = fn(output, micro)
            return output.new_zeros(()), {**out, "_rows": micro["_rows"]}

        collected = engine.run(micros, loss_fn, forward_only=True)
        if not collected:
            return None
        rows = torch.cat([c["_rows"] for c in collected])
        order = torch.argsort(rows)
        return {k: torch.cat([c[k] for c in collected])[order].cpu() for k in collected[0] if k != "_rows"}

    # ------------------------------------------------------------------ PPO updates
    def train_ppo_epochs(
        self,
        engine: MegatronEngine,
        batch: Batch,
        keys: tuple[str, ...],
        loss_fn: LossFn,
        role_cfg: TrainedSection,
        step: int,
    ) -> dict[str, float]:
        """``ppo_epochs`` x mini-batches x micro-batches of ``loss_fn`` on this DP rank's ``batch``.

        ``role_cfg`` is the role's section (``ActorConfig`` or ``CriticConfig``) with verl's
        ``ppo_mini_batch_size`` (prompts, summed over DP ranks), ``ppo_epochs``, ``shuffle``,
        ``data_loader_seed``, ``ppo_micro_batch_size_per_gpu`` and the dynamic-batch keys.
        Returns the mean of every metric over optimizer steps, plus ``<role>/grad_norm``,
        ``<role>/update_ok``, ``<role>/lr`` and ``<role>/nan_skipped`` (steps dropped under
        ``trainer.nan_policy=skip``).
        """
        n = self.context.rollout_n
        mini_rows = role_cfg.ppo_mini_batch_size * n // self.parallel.dp_size
        if mini_rows < 1 or len(batch) % mini_rows:
            raise ValueError(
                f"[{self.role}] rank {self.rank}: {len(batch)} rows per DP rank do not split into mini-batches "
                f"of {mini_rows} (ppo_mini_batch_size x rollout.n / DP = {role_cfg.ppo_mini_batch_size} x {n} / "
                f"{self.parallel.dp_size})"
            )
        max_tokens = role_cfg.ppo_max_token_len_per_gpu if role_cfg.use_dynamic_bsz else None
        records: dict[str, list[float]] = {}
        seed = self.context.seeds.minibatch_shuffle(self.role, step, role_cfg.data_loader_seed)
        generator = torch.Generator().manual_seed(seed)
        where = f"[{self.role}] rank {self.rank} step {step}"
        load = ExpertLoadRecorder(engine.chunks) if engine.arch.moe is not None else contextlib.nullcontext()
        nan_skipped = 0
        with load:
            for mini in self._mini_batches(batch, role_cfg, mini_rows, generator):
                micros = split_micro_batches(mini, keys, role_cfg.ppo_micro_batch_size_per_gpu, max_tokens)
                result = engine.train_step(micros, loss_fn, self.context.nan_policy, where)
                for m in result["metrics"]:
                    for k, v in m.items():
                        records.setdefault(k, []).append(v)
                records.setdefault(f"{self.role}/grad_norm", []).append(result["grad_norm"])
                records.setdefault(f"{self.role}/update_ok", []).append(float(result["update_ok"]))
                nan_skipped += result["nan_skipped"]
                if "moe_aux_loss" in result:  # summed over the sparse layers, coefficient divided out
                    records.setdefault(f"{self.role}/moe_aux_loss", []).append(
                        sum(result["moe_aux_loss"].values())
                    )
        metrics = {k: sum(v) / len(v) for k, v in records.items()}
        metrics[f"{self.role}/lr"] = engine.lr
        metrics[f"{self.role}/nan_skipped"] = float(nan_skipped)
        if engine.arch.moe is not None:
            metrics.update(self._expert_load_metrics(engine, load))
        self.updates += 1
        return metrics

    @staticmethod
    def _mini_batches(batch: Batch, role_cfg: TrainedSection, mini_rows: int, generator: torch.Generator):
        """``ppo_epochs`` passes over ``batch`` in mini-batches of ``mini_rows`` (shuffled per epoch)."""
        for _ in range(role_cfg.ppo_epochs):
            order = (
                torch.randperm(len(batch), generator=generator)
                if role_cfg.shuffle
                else torch.arange(len(batch))
            )
            for start in range(0, len(batch), mini_rows):
                yield batch[order[start : start + mini_rows]]

    def _expert_load_metrics(self, engine: MegatronEngine, load: ExpertLoadRecorder) -> dict[str, float]:
        """Per sparse layer, the busiest and idlest expert's share of the tokens relative to an
        even split (1.0 = balanced), over the whole update and all data-parallel ranks; plus their
        means over the layers. A collective over the role's data-parallel and pipeline groups (and
        tensor-parallel group under sequence parallelism, where each TP rank routes a share of the tokens)."""
        groups = ParallelGroups.current()
        experts = engine.arch.moe.num_experts
        counts = torch.zeros(engine.arch.num_layers, experts, dtype=torch.float64)
        for layer, c in load.counts.items():
            counts[layer] = c.to(torch.float64)
        counts = counts.to(next(engine.chunks[0].parameters()).device)  # NCCL reduces device tensors
        torch.distributed.all_reduce(counts, group=groups.dp_group)
        if engine.parallel.sequence_parallel and len(groups.tp_ranks) > 1:  # each TP rank routed its share
            torch.distributed.all_reduce(counts, group=groups.tp_group)
        if len(groups.pp_ranks) > 1:
            torch.distributed.all_reduce(counts, group=groups.pp_group)
        counts = counts.cpu()
        out: dict[str, float] = {}
        highs, lows = [], []
        for layer in engine.arch.moe.moe_layers:
            total = counts[layer].sum()
            if total == 0:
                continue
            share = counts[layer] * experts / total
            highs.append(float(share.max()))
            lows.append(float(share.min()))
            out[f"{self.role}/moe_expert_load_max/layer_{layer}"] = highs[-1]
        if highs:
            out[f"{self.role}/moe_expert_load_max"] = sum(highs) / len(highs)
            out[f"{self.role}/moe_expert_load_min"] = sum(lows) / len(lows)
        return out

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, ckpt_dir: str) -> None:
        """Collective: every engine's model (dist-checkpoint), plus this rank's optimizer/RNG state."""
        root = Path(ckpt_dir)
        fault_point(f"{self.role}.save", step=self.updates, rank=self.rank)
        try:
            self._save_engines(root)
        except (OSError, RuntimeError) as e:
            # torch's writers report a full disk as "file write failed" without the path; say where.
            import shutil

            free = shutil.disk_usage(root).free if root.exists() else "unknown"
            raise OSError(
                f"[{self.role}] rank {self.rank}: writing the checkpoint under {root} failed "
                f"({free} bytes free there): {type(e).__name__}: {e}"
            ) from e
        torch.distributed.barrier()

    def _save_engines(self, root: Path) -> None:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        from rlhf_megatron.models.checkpoint import save_model_checkpoint
        from rlhf_megatron.models.mtp import MTP_STORE

        for name, engine in self.engines.items():
            if engine.optimizer is None:
                continue  # frozen models (reference) are rebuilt from the HF checkpoint
            (root / name).mkdir(parents=True, exist_ok=True)
            if engine.lora is not None:
                # LoRA: the adapters only, as a PEFT directory naming the base it adapts (collective).
                adapters = engine.full_adapters()
                if self.rank == 0:
                    write_peft_adapter(
                        root / name / ADAPTER_DIR,
                        adapters,
                        engine.lora,
                        os.path.abspath(self.path),
                        engine.arch.num_layers,
                    )
            else:
                save_model_checkpoint(
                    engine.chunks,
                    root / name / "model",
                    engine.arch,
                    engine.parallel,
                    hf_dir=self.path,
                    source=f"{self.role}:{name}",
                    # beside the step directories: written by the run's first save, linked by all
                    mtp_store=root.parent / MTP_STORE / f"{self.role}.{name}",
                )
            state = {
                "engine": engine.state_for_checkpoint(),
                "rng": {
                    "torch": torch.get_rng_state(),
                    "numpy": np.random.get_state(),
                    "python": random.getstate(),
                    "tracker": get_cuda_rng_tracker().get_states(),
                },
            }
            _atomic_torch_save(state, root / name / f"state_rank{self.rank:05d}.pt")

    def load_checkpoint(self, ckpt_dir: str) -> None:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        from rlhf_megatron.models.checkpoint import load_model_checkpoint

        root = Path(ckpt_dir)
        for name, engine in self.engines.items():
            if engine.optimizer is None:
                continue
            if engine.lora is not None:
                _, adapters = read_peft_adapter(root / name / ADAPTER_DIR, engine.arch)
                engine.load_adapters(adapters, str(root / name / ADAPTER_DIR))
            else:
                load_model_checkpoint(engine.chunks, root / name / "model")
            path = root / name / f"state_rank{self.rank:05d}.pt"
            if not path.is_file():
                raise FileNotFoundError(
                    f"[{self.role}] rank {self.rank}: {path} is missing; a checkpoint resumes only with the "
                    "same number of processes it was saved with"
                )
            state = torch.load(path, weights_only=False)
            engine.load_checkpoint_state(state["engine"])
            torch.set_rng_state(state["rng"]["torch"])
            np.random.set_state(state["rng"]["numpy"])
            random.setstate(state["rng"]["python"])
            get_cuda_rng_tracker().set_states(state["rng"]["tracker"])
        self.on_weights_loaded()

    @dispatch(Dispatch.RANK0)
    def named_weights(self, contains: str = "", engine: str | None = None) -> dict[str, torch.Tensor]:
        """This rank's parameters whose (chunk-local) name contains ``contains``, copied: for
        inspecting what a step changed (e.g. that a frozen vision tower did not move)."""
        from rlhf_megatron.models.loader import unwrap_model

        chosen = self.engines[engine] if engine else next(iter(self.engines.values()))
        return {
            f"chunk{i}.{name}": p.detach().clone()
            for i, chunk in enumerate(chosen.chunks)
            for name, p in unwrap_model(chunk).named_parameters()
            if contains in name
        }

    def on_weights_loaded(self) -> None:
        """Hook for roles that derive state from the weights (the actor's rollout copy)."""
