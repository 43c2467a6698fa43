"""The vLLM rollout engine, colocated with the actor's training processes.

Colocation ("hybrid engine"): the engine lives inside the same processes as
the Megatron actor. With ``tensor_parallel_size > 1`` or an initialised
``torch.distributed`` world, vLLM runs in its ``external_launcher`` mode: it
reuses the existing process group (NCCL on GPU, gloo on CPU), and every rank
of a rollout-TP group calls ``generate`` with the same prompts and the same
seed, so all ranks produce identical samples. A single process with no world
runs a plain in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps
vLLM's engine core in this process either way).

Weights: ``update_weights`` streams ``(hf_name, tensor)`` pairs into vLLM.
With ``load_format="hf"`` they go through the model runner's
``reload_weights(weights_iterator=...)``, which runs vLLM's own loader (TP
slicing, qkv/gate-up fusion) and then its post-load processing again.
``load_format="sharded"`` sends tensors already cut and fused for each vLLM TP
rank: on GPU they are copied straight into the parameters
(``weights.copy_sharded_weights``, expert rows included); on CPU, where linear
weights live inside packed GEMM kernels, ``refit_cpu_in_place`` puts them into
the parameters and reruns only the affected layers' post-load processing (the
repacking). vLLM 0.32 on CPU packs mixture-of-experts weights only on the first
load, so every CPU update repacks them (``repack_cpu_experts``).

Memory: on GPU ``sleep()``/``wake_up()`` release and restore weights and KV
cache (vLLM sleep mode) around training phases; on CPU they are no-ops, and
the KV cache is sized from the model and ``max_num_seqs`` instead of a
fraction of device memory.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from rlhf_megatron.config.schema import RolloutConfig
from rlhf_megatron.config.schema_model import LoraConfig
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.planning.model_arch import ModelArch
from rlhf_megatron.rollout.base import (
    UNFINISHED_KEY,
    RolloutSampling,
    assemble_rollout,
    assemble_routes,
    prompt_media,
    prompt_token_lists,
    vision_token_bias,
)
from rlhf_megatron.weights.execute import copy_sharded_weights
from rlhf_megatron.weights.plan import LOAD_FORMATS

logger = logging.getLogger(__name__)


RANK_CHUNK_ELEMENTS = 1 << 26
"""Logits per chunk of the eager token-rank count (a boolean temporary of this many bytes)."""


def _patch_vllm_cpu_token_ranks() -> None:
    """Rank sampled tokens eagerly on CPU.

    vLLM ranks every sampled token among the vocabulary (``batched_count_greater_than``, the
    count of logits at or above its own) with a ``torch.compile``'d kernel. On CPU its first
    call traces and compiles it with inductor in every engine process: 3-5 s of each run's
    start-up on a 2-core machine, for a comparison and a sum. The same count is computed here
    eagerly, in row chunks that bound the boolean temporary to ``RANK_CHUNK_ELEMENTS`` bytes (the
    memory the compiled kernel exists to save). GPU builds keep vLLM's kernel."""
    try:
        from vllm.v1.sample import sampler
    except ImportError:
        return
    if getattr(sampler.batched_count_greater_than, "_rlhf_eager", False):
        return

    def batched_count_greater_than(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        rows = max(1, RANK_CHUNK_ELEMENTS // max(x.shape[-1], 1))
        if x.shape[0] <= rows:
            return (x >= values).sum(-1)
        return torch.cat(
            [(x[i : i + rows] >= values[i : i + rows]).sum(-1) for i in range(0, x.shape[0], rows)]
        )

    batched_count_greater_than._rlhf_eager = True  # type: ignore[attr-defined]
    sampler.batched_count_greater_than = batched_count_greater_than


def _patch_vllm_cpu_vocab_mask() -> None:
    """Mask vocabulary-parallel token ids eagerly on CPU.

    At tensor parallel > 1 vLLM maps each rank's token ids into its vocabulary shard with
    ``get_masked_input_and_mask``, a ``torch.compile``'d function (to fuse six pointwise ops on
    GPU). On CPU the first embedding call of every engine process compiles it with inductor: 6-7 s
    of each TP run's start-up on a 2-core machine. The function's own, uncompiled definition is
    used instead; GPU builds keep vLLM's kernel."""
    try:
        from vllm.model_executor.layers import vocab_parallel_embedding as embedding
    except ImportError:
        return
    compiled = embedding.get_masked_input_and_mask
    eager = getattr(compiled, "_torchdynamo_orig_callable", None)
    if eager is None or getattr(compiled, "_rlhf_eager", False):
        return
    eager._rlhf_eager = True
    embedding.get_masked_input_and_mask = eager


def _patch_vllm_cpu_shm_names() -> None:
    """Make vLLM-CPU's shared-memory segment names unique per process group.

    vLLM's CPU communicator names its /dev/shm segments after the port of the
    distributed init method; with the external launcher that is always
    ``env://``, so every run on a machine uses the same names, and a run that
    was killed (its segments left behind) or a second job on the same host
    fails with "create shm in SHMManager failed. errno: 17". Prefixing the
    names with this group's rendezvous address and port keeps them apart.
    (``_unlink_vllm_shm_segments`` removes the names once mapped, so only a
    worker killed during engine start-up can still leave one behind.)
    """
    try:
        from vllm.distributed.device_communicators import cpu_communicator
    except ImportError:  # GPU builds of vLLM
        return
    shm = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    if shm is None or getattr(shm, "_rlhf_patched", False):
        return
    original = shm.make_group_name

    def make_group_name(communicator):
        # vLLM's own part starts with the init method's tail ("//" for env://); a slash is
        # only legal at the start of a POSIX shm name, so drop them.
        run = zlib.crc32(f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}".encode())
        return f"rlhf{run:08x}{original(communicator).replace('/', '')}"

    shm.make_group_name = staticmethod(make_group_name)
    shm._rlhf_patched = True


def _unlink_vllm_shm_segments() -> list[str]:
    """Remove this process's vLLM /dev/shm segments from the namespace once every peer maps them.

    vLLM's TP groups talk through POSIX shared memory: the broadcast ring buffer of each group
    (``psm_*``, 24 MiB, made by the group's first rank) and, on CPU, the all-reduce segments
    (``<group>-cpushm_<rank>``, 4 MiB per rank). They are unlinked only by destructors, which
    never run when Ray kills a worker, so every run left 8 MiB behind and every killed run
    another 24 MiB, until /dev/shm filled. Once all ranks have mapped them (the world barrier;
    vLLM's own init already waits for that), the names can go: the mappings stay valid, and
    the memory is freed when the last process using it exits, however it exits.
    Returns the names removed.
    """
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return []
    world = parallel_state.get_world_group()
    if world.world_size > 1:
        torch.distributed.barrier(group=world.cpu_group)
    removed: list[str] = []
    for ref in list(parallel_state._groups.values()):  # one weak reference per live group
        group = ref()
        if group is None:
            continue
        ring = getattr(getattr(group, "mq_broadcaster", None), "buffer", None)
        if ring is not None and getattr(ring, "is_creator", False):
            name = ring.shared_memory.name
            ring.shared_memory.unlink()  # also unregisters it from Python's resource tracker
            ring.is_creator = False  # its destructor must not unlink the name a second time
            removed.append(name)
        communicator = getattr(group, "device_communicator", None)
        cpu_shm = getattr(communicator, "dist_module", None)
        group_name = getattr(cpu_shm, "group_name", None)
        if group_name:  # vLLM-CPU's shm all-reduce: one segment per rank, named <group>_<rank>
            name = f"{group_name}_{communicator.rank}"
            try:
                os.unlink(f"/dev/shm/{name}")
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def _cpu_kv_cache_bytes(model_path: str, max_model_len: int, max_num_seqs: int, dtype_bytes: int) -> int:
    """KV cache for ``max_num_seqs`` full-length sequences (+25%), at least 64 MiB.

    vLLM on CPU otherwise claims several GiB per engine, which several
    colocated engines on one small machine cannot afford.
    """
    arch = ModelArch.from_hf_dir(model_path)
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype_bytes
    return max(64 * 2**20, int(per_token * max_model_len * max_num_seqs * 1.25))


def _cpu_experts_kernel(module: torch.nn.Module) -> Any:
    """The CPU grouped-GEMM experts object of a vLLM fused-MoE layer, or None for other modules."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return experts if experts is not None and hasattr(module, "w13_weight") else None


@torch.no_grad()
def refit_cpu_in_place(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Load per-rank tensors in vLLM's own layout (``load_format=sharded``) into a CPU model in place.

    vLLM on CPU keeps each linear layer's weight only inside a packed GEMM kernel (oneDNN or
    sgl), built by the layer's ``process_weights_after_loading``; its ``weight`` parameter is
    then empty. ``reload_weights`` therefore rebuilds every layer through the loader (meta
    tensors, re-materialised layers, the loader's slicing) before repacking. Tensors already
    cut and fused for this rank need none of that: put each into its parameter (a fresh one
    for an emptied linear weight), then rerun only the post-load processing of the layers
    touched, and of the layers sharing a touched parameter (a tied LM head packs its own
    copy of the embedding). Mixture-of-experts layers hold their experts prepacked (and
    maybe padded) for the grouped GEMM: rows ``w13_weight[e]`` / ``w2_weight[e]`` are
    gathered into fresh unpacked tensors, which must cover every local expert, and the
    layer's experts kernel packs them again. Returns the number of tensors loaded.
    """
    modules = dict(model.named_modules())
    touched: dict[int, torch.nn.Module] = {}
    updated: set[int] = set()
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    count = 0
    for name, tensor in weights:
        count += 1
        base, _, index = name.rstrip("]").partition("[")
        module_name, _, param_name = base.rpartition(".")
        module = modules.get(module_name)
        if module is None or not hasattr(module, param_name):
            raise KeyError(
                f"weight sync (sharded, CPU): vLLM's model has no parameter {base!r} (from {name!r})"
            )
        if index:
            if _cpu_experts_kernel(module) is None:
                raise KeyError(
                    f"weight sync (sharded, CPU): {name!r} indexes {base}, which is not a fused expert weight"
                )
            experts.setdefault((module_name, param_name), {})[int(index)] = tensor.detach().clone()
            continue
        param = getattr(module, param_name)
        if param.numel() == 0 and tensor.numel() > 0:
            # The kernel owns the old weight; the tensor is a view into a bucket that is reused.
            param = torch.nn.Parameter(tensor.detach().clone(), requires_grad=False)
            setattr(module, param_name, param)
        elif param.shape != tensor.shape:
            raise ValueError(
                f"weight sync (sharded, CPU): {name} has shape {list(tensor.shape)} but vLLM's parameter has "
                f"{list(param.shape)} on this rank"
            )
        else:
            param.copy_(tensor)
        updated.add(id(param))
        touched[id(module)] = module
    for module in model.modules():
        if id(getattr(module, "weight", None)) in updated:
            touched[id(module)] = module
    for module in touched.values():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    _repack_experts(modules, experts)
    return count


def _repack_experts(
    modules: dict[str, torch.nn.Module], rows: dict[tuple[str, str], dict[int, torch.Tensor]]
) -> None:
    """Stack each fused-MoE layer's expert rows into unpacked ``w13_weight``/``w2_weight`` and pack them."""
    from vllm.model_executor.utils import replace_parameter

    layers = sorted({module_name for module_name, _ in rows})
    for module_name in layers:
        module = modules[module_name]
        for param_name in ("w13_weight", "w2_weight"):
            got = rows.get((module_name, param_name), {})
            if sorted(got) != list(range(module.local_num_experts)):
                raise ValueError(
                    f"weight sync (sharded, CPU): {module_name}.{param_name} got expert rows {sorted(got)}, "
                    f"vLLM holds {module.local_num_experts} experts on this rank; every row must be sent"
                )
            replace_parameter(module, param_name, torch.stack([got[e] for e in range(len(got))]))
        _cpu_experts_kernel(module).process_weights_after_loading(module)


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Pack every fused-MoE layer's freshly loaded experts for vLLM's CPU grouped GEMM; returns how many.

    vLLM 0.32 on CPU packs a layer's ``w13_weight``/``w2_weight`` only on the first load: after
    ``reload_weights`` the new weights sit unpacked in the layer and it computes garbage
    (log-probs off by ~1 on a tiny Qwen3-MoE). ``update_weights`` runs this after every
    ``hf`` reload on CPU; dense layers are untouched.
    """
    count = 0
    for module in model.modules():
        kernel = _cpu_experts_kernel(module)
        if kernel is not None:
            kernel.process_weights_after_loading(module)
            count += 1
    return count


_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    for size in _VLLM_LORA_RANKS:
        if size >= rank:
            return size
    raise ValueError(
        f"actor_rollout_ref.model.lora_rank={rank}: vLLM serves adapters up to rank {_VLLM_LORA_RANKS[-1]}; "
        "use a smaller rank or actor_rollout_ref.rollout.lora_sync=merged"
    )


def _shm_dir() -> str | None:
    """A RAM-backed directory for per-step adapter files when there is one (Linux), else the default."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class VLLMEngine:
    """vLLM behind the ``RolloutEngine`` interface (see ``rollout/base.py``)."""

    def __init__(
        self,
        model_path: str,
        rollout: RolloutConfig,
        *,
        max_model_len: int,
        seed: int = 0,
        pad_token_id: int = 0,
        tensor_parallel_size: int | None = None,
        trust_remote_code: bool = False,
        return_routed_experts: bool = False,
        lora_rank: int | None = None,
    ):
        """``lora_rank``: serve LoRA adapters up to that rank on the base (``load_adapter``)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.on_gpu = torch.cuda.is_available()
        self.load_format = rollout.load_format
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"actor_rollout_ref.rollout.load_format={self.load_format!r} is not one of {LOAD_FORMATS}"
            )
        self.pad_token_id = pad_token_id
        self.max_model_len = max_model_len
        self.logit_bias = vision_token_bias(ModelArch.from_hf_dir(model_path))
        dtype = rollout.dtype
        if not self.on_gpu and dtype in ("bfloat16", "float16"):
            # The tiny CPU models and the Megatron side run fp32; matching dtypes keeps
            # the rollout log-probs comparable with the trainer's.
            dtype = "float32"
        kwargs: dict[str, Any] = dict(
            model=model_path,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size or rollout.tensor_model_parallel_size,
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=rollout.enforce_eager,
            max_num_seqs=rollout.max_num_seqs,
            disable_log_stats=rollout.disable_log_stats,
            trust_remote_code=trust_remote_code,
        )
        # A partially prefilled request rewinds its sampling generator's offset, which CPU
        # generators do not have ("CPU Generator does not use offset"); whole-prompt prefill
        # keeps per-request seeds usable on CPU.
        chunked = rollout.enable_chunked_prefill and self.on_gpu
        kwargs["enable_chunked_prefill"] = chunked
        kwargs["max_num_batched_tokens"] = (
            rollout.max_num_batched_tokens if chunked else max(rollout.max_num_batched_tokens, max_model_len)
        )
        if torch.distributed.is_initialized():
            kwargs["distributed_executor_backend"] = "external_launcher"
        if self.on_gpu:
            kwargs["gpu_memory_utilization"] = rollout.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = rollout.enable_sleep_mode
        else:
            _patch_vllm_cpu_shm_names()
            _patch_vllm_cpu_token_ranks()
            _patch_vllm_cpu_vocab_mask()
            dtype_bytes = 4 if dtype == "float32" else 2
            kwargs["kv_cache_memory_bytes"] = _cpu_kv_cache_bytes(
                model_path, max_model_len, rollout.max_num_seqs, dtype_bytes
            )
        if rollout.limit_images > 0:  # the most images one prompt may carry (vLLM sizes its buffers by it)
            kwargs["limit_mm_per_prompt"] = {"image": rollout.limit_images}
        self.return_routed_experts = return_routed_experts
        self.tensor_parallel_size = kwargs["tensor_parallel_size"]
        self.stepped_calls = 0
        if return_routed_experts:
            # Routing replay R3. vLLM captures routes only in its V2 model runner, which needs Triton.
            if not self.on_gpu:
                raise ValueError(
                    "actor_rollout_ref.actor.router_replay.mode=R3 needs the experts vLLM chose, which vLLM "
                    "captures only on GPU (its V2 model runner needs Triton); use mode=R2 on CPU"
                )
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
            kwargs["enable_return_routed_experts"] = True
        self.lora_request = None
        """The adapter every request runs with (LoRA adapter sync), None: the weights alone."""
        self.adapter_root: Path | None = None
        if lora_rank:
            # vLLM sizes its LoRA buffers for max_lora_rank, which must be one of its supported sizes.
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=_vllm_lora_rank(lora_rank))
            self.adapter_root = Path(tempfile.mkdtemp(prefix=f"rlhf_lora_{os.getpid()}_", dir=_shm_dir()))
        kwargs.update(rollout.engine_kwargs)
        # vLLM's loader runs two full garbage collections and freezes the heap after its warm-up:
        # in a worker that already holds megatron-core, torch and the trainer's models each pass
        # walks millions of objects (~5 s of a CPU worker's start). Collected once and frozen here,
        # those passes see only what the engine itself allocates.
        gc.collect()
        gc.freeze()
        self.llm = LLM(**kwargs)
        self.sleeping = False
        self.unlinked_shm = _unlink_vllm_shm_segments() if torch.distributed.is_initialized() else []

    # ------------------------------------------------------------------ generation
    def generate_sequences(
        self, prompts: Batch, sampling: RolloutSampling, stop: Callable[[], bool] | None = None
    ) -> Batch:
        """Sample ``sampling.n`` responses per prompt; see ``rollout/base.py`` for the layout.

        With ``stop`` (partial rollout), the engine is stepped here and ``stop()`` is asked before
        every step; once it answers True the requests still running are aborted and come back
        unfinished: the tokens and log-probs sampled so far, ``UNFINISHED_KEY`` = 1 on their rows
        (``continue_sequences`` finishes them, typically under newer weights). Sample ``k`` of
        prompt ``i`` then draws with seed ``seed + i + k``, as vLLM's own fan-out of ``n`` does."""
        from vllm.inputs import TokensPrompt

        if self.sleeping:
            raise RuntimeError("VLLMEngine.generate_sequences called while asleep; call wake_up() first")
        token_lists = prompt_token_lists(prompts)
        media = prompt_media(prompts)
        # With images (videos), the model sees every pad token, not the one placeholder vLLM is given.
        lengths = prompts["attention_mask"].sum(-1).tolist() if media else [len(ids) for ids in token_lists]
        for row, length in enumerate(lengths):
            if length + sampling.response_length > self.max_model_len:
                raise ValueError(
                    f"prompt row {row} has {length} tokens; with response_length={sampling.response_length} "
                    f"it exceeds the engine's max_model_len={self.max_model_len} "
                    "(data.max_prompt_length + data.max_response_length)"
                )
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in token_lists]
        for request, row_media in zip(requests, media or []):
            if row_media:
                request["multi_modal_data"] = row_media
        if stop is not None:
            if self.return_routed_experts:
                raise ValueError(
                    "trainer.partial_rollout cannot keep the experts vLLM routed the tokens sampled before an "
                    "interruption; use actor_rollout_ref.actor.router_replay.mode R2 or turn partial rollout off"
                )
            seed = sampling.seed
            fanned = [
                (request, self._sampling_params(sampling, 1, None if seed is None else seed + row + k))
                for row, request in enumerate(requests)
                for k in range(sampling.n)
            ]
            samples = self._step(fanned, stop)
            batch = assemble_rollout(
                prompts,
                [s[0] for s in samples],
                [s[1] for s in samples],
                sampling.n,
                sampling.response_length,
                self.pad_token_id,
            )
            batch[UNFINISHED_KEY] = torch.tensor([not s[2] for s in samples], dtype=torch.bool)
            return batch
        params = [
            self._sampling_params(sampling, sampling.n, None if sampling.seed is None else sampling.seed + i)
            for i in range(len(requests))
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
        responses, log_probs, routes = [], [], []
        for out in outputs:
            if len(out.outputs) != sampling.n:
                raise RuntimeError(
                    f"vLLM returned {len(out.outputs)} samples for a prompt, expected n={sampling.n}"
                )
            for sample in out.outputs:
                ids = list(sample.token_ids)
                responses.append(ids)
                log_probs.append([step[tok].logprob for tok, step in zip(ids, sample.logprobs or [])])
                routes.append(sample.routed_experts)
        batch = assemble_rollout(
            prompts, responses, log_probs, sampling.n, sampling.response_length, self.pad_token_id
        )
        if self.return_routed_experts:
            lengths = [n for n in lengths for _ in range(sampling.n)]
            width = prompts["input_ids"].shape[1]
            # The actor replays them (models.routing_replay).
            batch["routed_experts"] = assemble_routes(routes, lengths, width, sampling.response_length)
        return batch

    # ------------------------------------------------------------------ multi-turn
    def is_leader(self) -> bool:
        """Whether this process is its engine's first TP rank: the one that runs an agent loop."""
        if self.tensor_parallel_size == 1:
            return True
        from vllm.distributed import get_tp_group

        return get_tp_group().rank_in_group == 0

    def share(self, obj: Any) -> Any:
        """The leader's ``obj`` on every rank of the engine's TP group (its own on one process)."""
        if self.tensor_parallel_size == 1:
            return obj
        from vllm.distributed import get_tp_group

        return get_tp_group().broadcast_object(obj, src=0)

    def generate_turn(
        self, requests: list[tuple[list[int], int, int | None]], sampling: RolloutSampling
    ) -> list[tuple[list[int], list[float], str]]:
        """One assistant turn per ``(token ids so far, most new tokens, seed)`` request (multi-turn
        rollouts, ``agent/loop.py``): the sampled ids, their log-probs and vLLM's finish reason
        (``stop`` or ``length``). Every TP rank of the engine makes the same call."""
        from vllm.inputs import TokensPrompt

        if self.sleeping:
            raise RuntimeError("VLLMEngine.generate_turn called while asleep; call wake_up() first")
        prompts, params = [], []
        for row, (ids, max_new, seed) in enumerate(requests):
            if len(ids) + max_new > self.max_model_len:
                raise ValueError(
                    f"multi-turn sample {row} holds {len(ids)} tokens plus {max_new} to generate, past the "
                    f"engine's max_model_len={self.max_model_len} (data.max_prompt_length + data.max_response_length)"
                )
            prompts.append(TokensPrompt(prompt_token_ids=list(ids)))
            turn = dataclasses.replace(sampling, n=1, response_length=max(int(max_new), 1), seed=None)
            params.append(self._sampling_params(turn, 1, seed))
        outputs = (
            self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
            if prompts
            else []
        )
        results = []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            log_probs = [step[tok].logprob for tok, step in zip(ids, sample.logprobs or [])]
            results.append((ids, log_probs, "length" if sample.finish_reason == "length" else "stop"))
        return results

    def generate_token_ids(
        self, prompts: list[list[int]], sampling: RolloutSampling, stop: Callable[[], bool] | None = None
    ) -> list[tuple[list[int], bool]]:
        """One sample per prompt of token ids, for a client that is not the policy (the LLM judge,
        ``workers/judge.py``): ``(sampled ids, finished)`` per prompt, in order. All prompts are
        added at once and the engine is stepped over them (one batch); ``stop`` is asked before every
        step, and the rows still running when it answers True come back unfinished. Prompt ``i``
        samples with ``sampling.seed + i``."""
        from vllm.inputs import TokensPrompt

        if self.sleeping:
            raise RuntimeError("VLLMEngine.generate_token_ids called while asleep; call wake_up() first")
        seed = sampling.seed
        requests = [
            (
                TokensPrompt(prompt_token_ids=list(ids)),
                self._sampling_params(sampling, 1, None if seed is None else seed + row),
            )
            for row, ids in enumerate(prompts)
        ]
        return [(tokens, done) for tokens, _, done in self._step(requests, stop)] if requests else []

    def continue_sequences(
        self, batch: Batch, sampling: RolloutSampling, stop: Callable[[], bool] | None = None
    ) -> Batch:
        """Finish the rows of ``batch`` (a ``generate_sequences(..., stop=...)`` result) whose
        ``UNFINISHED_KEY`` is set: each continues from its prompt and the tokens it has, for the
        response length left, with the engine's current weights; its new tokens and log-probs are
        appended in place. Finished rows pass through. ``stop`` may interrupt again, leaving rows
        unfinished. ``sampling.seed`` (offset by the row and its length so far) seeds each row."""
        from vllm.inputs import TokensPrompt

        if self.sleeping:
            raise RuntimeError("VLLMEngine.continue_sequences called while asleep; call wake_up() first")
        if UNFINISHED_KEY not in batch.tensor_keys:
            raise ValueError(
                f"continue_sequences needs the {UNFINISHED_KEY!r} column of an interrupted generation"
            )
        rows = batch[UNFINISHED_KEY].nonzero().flatten().tolist()
        out = batch.select()  # new columns to append into; the input stays as it was
        for key in ("responses", "response_mask", "rollout_log_probs", "input_ids", "attention_mask"):
            out[key] = out[key].clone()
        width, room = batch["prompts"].shape[1], batch["responses"].shape[1]
        lengths = batch["response_mask"].sum(-1).tolist()
        prompt_ids = (
            prompt_token_lists(batch)
            if "raw_prompt_ids" in batch.non_tensor_keys
            else [
                row[m.bool()].tolist() for row, m in zip(batch["prompts"], batch["attention_mask"][:, :width])
            ]
        )
        media = prompt_media(batch)
        requests = []
        for row in rows:
            have = int(lengths[row])
            request = TokensPrompt(prompt_token_ids=prompt_ids[row] + batch["responses"][row, :have].tolist())
            if media and media[row]:
                request["multi_modal_data"] = media[row]
            seed = None if sampling.seed is None else (sampling.seed + row + 100_003 * (have + 1)) % 2**31
            left = RolloutSampling(
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                do_sample=sampling.do_sample,
                ignore_eos=sampling.ignore_eos,
                response_length=max(room - have, 1),
            )
            requests.append((request, self._sampling_params(left, 1, seed)))
        unfinished = out[UNFINISHED_KEY].clone()
        for row, (tokens, lps, done) in zip(rows, self._step(requests, stop)):
            have = int(lengths[row])
            new = min(len(tokens), room - have)
            if new:
                span = slice(have, have + new)
                out["responses"][row, span] = torch.as_tensor(tokens[:new], dtype=torch.long)
                out["rollout_log_probs"][row, span] = torch.as_tensor(lps[:new], dtype=torch.float32)
                out["response_mask"][row, span] = 1
            unfinished[row] = not done and have + new < room
        out["input_ids"][:, width:] = out["responses"]
        out["attention_mask"][:, width:] = out["response_mask"].to(out["attention_mask"].dtype)
        out[UNFINISHED_KEY] = unfinished
        return out

    def _sampling_params(self, sampling: RolloutSampling, n: int, seed: int | None):
        from vllm import SamplingParams

        return SamplingParams(
            n=n,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            top_k=0 if sampling.greedy or sampling.top_k == -1 else sampling.top_k,
            max_tokens=sampling.response_length,
            ignore_eos=sampling.ignore_eos,
            logprobs=0,
            detokenize=False,
            seed=seed,
            logit_bias=self.logit_bias,
        )

    def _step(
        self, requests: list, stop: Callable[[], bool] | None
    ) -> list[tuple[list[int], list[float], bool]]:
        """Run ``(prompt, SamplingParams with n=1)`` requests by stepping the engine, asking ``stop``
        before each step (every TP rank of the engine follows its rank 0's answer, so all stop at the
        same step); returns each request's (tokens, log-probs, finished), in order."""
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        self.stepped_calls += 1
        ids = [f"rlhf-{self.stepped_calls}-{i}" for i in range(len(requests))]
        state = {rid: ([], [], [False]) for rid in ids}
        for rid, (prompt, params) in zip(ids, requests):
            params.output_kind = RequestOutputKind.DELTA
            engine.add_request(rid, prompt, params, lora_request=self.lora_request)
        while engine.has_unfinished_requests():
            if stop is not None and self._agree(stop()):
                engine.abort_request([rid for rid in ids if not state[rid][2][0]])
                while engine.has_unfinished_requests():  # let the engine retire what it aborted
                    engine.step()
                break
            for out in engine.step():
                tokens, lps, done = state[out.request_id]
                sample = out.outputs[0]
                new = list(sample.token_ids)
                tokens.extend(new)
                lps.extend(step[tok].logprob for tok, step in zip(new, sample.logprobs or []))
                done[0] = out.finished
        return [(tokens, lps, done[0]) for tokens, lps, done in (state[rid] for rid in ids)]

    def _agree(self, stop: bool) -> bool:
        """The engine's TP rank 0's ``stop`` on every rank of its TP group (one process: ``stop``)."""
        if self.tensor_parallel_size == 1:
            return bool(stop)
        from vllm.distributed import get_tp_group

        return bool(get_tp_group().broadcast_object(bool(stop), src=0))

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights. ``weights`` may be a generator; it is consumed exactly once, streaming."""
        if self.load_format == "hf":
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
            if not self.on_gpu:
                self.llm.apply_model(repack_cpu_experts)
        elif self.on_gpu:
            # Straight into the parameters; vLLM's own kernel-format reload cannot take the
            # per-expert rows (``w13_weight[e]``) the plan sends for mixture-of-experts layers.
            self.llm.apply_model(lambda model: copy_sharded_weights(model, iter(weights)))
        else:
            self.llm.apply_model(lambda model: refit_cpu_in_place(model, iter(weights)))
        self.llm.reset_prefix_cache()
        # reload_weights empties the model runner's cache of vision-encoder outputs (they were
        # computed with the old weights) but not the scheduler's record of what it holds; left
        # alone, the next request with an image the scheduler thinks is cached fails with
        # "Encoder cache miss". Clear both, through the engine.
        self.llm.llm_engine.reset_encoder_cache()

    def load_adapter(self, tensors: dict[str, torch.Tensor], lora: LoraConfig, version: int) -> None:
        """Serve the LoRA adapter ``tensors`` (whole, PEFT keys) from now on, as adapter id ``version``
        (a new id each sync: vLLM caches adapters by id). Written as a PEFT directory under this
        process's own temporary directory (every rank of a TP engine loads it from its own copy),
        the previous one removed from the engine and from disk."""
        from vllm.lora.request import LoRARequest

        from rlhf_megatron.models.lora_io import write_peft_adapter

        if self.adapter_root is None:
            raise RuntimeError("VLLMEngine.load_adapter: the engine was built without LoRA (lora_rank)")
        path = write_peft_adapter(self.adapter_root / f"v{version}", tensors, lora, None)
        old = self.lora_request
        self.lora_request = LoRARequest(f"actor_v{version}", version, str(path))
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Release weights and KV cache between rollouts (GPU); a no-op on CPU."""
        if self.on_gpu and not self.sleeping:
            self.llm.sleep(level=1)
        self.sleeping = True

    def wake_up(self) -> None:
        if self.on_gpu and self.sleeping:
            self.llm.wake_up()
        self.sleeping = False

    def shutdown(self) -> None:
        """Stop the engine core before the process group goes away."""
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        if self.adapter_root is not None:
            shutil.rmtree(self.adapter_root, ignore_errors=True)
