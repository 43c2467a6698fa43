"""The rollout engine of a run, colocated in the actor's processes or on a resource pool of its own.

Colocated (``actor_rollout_ref.hybrid_engine=true``, the default): the actor worker
builds the engine with ``build_engine`` and samples with ``sample``.

Disaggregated (``hybrid_engine=false``): ``RolloutWorker`` is a role of its own on the
rollout pool (``rollout.nnodes x rollout.n_gpus_per_node`` processes; every
``rollout.tensor_model_parallel_size`` consecutive ranks form one vLLM engine, one
rollout data-parallel replica). It knows no Megatron: the trainer's rank 0 streams
it every new version of the weights over a process group spanning both pools
(``weights.cross_pool``), and every batch it generates records the version that
produced it (the ``weight_version`` column: what the trainer's staleness bounds and
metrics read). A worker runs one call at a time, so a sync never lands in the middle
of a generation; a sync that fails half-way marks the engine unusable.

Partial rollout (``trainer.partial_rollout``): the driver raises ``InterruptSignal``, a
counter in the cross-pool group's TCP store, before a sync. A generation submitted under
an older count stops at its next engine step and returns its unfinished rows
(``UNFINISHED_KEY``); after the sync, ``continue_sequences`` finishes them with the new
weights. A row keeps the ``weight_version`` of its first token (an empty row takes the
version that continues it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

from rlhf_megatron.config.context import RunContext
from rlhf_megatron.config.schema import ActorRolloutRefConfig
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.platform.faults import fault_env, fault_point
from rlhf_megatron.rollout import UNFINISHED_KEY, RolloutEngine, RolloutSampling, build_rollout_engine
from rlhf_megatron.scheduling.dispatch import Dispatch, dispatch
from rlhf_megatron.weights.cross_pool import CrossPoolRoute, open_sync_group, receive_buckets
from rlhf_megatron.workers.base import Worker

VERSION_KEY = "weight_version"
"""Per-row int64 column: how many actor updates the weights that generated the row had seen."""


class InterruptSignal:
    """A counter in the cross-pool store that stops generations in flight (partial rollout).

    The driver ``raise_()``s it before a weight sync; a generation submitted when the count was
    ``epoch`` stops once the count is past it (``stop_after(epoch)``, asked before every engine
    step). Only the driver writes it, so it knows the count without asking."""

    KEY = "rollout/interrupt_epoch"

    def __init__(self, store):
        self.store = store

    @classmethod
    def connect(cls, host: str, port: int, timeout_s: float = 600.0) -> InterruptSignal:
        """The driver's client of the store the trainer's rank 0 hosts (``open_sync_group``)."""
        import torch.distributed as dist

        return cls(dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s)))

    def epoch(self) -> int:
        return int(self.store.add(self.KEY, 0))

    def raise_(self) -> int:
        """Stop every generation submitted so far; returns the new count."""
        return int(self.store.add(self.KEY, 1))

    def stop_after(self, epoch: int, rank: int):
        def stop() -> bool:
            if self.epoch() > epoch:
                return True
            fault_point("rollout.engine_step", rank=rank)  # (a test hook may stretch the step that follows)
            return False

        return stop


def build_engine(
    section: ActorRolloutRefConfig, context: RunContext, rank: int, rollout_tp: int
) -> RolloutEngine:
    """The rollout engine of the process at ``rank`` (consecutive ranks ``rollout_tp`` at a time share one)."""
    from transformers import AutoTokenizer

    model, rollout = section.model, section.rollout
    path = os.path.expanduser(model.path)
    tok = AutoTokenizer.from_pretrained(
        os.path.expanduser(model.tokenizer_path or model.path), trust_remote_code=model.trust_remote_code
    )
    engine_args = (
        {
            "tensor_parallel_size": rollout_tp,
            "return_routed_experts": section.actor.router_replay.mode == "R3",
            "lora_rank": _served_lora_rank(section),
        }
        if rollout.name == "vllm"
        else {"eos_token_id": tok.eos_token_id}
    )
    return build_rollout_engine(
        rollout.name,
        path,
        rollout,
        max_model_len=rollout.max_model_len or rollout.prompt_length + rollout.response_length,
        seed=context.seeds.rollout_engine(rank // rollout_tp),
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        trust_remote_code=model.trust_remote_code,
        **engine_args,
    )


def _served_lora_rank(section: ActorRolloutRefConfig) -> int | None:
    """The adapter rank vLLM must serve (LoRA with adapter sync; an imported adapter's own rank)."""
    lora = section.model.lora
    if lora is None or section.lora_sync != "adapter":
        return None
    if lora.adapter_path:
        import json

        config = Path(os.path.expanduser(lora.adapter_path)) / "adapter_config.json"
        return int(json.loads(config.read_text())["r"])
    return lora.rank


def build_agent(
    section: ActorRolloutRefConfig, engine: RolloutEngine, version: Callable[[], int] = lambda: 0
):
    """What runs the rollout's agents in an engine's leader process, else None: the multi-turn tool
    loop (``rollout.multi_turn.enable``; the tools run there alone, ``rollout/multi_turn.py``) or the
    OpenAI-compatible endpoint and the user's agent (``rollout.agent.openai_proxy``,
    ``rollout/openai_proxy.py``; ``version``: the engine's weight version, stamped on each call)."""
    rollout = section.rollout
    proxy = rollout.agent.openai_proxy
    if not (rollout.multi_turn.enable or proxy.enabled) or not engine.is_leader():
        return None
    from transformers import AutoTokenizer

    model = section.model
    tokenizer = AutoTokenizer.from_pretrained(
        os.path.expanduser(model.tokenizer_path or model.path), trust_remote_code=model.trust_remote_code
    )
    if proxy.enabled:
        from rlhf_megatron.rollout.openai_proxy import ProxyRollout

        max_model_len = getattr(engine, "max_model_len", rollout.prompt_length + rollout.response_length)
        return ProxyRollout(proxy, tokenizer, max_model_len, rollout.prompt_length, version)
    from rlhf_megatron.rollout.multi_turn import build_agent_loop

    return build_agent_loop(rollout.multi_turn, tokenizer, rollout.response_length)


def sample(
    engine: RolloutEngine,
    section: ActorRolloutRefConfig,
    prompts: Batch,
    replica: int,
    *,
    validate: bool,
    greedy: bool,
    seed: int | None,
    agent=None,
) -> Batch:
    """``n`` responses per prompt from one rollout replica (``val_kwargs`` when ``validate``, one greedy
    sample when ``greedy``). ``seed`` makes the samples a function of (weights, prompts, seed); the
    replicas offset it so their prompts draw distinct streams. With ``rollout.multi_turn.enable``
    each sample is a multi-turn trajectory, and with ``rollout.agent.openai_proxy`` each an agent
    episode's (``agent``: this process's loop or endpoint if it leads the engine)."""
    if seed is not None:
        seed = seed + replica * len(prompts)
    sampling = RolloutSampling.from_config(section.rollout, validate=validate, greedy=greedy, seed=seed)
    engine.wake_up()
    if section.rollout.multi_turn.enable:
        from rlhf_megatron.rollout.multi_turn import generate_multi_turn

        out = generate_multi_turn(engine, agent, prompts, sampling, section.rollout.prompt_length)
    elif section.rollout.agent.openai_proxy.enabled:
        from rlhf_megatron.rollout.openai_proxy import generate_openai_proxy

        out = generate_openai_proxy(engine, agent, prompts, sampling, section.rollout.prompt_length)
    else:
        out = engine.generate_sequences(prompts, sampling)
    engine.sleep()
    return out


class RolloutWorker(Worker):
    """One process of the rollout pool: ``init_model``, ``join_sync_group``, ``generate_sequences``,
    ``receive_weights``."""

    def __init__(
        self,
        role: str,
        rank: int,
        world_size: int,
        section: ActorRolloutRefConfig,
        context: RunContext,
        env: dict[str, str] | None = None,
    ):
        super().__init__(role, rank, world_size, env)
        self.section, self.context = section, context
        rollout = section.rollout
        self.rollout_tp = rollout.tensor_model_parallel_size if rollout.name == "vllm" else 1
        if world_size % self.rollout_tp:
            raise ValueError(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={self.rollout_tp} does not divide the "
                f"rollout pool's {world_size} processes (rollout.nnodes x rollout.n_gpus_per_node)"
            )
        self.rollout_engine: RolloutEngine | None = None
        self.agent = None
        """The multi-turn agent loop, on the engine's leader (``build_agent``)."""
        self.sync_group = None
        self.version = 0
        """Actor updates behind the engine's weights (0: the initial checkpoint)."""
        self.generations = 0
        """Training generations this process has run."""
        self.broken: str | None = None
        """Why the engine may hold a half-updated model (a sync failed part-way), or None."""

    def init_model(self) -> None:
        from rlhf_megatron.platform import setup_platform

        setup_platform()
        self.rollout_engine = build_engine(self.section, self.context, self.rank, self.rollout_tp)
        self.agent = build_agent(self.section, self.rollout_engine, lambda: self.version)

    def dispatch_info(self, layout: str = "rollout") -> tuple[int, int, bool]:
        """Every layout is the rollout's: replica ``rank // tp`` of ``world // tp``; its TP rank 0 answers."""
        return (
            self.rank // self.rollout_tp,
            self.world_size // self.rollout_tp,
            self.rank % self.rollout_tp == 0,
        )

    def join_sync_group(self, host: str, port: int, route: CrossPoolRoute) -> None:
        """Join the process group that spans both pools (the trainer's rank 0 hosts its store)."""
        self.sync_group = open_sync_group(
            host, port, route.group_rank("rollout", self.rank), route.group_size
        )

    @dispatch(Dispatch.DP_COMPUTE, layout="rollout")
    def generate_sequences(
        self,
        prompts: Batch,
        validate: bool = False,
        greedy: bool = False,
        seed: int | None = None,
        interrupt_epoch: int | None = None,
    ) -> Batch:
        """Like the colocated actor's; every row also records ``weight_version``, and the batch's
        ``meta_info`` the generation's wall-clock ``gen_start``/``gen_end`` (the trainer's timeline).
        With ``interrupt_epoch`` (partial rollout) it stops early once ``InterruptSignal`` is past it."""
        if not (validate or greedy):
            self.generations += 1
            fault_point("rollout.generate", step=self.generations, rank=self.rank)
        if self.broken:
            raise RuntimeError(f"[rollout] rank {self.rank}: refusing to generate: {self.broken}")
        start = time.time()
        replica = self.rank // self.rollout_tp
        stop = None if validate or greedy else self._stop(interrupt_epoch)
        if stop is None:
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
        else:
            if seed is not None:
                seed = seed + replica * len(prompts)  # as ``sample`` offsets it
            sampling = RolloutSampling.from_config(self.section.rollout, seed=seed)
            self.rollout_engine.wake_up()
            out = self.rollout_engine.generate_sequences(prompts, sampling, stop=stop)
            self.rollout_engine.sleep()
        out[VERSION_KEY] = torch.full((len(out),), self.version, dtype=torch.int64)
        out.meta_info.update(gen_start=start, gen_end=time.time())
        return out

    @dispatch(Dispatch.DP_COMPUTE, layout="rollout")
    def continue_sequences(self, batch: Batch, seed: int | None, interrupt_epoch: int) -> Batch:
        """Finish the unfinished rows of an interrupted generation with the current weights (see
        ``VLLMEngine.continue_sequences``); a row that had no token yet takes this version."""
        if self.broken:
            raise RuntimeError(f"[rollout] rank {self.rank}: refusing to generate: {self.broken}")
        start = time.time()
        if seed is not None:
            seed = seed + (self.rank // self.rollout_tp) * len(batch)
        sampling = RolloutSampling.from_config(self.section.rollout, seed=seed)
        empty = batch[UNFINISHED_KEY] & (batch["response_mask"].sum(-1) == 0)
        self.rollout_engine.wake_up()
        out = self.rollout_engine.continue_sequences(batch, sampling, stop=self._stop(interrupt_epoch))
        self.rollout_engine.sleep()
        out[VERSION_KEY] = torch.where(empty, self.version, batch[VERSION_KEY])
        out.meta_info.update(gen_start=start, gen_end=time.time())
        return out

    def _stop(self, epoch: int | None):
        """The engine's ``stop`` for a training generation submitted under interrupt ``epoch``.
        Without one: None (vLLM's own generate), except under a test hook (``fault_env``), which
        gets a ``stop`` that only runs the ``rollout.engine_step`` fault point (stepping the engine
        samples what vLLM's generate does, bit for bit)."""
        if epoch is None:
            if not fault_env():
                return None
            rank = self.rank
            return lambda: fault_point("rollout.engine_step", rank=rank) or False
        if self.sync_group is None:
            raise RuntimeError(f"[rollout] rank {self.rank}: partial rollout needs join_sync_group first")
        return InterruptSignal(self.sync_group.store).stop_after(epoch, self.rank)

    @dispatch(Dispatch.RANK0)
    def receive_weights(self, version: int) -> dict[str, float]:
        """Load the weights the trainer's rank 0 streams (``ActorRolloutRefWorker.send_weights``)."""
        if self.sync_group is None:
            raise RuntimeError(f"[rollout] rank {self.rank}: receive_weights before join_sync_group")
        fault_point("rollout.sync", step=version, rank=self.rank)
        stats: dict[str, float] = {}
        start = time.perf_counter()
        self.broken = f"the weight sync to version {version} did not finish"
        self.rollout_engine.wake_up()
        self.rollout_engine.update_weights(receive_buckets(self.sync_group, stats))
        if stats.get("version") != version:
            raise RuntimeError(
                f"[rollout] rank {self.rank}: expected weights of version {version}, the trainer sent "
                f"{stats.get('version')}"
            )
        self.version = version
        self.broken = None
        return {
            "sync/receive_s": time.perf_counter() - start,
            "sync/recv_wire_s": stats["recv_s"],
            "sync/bytes": stats["bytes"],
        }

    def shutdown(self) -> None:
        if self.rollout_engine is not None and hasattr(self.rollout_engine, "shutdown"):
            self.rollout_engine.shutdown()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
