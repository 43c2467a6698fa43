"""One Megatron model on this rank, with its optimizer and schedule: shared by every role.

``MegatronEngine`` owns a model's chunks (one per virtual pipeline stage),
built from an HF checkpoint through ``rlhf_megatron.models``, and — for
trained roles — megatron's DDP wrapper, optimizer (optionally distributed)
and LR scheduler (constant or cosine, with warmup). Roles differ only in the
loss functions they hand to ``run``; the micro-batch loop, the pipeline
schedule, gradient clipping, offloading and checkpointing are written once,
here.

``run(micro_batches, loss_fn, forward_only)`` pushes micro-batches through
``get_forward_backward_func`` (1F1B, interleaved with VPP, or no pipelining):
``loss_fn(output, micro)`` receives the last stage's output (vocabulary-
parallel logits ``[b, s, V/tp]`` or values ``[b, s]``) and returns
``(loss, metrics)``. Megatron divides each micro-batch's loss by the number
of micro-batches; ``loss_fn`` receives ``micro["_weight"]`` (its share of the
mini-batch's rows times the number of micro-batches) to keep uneven
(dynamic-size) micro-batches weighted by rows.

Mixture-of-experts models: megatron's DDP keeps the expert parameters in their own
buffers (reduced over the expert-data-parallel group) and the optimizer in its own
parameter groups (a chained optimizer); offloading, the NaN check and checkpoints
cover both. The router's load-balancing loss enters backward inside megatron, not
through ``loss_fn``; ``train_step`` reports it per sparse layer (``moe_aux_loss``).
Forward-only passes run MoE models in eval mode (see ``models.moe.eval_mode``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlhf_megatron.config.schema import MegatronConfig, OptimConfig
from rlhf_megatron.config.schema_model import LoraConfig
from rlhf_megatron.data.balance import balance_partitions
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.data.multimodal import VISUAL_KEYS, concat_vision_inputs
from rlhf_megatron.data.packing import pack_shared_prompts, packed_outputs
from rlhf_megatron.models.forward import model_forward
from rlhf_megatron.models.moe import aux_losses, clear_aux_losses, eval_mode, expert_bias_update_kwargs
from rlhf_megatron.models.parallel_config import ParallelConfig
from rlhf_megatron.models.routing_replay import RoutingReplay
from rlhf_megatron.planning.model_arch import ModelArch
from rlhf_megatron.platform.fused_adam import fuse_torch_adam


class NonFiniteGradientError(FloatingPointError):
    """Gradients held NaN/inf under ``trainer.nan_policy=stop``; raised before the optimizer step."""


LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, Any]]]
MODEL_KEYS = ("input_ids", "attention_mask", "position_ids")
PER_COLUMN_KEYS = ("segment_ids", "loss_mask")
"""Per-column inputs beside the model's that ``trim_padding`` cuts with them (packed rows' segments,
an SFT row's loss mask)."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def split_micro_batches(
    batch: Batch, keys: Sequence[str], micro_batch_size: int | None = None, max_tokens: int | None = None
) -> list[dict[str, torch.Tensor]]:
    """Cut ``batch`` into micro-batches by count, or by a token budget (dynamic batch size).

    With ``max_tokens``, rows are packed by their real lengths (attention-mask
    sums) into as few micro-batches as fit the budget, balanced by
    Karmarkar-Karp, with row order kept inside each micro-batch. Every
    micro-batch carries ``_rows`` (its row indices) and ``_weight``; with images or videos
    (a ``multi_modal_inputs`` column), also its rows' ``pixel_values`` and
    ``image_grid_thw`` (``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``),
    concatenated in row order.
    """
    n = len(batch)
    if max_tokens:
        lengths = batch["attention_mask"].sum(-1).tolist()
        if max(lengths) > max_tokens:
            raise ValueError(
                f"a sequence of {max(lengths)} tokens exceeds the token budget {max_tokens} "
                "(ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu); raise it"
            )
        k = max(1, math.ceil(sum(lengths) / max_tokens))
        while True:
            parts = balance_partitions(lengths, min(k, n), equal_size=False)
            if all(sum(lengths[i] for i in p) <= max_tokens for p in parts) or k >= n:
                break
            k += 1
        groups = [sorted(p) for p in parts if p]
    else:
        size = micro_batch_size or n
        groups = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    images = batch["multi_modal_inputs"] if "multi_modal_inputs" in batch.non_tensor_keys else None
    micros = []
    for rows in groups:
        index = torch.as_tensor(rows, dtype=torch.long)
        micro = {k: batch[k][index] for k in keys}
        if images is not None:  # the rows' own images, in row order (their first dim is patches)
            micro.update(concat_vision_inputs(images[i] for i in rows))
        micro["_rows"] = index
        micro["_weight"] = torch.tensor(len(rows) * len(groups) / n)
        micros.append(micro)
    return micros


def trim_padding(micro: dict[str, torch.Tensor], multiple: int = 1) -> dict[str, torch.Tensor]:
    """The micro-batch with the columns that are padding in every row cut off both ends.

    Batches are padded to ``max_prompt_length + max_response_length`` for the whole run, but a
    micro-batch's rows are usually much shorter: the prompt region starts with columns that
    are left padding in every row, and the response region ends with columns that every row
    has finished before. Cutting them saves their share of every layer's work. Exact: a
    dropped column is masked for every query, and positions are relative (RoPE) or carried in
    ``position_ids`` (M-RoPE). Only the model inputs are cut; per-token tensors keep their
    full response width ``R`` and ``micro["_response_width"]`` says how many response columns
    the model sees (the loss functions pad their results back to ``R``); ``micro["_columns"]``
    is ``[left, right, S]``, the columns kept of the ``S`` there were (routing replay maps
    its per-column routes with it). ``multiple``: the
    width stays a multiple of it (sequence parallelism needs a multiple of the TP size), by
    keeping prompt padding, else trailing response padding; a batch whose full width is not a
    multiple stays as wide as it is (``MegatronEngine.run`` refuses it).
    """
    mask = micro["attention_mask"]
    width = mask.shape[1]
    used = torch.nonzero(mask.any(0)).flatten()
    if used.numel() == 0:
        return micro
    left, right = int(used[0]), int(used[-1]) + 1
    out = dict(micro)
    if "responses" in micro:
        prompt_width = width - micro["responses"].shape[1]
        kept = max(right - prompt_width, 1)  # keep one response column, so every slice is non-empty
        right = prompt_width + kept
        out["_response_width"] = kept
    left = min(left, right - 1)
    if multiple > 1:
        left = right - -(-(right - left) // multiple) * multiple
        if left < 0:  # not enough prompt padding: keep more (padding) response columns instead
            right, left = min(width, right - left), 0
            if "_response_width" in out:
                out["_response_width"] = right - (width - micro["responses"].shape[1])
    for key in (*MODEL_KEYS, *PER_COLUMN_KEYS):
        if key in micro:  # position_ids may be [b, 3, S] (M-RoPE)
            out[key] = micro[key][..., left:right]
    out["_columns"] = torch.tensor([left, right, width])
    return out


def response_outputs(output: torch.Tensor, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model outputs at the positions that predict the micro-batch's response tokens, ``[b, w, ...]``:
    ``output[:, -w - 1 : -1]`` for the ``w`` response columns the model saw (all ``R`` untrimmed),
    or, for a packed micro-batch (``data.packing``), gathered at its ``_response_index``."""
    if "_response_index" in micro:
        return packed_outputs(output, micro["_response_index"])
    width = micro.get("_response_width", micro["responses"].shape[1])
    return output[:, -width - 1 : -1]


def pad_responses(values: torch.Tensor, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[b, w, ...]`` per-response-token values back to the full ``[b, R, ...]`` (zeros past ``w``)."""
    missing = micro["responses"].shape[1] - values.shape[1]
    if missing == 0:
        return values
    pad = values.new_zeros((values.shape[0], missing, *values.shape[2:]))
    return torch.cat([values, pad], dim=1)


def _check_moe_training(arch: ModelArch, parallel: ParallelConfig) -> None:
    """megatron trains MoE layers under TP only with sequence parallelism: without it every TP
    rank routes the same tokens and the experts' gradients count each token once per rank
    (megatron refuses in its MoE layer's forward)."""
    tp = parallel.tensor_model_parallel_size
    if tp > 1 and not parallel.sequence_parallel:
        raise ValueError(
            f"{arch.architecture}: training a mixture-of-experts model with tensor_model_parallel_size={tp} "
            "needs the role's megatron.sequence_parallel=true (or tensor_model_parallel_size=1, splitting "
            "the experts with expert_model_parallel_size instead)"
        )


def packs_prompts(arch: ModelArch, parallel: ParallelConfig) -> bool:
    """Whether shared-prompt packing applies to this model and layout: dense text models (a
    mixture-of-experts router would count each prompt token once instead of ``n`` times in its
    load-balancing loss; images carry M-RoPE positions; megatron's multi-latent attention takes
    its rotary positions from the column index, so packed responses would not restart theirs)
    without context parallelism (which splits each row's sequence by position)."""
    return (
        arch.moe is None and arch.vision is None and arch.mla is None and parallel.context_parallel_size == 1
    )


def _use_te(transformer_impl: str, lora: LoraConfig | None) -> bool | None:
    """The builder's ``use_te``: LoRA's adapters hook megatron's local linears (transformer-engine
    fuses the norm into its QKV/FC1 linears, whose input is then not the adapter's)."""
    if lora is not None:
        if transformer_impl == "transformer_engine":
            raise ValueError(
                "actor_rollout_ref.model.lora_rank > 0 adapts megatron's local layers; set "
                "actor_rollout_ref.actor.megatron.transformer_impl=local (or auto) instead of transformer_engine"
            )
        return False
    return {"auto": None, "transformer_engine": True, "local": False}[transformer_impl]


def release_storages(tensors) -> list[tuple[torch.UntypedStorage, torch.Tensor]]:
    """Copy each distinct storage under ``tensors`` to host memory (pinned when it is on a GPU)
    and free it (resized to 0 bytes); the tensors and every view of them stay valid objects.
    Returns what ``restore_storages`` needs to refill them in place."""
    saved, seen = [], set()
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        pinned = storage.device.type == "cuda"
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
        host.copy_(_bytes_of(storage), non_blocking=pinned)
        saved.append((storage, host))
    if any(s.device.type == "cuda" for s, _ in saved):
        torch.cuda.synchronize()  # the copies must land before the memory goes
    for storage, _ in saved:
        storage.resize_(0)
    return saved


def restore_storages(saved: list[tuple[torch.UntypedStorage, torch.Tensor]]) -> None:
    """Give every storage ``release_storages`` freed its memory and bytes back."""
    for storage, host in saved:
        storage.resize_(host.numel())
        _bytes_of(storage).copy_(host, non_blocking=storage.device.type == "cuda")
    if any(s.device.type == "cuda" for s, _ in saved):
        torch.cuda.synchronize()


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class MegatronEngine:
    """A Megatron model (plus optimizer and scheduler when trained) on this rank."""

    def __init__(
        self,
        arch: ModelArch,
        parallel: ParallelConfig,
        hf_path: str,
        megatron: MegatronConfig,
        optim: OptimConfig | None = None,
        *,
        total_steps: int = 1,
        variable_seq_lengths: bool = False,
        freeze_vision_tower: bool = False,
        routing_replay: bool = False,
        pack_prompts: bool = False,
        lora: LoraConfig | None = None,
    ):
        """A model from ``hf_path`` laid out per ``parallel``; trained with ``optim`` (its
        schedule spanning ``total_steps``), or frozen when ``optim`` is None. ``megatron``
        gives the dtype, recomputation and the distributed-optimizer switch;
        ``freeze_vision_tower`` keeps a vision-language model's tower out of training (no
        gradients, no optimizer state); ``routing_replay`` builds a mixture-of-experts model
        whose routers can record and replay their choices (``self.routing``); ``pack_prompts``
        packs the micro-batches of responses per prompt (``data.packing``; dense text models
        without context parallelism, see ``packs_prompts``); ``lora``: train adapters on the frozen
        base (``models.lora``), started from ``lora.adapter_path`` when set."""
        from rlhf_megatron.models.loader import load_hf_weights

        self.arch = arch
        self.parallel = parallel
        self.pack_prompts = pack_prompts and packs_prompts(arch, parallel)
        if arch.moe is not None and optim is not None:
            _check_moe_training(arch, parallel)
        overrides: dict[str, Any] = {}
        if megatron.recompute_granularity:
            overrides["recompute_granularity"] = megatron.recompute_granularity
            if megatron.recompute_granularity == "full":
                overrides["recompute_method"] = megatron.recompute_method or "uniform"
                overrides["recompute_num_layers"] = megatron.recompute_num_layers or 1
        if variable_seq_lengths:
            overrides["variable_seq_lengths"] = True
        if routing_replay:
            overrides["moe_enable_routing_replay"] = True
        if optim is not None and lora is None:  # a frozen model (or LoRA base) keeps its expert bias
            overrides |= expert_bias_update_kwargs(
                arch, megatron.moe_router_bias_update, megatron.moe_router_bias_update_rate
            )
        from rlhf_megatron.models.builder import build_gpt_model  # megatron-core: workers only

        self.chunks = build_gpt_model(
            arch,
            parallel,
            params_dtype=DTYPES[megatron.params_dtype],
            use_te=_use_te(megatron.transformer_impl, lora),
            init_weights=False,
            freeze_vision_tower=freeze_vision_tower,
            attention_backend=megatron.attention_backend,
            **overrides,
        )
        load_hf_weights(self.chunks, hf_path, arch)
        self.lora = lora
        """The adapters' settings (from ``lora.adapter_path``'s PEFT config when set); None: full training."""
        self.adapter_params = self._attach_lora(lora) if lora is not None else 0
        """Adapter parameters on this rank (0 without LoRA)."""
        self.config = self.chunks[0].config
        self.optimizer = None
        self.scheduler = None
        if optim is not None:
            self._setup_training(optim, megatron.use_distributed_optimizer, total_steps)
        else:
            for chunk in self.chunks:
                chunk.requires_grad_(False)
                chunk.eval()
        # after the DDP wrapping: the schedule hands ``step`` the chunks as wrapped
        self.routing = self._routing_replay() if routing_replay else None

    # ------------------------------------------------------------------ training set-up
    def _attach_lora(self, lora: LoraConfig) -> int:
        """Adapters on the loaded base (frozen from here on), from ``lora.adapter_path`` if set."""
        from megatron.core import parallel_state as ps

        from rlhf_megatron.models.lora import (
            attach_lora,
            load_full_adapter_tensors,
            peft_keys,
            resolve_targets,
        )
        from rlhf_megatron.models.lora_io import read_peft_adapter

        tensors = None
        if lora.adapter_path:  # the adapter's own rank, alpha and modules
            lora, tensors = read_peft_adapter(lora.adapter_path, self.arch)
            self.lora = lora
        count = attach_lora(
            self.chunks,
            self.arch,
            lora,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=self.parallel.tensor_model_parallel_size,
            sequence_parallel=self.parallel.sequence_parallel,
        )
        if tensors is not None:
            load_full_adapter_tensors(
                self.chunks,
                tensors,
                ps.get_tensor_model_parallel_rank(),
                f"actor_rollout_ref.model.lora_adapter_path={lora.adapter_path}",
                expected=peft_keys(resolve_targets(self.arch, lora)),
            )
        return count

    def load_adapters(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Whole PEFT-keyed adapter tensors into this rank's adapters (a checkpoint's)."""
        from megatron.core import parallel_state as ps

        from rlhf_megatron.models.lora import load_full_adapter_tensors, peft_keys, resolve_targets

        load_full_adapter_tensors(
            self.chunks,
            tensors,
            ps.get_tensor_model_parallel_rank(),
            source,
            expected=peft_keys(resolve_targets(self.arch, self.lora)),
        )

    def full_adapters(self) -> dict[str, torch.Tensor]:
        """Every adapter as whole PEFT-keyed tensors, on every rank (collective over TP and PP)."""
        from megatron.core import parallel_state as ps

        from rlhf_megatron.models.lora import full_adapter_tensors

        return full_adapter_tensors(
            self.chunks, ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
        )

    def _buffers(self) -> list:
        """DDP's gradient/parameter buffers of every chunk, the expert-parallel ones included."""
        return [
            buf
            for chunk in self.chunks
            for buf in (*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", []))
        ]

    def _setup_training(self, optim: OptimConfig, distributed_opt: bool, total_steps: int) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        p = self.parallel
        sharding = (
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
            p.context_parallel_size,
            p.expert_model_parallel_size,
            p.expert_tensor_parallel_size,
        )
        self.grads_replicated = all(size == 1 for size in sharding) and not distributed_opt
        """Every rank holds the whole model and, once DDP has all-reduced them, the same gradients."""
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=distributed_opt,
            overlap_grad_reduce=False,
        )
        self.chunks = [
            DistributedDataParallel(self.config, ddp_cfg, chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(self.chunks)
        ]
        # What megatron's schedules call around backward (Megatron-LM's training loop sets the
        # same): no gradient all-reduce until the last micro-batch, then the data-parallel
        # reduction (averaged over DP ranks), the tied-embedding and layer-norm all-reduces.
        # Without finalize_model_grads, data-parallel ranks would each step on their own grads.
        from megatron.core.distributed import finalize_model_grads

        self.config.no_sync_func = (
            [c.no_sync for c in self.chunks] if len(self.chunks) > 1 else self.chunks[0].no_sync
        )
        self.config.finalize_model_grads_func = finalize_model_grads
        opt_cfg = OptimizerConfig(
            optimizer="adam",
            lr=optim.lr,
            min_lr=optim.lr * (optim.min_lr_ratio or 0.0),
            weight_decay=optim.weight_decay,
            adam_beta1=optim.betas[0],
            adam_beta2=optim.betas[1],
            clip_grad=optim.clip_grad,
            bf16=self.config.bf16,
            fp16=self.config.fp16,
            params_dtype=self.config.params_dtype,
            use_distributed_optimizer=distributed_opt,
        )
        self.optimizer = get_megatron_optimizer(opt_cfg, self.chunks)
        fuse_torch_adam(self.optimizer)  # torch's fused AdamW kernel, on CPU and CUDA
        warmup = optim.lr_warmup_steps
        if warmup < 0:
            warmup = int(optim.lr_warmup_steps_ratio * total_steps)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if warmup > 0 else optim.lr,
            max_lr=optim.lr,
            min_lr=opt_cfg.min_lr,
            lr_warmup_steps=warmup,
            lr_decay_steps=max(total_steps, warmup + 1),
            lr_decay_style=optim.warmup_style,
            start_wd=opt_cfg.weight_decay,
            end_wd=opt_cfg.weight_decay,
            wd_incr_steps=max(total_steps, 1),
            wd_incr_style="constant",
        )
        self.scheduler.step(0)

    def _routing_replay(self) -> RoutingReplay:
        from megatron.core import parallel_state as ps

        return RoutingReplay(
            self.chunks,
            self.arch.num_layers,
            self.arch.moe.top_k,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=self.parallel.tensor_model_parallel_size,
            tp_group=ps.get_tensor_model_parallel_group(),
            sequence_parallel=self.parallel.sequence_parallel,
        )

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else 0.0

    # ------------------------------------------------------------------ the micro-batch loop
    def run(
        self, micro_batches: list[dict[str, torch.Tensor]], loss_fn: LossFn, forward_only: bool
    ) -> list[dict]:
        """Forward (and backward) over the micro-batches; per-micro-batch metrics on the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data_iter, chunk):
            micro = next(data_iter)
            extra = {k: micro[k] for k in (*VISUAL_KEYS, "segment_ids") if k in micro}
            if self.routing is not None:
                self.routing.before_forward(chunk, micro)
            output = model_forward(
                chunk,
                micro["input_ids"],
                micro["attention_mask"],
                micro["position_ids"],
                self.arch.sliding_window,
                **extra,
            )
            if self.routing is not None:
                self.routing.after_forward(chunk, micro)
            return output, lambda out: loss_fn(out.squeeze(-1) if out.shape[-1] == 1 else out, micro)

        # Trim padding columns (or pack responses per prompt) when every micro-batch may have its
        # own width: always without pipelining, and with it only when megatron exchanges shapes
        # between stages.
        if self.parallel.pipeline_model_parallel_size == 1 or self.config.variable_seq_lengths:
            multiple = self.parallel.tensor_model_parallel_size if self.parallel.sequence_parallel else 1
            multiple *= (
                2 * self.parallel.context_parallel_size if self.parallel.context_parallel_size > 1 else 1
            )
            micro_batches = [self._narrow(m, multiple) for m in micro_batches]
        # Workers receive batches in host memory; the model and the loss need them on its device.
        device = next(self.chunks[0].parameters()).device
        if device.type != "cpu":
            micro_batches = [
                {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in m.items()}
                for m in micro_batches
            ]
        n_chunks = len(self.chunks)
        if n_chunks > 1 and len(micro_batches) % self.parallel.pipeline_model_parallel_size:
            raise ValueError(
                f"the interleaved (VPP) schedule needs a multiple of PP={self.parallel.pipeline_model_parallel_size} "
                f"micro-batches, got {len(micro_batches)}; change the micro-batch size"
            )
        seq = micro_batches[0]["input_ids"].shape[1]
        if self.parallel.sequence_parallel:
            tp = self.parallel.tensor_model_parallel_size
            odd = sorted({m["input_ids"].shape[1] for m in micro_batches if m["input_ids"].shape[1] % tp})
            if odd:
                raise ValueError(
                    f"sequence parallelism splits every sequence over TP={tp} ranks, but this batch is {odd[0]} "
                    f"columns wide; make data.max_prompt_length + data.max_response_length a multiple of {tp} "
                    "or set the role's megatron.sequence_parallel=false"
                )
        mbs = max(m["input_ids"].shape[0] for m in micro_batches)
        context = torch.no_grad() if forward_only else contextlib.nullcontext()
        moe_eval = eval_mode(self.chunks) if forward_only and self.arch.moe else contextlib.nullcontext()
        with context, moe_eval:
            return get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=[iter(micro_batches) for _ in self.chunks]
                if n_chunks > 1
                else iter(micro_batches),
                model=self.chunks if n_chunks > 1 else self.chunks[0],
                num_microbatches=len(micro_batches),
                seq_length=seq,
                micro_batch_size=mbs,
                forward_only=forward_only,
            )

    def _narrow(self, micro: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
        """``micro`` packed per prompt where this engine packs and the micro-batch allows it, else
        with its padding columns trimmed."""
        if self.pack_prompts and "responses" in micro:
            packed = pack_shared_prompts(micro, multiple)
            if packed is not None:
                return packed
        return trim_padding(micro, multiple)

    def train_step(
        self,
        micro_batches: list[dict[str, torch.Tensor]],
        loss_fn: LossFn,
        nan_policy: str = "stop",
        where: str = "",
    ) -> dict[str, Any]:
        """One optimizer step over a mini-batch: zero grads, forward/backward, NaN check, clip, step, LR step.

        ``nan_policy`` (``trainer.nan_policy``): when any rank's gradients are not finite,
        ``stop`` raises ``NonFiniteGradientError`` (prefixed with ``where``, e.g. "[actor]
        rank 0 step 3") and ``skip`` zeroes the gradients and returns without an optimizer
        or scheduler step (``nan_skipped``). Either way the weights are untouched.
        """
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.arch.moe is not None:
            clear_aux_losses()
        metrics = self.run(micro_batches, loss_fn, forward_only=False)
        tracked = self.arch.moe is not None and self.config.moe_aux_loss_coeff
        moe = self._moe_aux_loss(len(micro_batches)) if tracked else {}
        bad_ranks = self._ranks_with_nonfinite_grads()
        if bad_ranks:
            if nan_policy != "skip":
                raise NonFiniteGradientError(
                    f"{where}: gradients hold NaN/inf on rank(s) {bad_ranks} of this role; the optimizer step "
                    "was not taken, so the weights are unpoisoned. Check rewards/advantages for NaN, lower the LR "
                    "or set trainer.nan_policy=skip to drop such updates"
                )
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            return {
                "metrics": metrics,
                "grad_norm": float("nan"),
                "update_ok": False,
                "nan_skipped": True,
                **moe,
            }
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(1)
        return {
            "metrics": metrics,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "update_ok": bool(ok),
            "nan_skipped": False,
            **moe,
        }

    def _moe_aux_loss(self, num_micro_batches: int) -> dict[str, Any]:
        """``moe_aux_loss``: {sparse layer: load-balancing loss (coefficient divided out), mean over the
        micro-batches and data-parallel ranks}; ``moe_aux_loss_coeff`` scales what entered backward.
        A collective over the role (every rank reaches it once per step)."""
        per_layer = aux_losses(self.arch.num_layers, reduce=True)
        return {
            "moe_aux_loss": {layer: v / num_micro_batches for layer, v in per_layer.items()},
            "moe_aux_loss_coeff": float(self.config.moe_aux_loss_coeff),
        }

    def _ranks_with_nonfinite_grads(self) -> list[int]:
        """Ranks (of the role's world) whose gradient buffers hold NaN/inf; the same list on every rank.

        A collective over the whole role: every rank reaches it once per ``train_step``, so
        they agree to skip (or stop) together and no rank steps its shard alone. DDP grad
        buffers hold every parameter's gradient (fp32, ``grad_reduce_in_fp32``). Where every
        rank holds the same all-reduced gradients (``grads_replicated``: data parallelism only,
        no distributed optimizer) the ranks agree without the collective.
        """
        grads = [buf.grad_data for buf in self._buffers()]
        # A sum is NaN/inf when any element is; only then is the exact (and ~30x slower,
        # allocating) elementwise check needed, which also clears a sum that merely overflowed.
        local_bad = any(
            not bool(torch.isfinite(g.sum())) and not bool(torch.isfinite(g).all()) for g in grads
        )
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        if self.grads_replicated:  # each rank's verdict is every rank's: no collective needed
            return list(range(world)) if local_bad else []
        device = grads[0].device if grads else torch.device("cpu")
        flags = torch.zeros(world, dtype=torch.float32, device=device)
        flags[rank] = float(local_bad)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        return [r for r in range(world) if flags[r] > 0]

    # ------------------------------------------------------------------ offload (GPU colocation)
    @contextlib.contextmanager
    def offloaded(self, params: bool, grads: bool, optimizer: bool):
        """Inside the block, the chosen state lives in (pinned) host memory and its GPU memory is
        free for vLLM (GPU only): ``params`` the model's weights (DDP's parameter buffers and any
        parameter outside them, e.g. a frozen reference model's), ``grads`` DDP's gradient buffers,
        ``optimizer`` the optimizer's fp32 main parameters and Adam moments.

        Parameters and ``main_grad`` are views into DDP's buffers, so re-pointing a buffer would
        leave its memory held by the views: the storages themselves are emptied and refilled in
        place (``release_storages``), and every view is valid again after the block.
        """
        if not torch.cuda.is_available() or not (params or grads or optimizer):
            yield
            return
        tensors: list[torch.Tensor] = []
        if params:
            tensors += [p for chunk in self.chunks for p in chunk.parameters()]
        if grads:
            tensors += [
                buf.grad_data for buf in self._buffers() if getattr(buf, "grad_data", None) is not None
            ]
        if optimizer and self.optimizer is not None:
            for opt in self._sub_optimizers():
                inner = getattr(opt, "optimizer", opt)
                tensors += [p for group in inner.param_groups for p in group["params"]]
                tensors += [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v)]
        saved = release_storages(t for t in tensors if t.is_cuda)
        torch.cuda.empty_cache()
        try:
            yield
        finally:
            restore_storages(saved)

    # ------------------------------------------------------------------ checkpoints
    def _sub_optimizers(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer])

    def state_for_checkpoint(self) -> dict[str, Any]:
        """Optimizer and scheduler state of this rank (the model goes through dist-checkpointing).

        The distributed optimizer keeps its fp32 main parameters and Adam moments in
        bucket shards outside ``state_dict()``; they are saved as this rank's
        "dp-reshardable" parameter state, so a resume needs the same layout.
        """
        if self.optimizer is None:
            return {}
        subs = []
        for opt in self._sub_optimizers():
            inner = getattr(opt, "optimizer", None)  # the torch optimizer megatron-core wraps
            if inner is not None and not inner.state:
                # Never stepped (every update so far was skipped by nan_policy=skip, or the role is
                # still in critic_warmup): Adam has no moments yet, and megatron-core's distributed
                # optimizer cannot serialise that (CPU: it asserts on the missing "step"). A fresh
                # optimizer is the same state; only the loss scale, if any, is worth keeping.
                scaler = getattr(opt, "grad_scaler", None)
                subs.append({"never_stepped": True, "grad_scaler": scaler.state_dict() if scaler else None})
                continue
            entry = {"state_dict": opt.state_dict()}
            if hasattr(opt, "get_parameter_state_dp_reshardable"):
                param_state = opt.get_parameter_state_dp_reshardable()
                # megatron-core 0.16's loader filters entries on a "padding" flag that its own
                # getter does not set; every entry it returns is a real parameter.
                for key, dtype_state in param_state.items():
                    if isinstance(key, int):
                        for buckets in dtype_state.values():
                            for bucket in buckets:
                                for elem in bucket:
                                    elem.setdefault("padding", False)
                entry["param_state"] = param_state
            subs.append(entry)
        return {"optimizers": subs, "scheduler": self.scheduler.state_dict()}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        if self.optimizer is None or "optimizers" not in state:
            return
        subs = self._sub_optimizers()
        if len(subs) != len(state["optimizers"]):
            raise ValueError(
                f"checkpoint has {len(state['optimizers'])} optimizer(s), this model has {len(subs)}; "
                "resume with the parallel layout the checkpoint was saved with"
            )
        with torch.no_grad():  # main params are leaves that require grad; copying into them is not a step
            for opt, entry in zip(subs, state["optimizers"]):
                if entry.get("never_stepped"):
                    opt.reload_model_params()  # fp32 main params follow the just-loaded model
                    if entry.get("grad_scaler") and getattr(opt, "grad_scaler", None):
                        opt.grad_scaler.load_state_dict(entry["grad_scaler"])
                    continue
                opt.load_state_dict(entry["state_dict"])
                # Without apex/TE (CPU), megatron-core 0.16's DistributedOptimizer.load_state_dict
                # gives every parameter's Adam state the *same* "step" tensor; torch's Adam then
                # increments it once per parameter per step, corrupting bias correction after a
                # resume. Give each parameter its own counter.
                inner = getattr(opt, "optimizer", None)
                for param_state in getattr(inner, "state", {}).values():
                    if torch.is_tensor(param_state.get("step")):
                        param_state["step"] = param_state["step"].clone()
                if "param_state" in entry:
                    opt.load_parameter_state_from_dp_reshardable(entry["param_state"])
        self.scheduler.load_state_dict(state["scheduler"])
