"""Mixture-of-experts on megatron-core: config, layer specs, and what a run can read back.

Role: everything MoE-specific that ``builder.py`` needs to turn a ``ModelArch`` with
``moe`` (Qwen2-MoE, Qwen3-MoE, Mixtral) into megatron-core ``GPTModel``s, plus the
read-outs that training code needs after a forward pass.

- ``moe_config_kwargs``: the ``TransformerConfig`` fields of the HF router and experts.
  Top-k softmax router computed in fp32; ``norm_topk_prob`` (Mixtral: always) maps to
  megatron's top-k-then-softmax, its absence to softmax-then-top-k
  (``moe_router_pre_softmax``); the auxiliary load-balancing loss with HF's
  ``router_aux_loss_coef``; the alltoall token dispatcher; no token dropping (capacity
  factor None). Qwen2-MoE's shared expert with its sigmoid gate.
- ``expert_bias_update_kwargs``: a trained role's aux-loss-free expert-bias update (DeepSeek-V3,
  GLM-4.5), from ``megatron.moe_router_bias_update`` and its rate.
- ``moe_block_spec``: per-layer specs for one model chunk, dense MLP layers among sparse
  ones included (``MoEArch.moe_layers``). Experts are ``SequentialMLP`` with megatron's
  local spec (CPU) and grouped GEMMs with the transformer-engine spec (GPU; same
  interface, not exercised on CPU).
- ``aux_losses`` / ``clear_aux_losses``: megatron's per-layer auxiliary-loss tracker.
- ``ExpertLoadRecorder``: tokens routed to each expert of each layer, from forward hooks
  on the routers (any pass, forward-only included; padding excluded).

The auxiliary loss. Megatron adds, per sparse layer ``l`` and micro-batch of ``T`` valid
tokens on this rank, ``coeff * E / (k * T^2) * sum_i c_li * S_li`` to the backward pass,
where ``c_li`` counts the tokens whose top-k contains expert ``i`` and ``S_li`` sums their
softmax probabilities for ``i`` (``switch_load_balancing_loss_func``). It is not added to
the loss value a ``loss_fn`` returns; the tracker keeps ``sum_i c_li S_li E / (k T^2)``
(the coefficient divided out) per layer. transformers' ``load_balancing_loss_func``
pools the counts and probabilities of all layers first and does not divide by ``k``:
``E * sum_i (sum_l c_li / (T L)) (sum_l S_li / (T L))``. For one sparse layer the two
differ exactly by the factor ``k``; for several they differ in general (megatron sums
per-layer losses, HF multiplies pooled averages). The tests check megatron's value
against an independent computation from the router logits.

Boundaries: imports megatron-core only; reads ``ModelArch``; touches megatron's module
globals only to fix its MoE path without transformer-engine (``enable_moe_without_te``) and its
expert-bias token count under a padding mask (``fix_expert_bias_padding_mask``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from rlhf_megatron.planning.model_arch import ModelArch

__all__ = [
    "ExpertLoadRecorder",
    "aux_losses",
    "clear_aux_losses",
    "enable_moe_without_te",
    "eval_mode",
    "expert_bias_update_kwargs",
    "fix_expert_bias_padding_mask",
    "has_experts",
    "moe_block_spec",
    "moe_config_kwargs",
]

AUX_LOSS_NAME = "load_balancing_loss"
"""The key of megatron's aux-loss tracker for the ``aux_loss`` load-balancing type."""


def enable_moe_without_te() -> None:
    """Fix megatron-core 0.16.1's MoE path where it assumes transformer-engine or CUDA (idempotent).

    1. ``moe_utils.RouterGatingLinearFunction`` tests ``te_general_gemm is not None``,
       but the name is only defined when transformer-engine imports: without TE the
       router raises ``NameError``. Define it as None (the torch fallback then runs).
    2. The alltoall dispatcher turns its split sizes into numpy arrays with
       ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts only CUDA
       tensors; CPU tensors stay tensors and gloo's ``all_to_all_single`` rejects them
       as split sizes. Convert CPU tensors too.

    (The dispatcher's collectives allocate their outputs on ``torch.cuda.current_device()``,
    also in backward; on CPU ``platform.cpu_compat``'s factory wrappers redirect those.)
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.__dict__.setdefault("te_general_gemm", None)
    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(token_dispatcher.maybe_move_tensor_to_cpu, "_rlhf_cpu_numpy", False):
        return

    def move_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    move_to_cpu._rlhf_cpu_numpy = True
    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu


def fix_expert_bias_padding_mask() -> None:
    """Fix megatron-core 0.16.1's expert-bias token count under a padding mask (idempotent).

    ``TopKRouter._apply_expert_bias`` masks the ``[tokens, experts]`` routing map with the
    flattened ``[tokens]`` padding mask, which cannot broadcast: every training forward of a
    router with an expert bias (DeepSeek-V3, GLM-4.5) and a padding mask raises. Mask per token
    row instead, so padding tokens stay out of the loads that move the bias.
    """
    from megatron.core.transformer.moe.router import TopKRouter

    if getattr(TopKRouter._apply_expert_bias, "_rlhf_row_mask", False):
        return

    def apply_expert_bias(self, routing_map, padding_mask=None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    apply_expert_bias._rlhf_row_mask = True
    TopKRouter._apply_expert_bias = apply_expert_bias


def moe_config_kwargs(
    arch: ModelArch, expert_model_parallel_size: int, expert_tensor_parallel_size: int, use_te: bool
) -> dict:
    """``TransformerConfig`` fields for ``arch.moe`` (empty for dense models)."""
    moe = arch.moe
    if moe is None:
        return {}
    kwargs = dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_topk=moe.top_k,
        moe_router_score_function="softmax",
        # HF renormalises softmax(all)[top-k]: equal to megatron's softmax over the top-k logits.
        # Without renormalisation the weights are softmax over all experts, picked after.
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=moe.aux_loss_coef,
        moe_token_dispatcher_type="alltoall",
        moe_expert_capacity_factor=None,  # dropless: every token reaches its k experts
        moe_grouped_gemm=use_te,
        moe_permute_fusion=False,
        # A list marks which layers have experts (1) and which keep the dense MLP (0).
        moe_layer_freq=[int(arch.is_moe_layer(i)) for i in range(arch.num_layers)],
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
    )
    if all(kwargs["moe_layer_freq"]):
        kwargs["moe_layer_freq"] = 1  # homogeneous: layer-stacked tensors in dist-checkpoints
    if moe.shared_expert_ffn_hidden_size is not None:
        kwargs.update(
            moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
            moe_shared_expert_gate=moe.shared_expert_gate,
            moe_shared_expert_overlap=False,
        )
    if moe.score_function == "sigmoid":
        kwargs.update(_sigmoid_router_kwargs(moe))
    return kwargs


def _sigmoid_router_kwargs(moe) -> dict:
    """DeepSeekMoE's router (DeepSeek-V3, GLM-4.5) as the checkpoint describes it.

    megatron's sigmoid routing picks the top-k of ``sigmoid(logits) + expert_bias`` (within the best
    groups), weights them by the plain sigmoid scores renormalised over the k, then multiplies by
    the scaling factor: HF's ``noaux_tc`` with ``norm_topk_prob``. The bias (``router.expert_bias``,
    a buffer loaded from ``e_score_correction_bias``) stays fixed here: megatron's aux-loss-free update
    runs with rate 0, i.e. the checkpoint's balance is kept; a trained role lets it move with
    ``expert_bias_update_kwargs`` (``megatron.moe_router_bias_update``).
    """
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.routed_scaling_factor,
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coef > 0 else "none",
    )


def expert_bias_update_kwargs(arch: ModelArch, update: bool | None, rate: float) -> dict:
    """The ``TransformerConfig`` override of a trained role's expert-bias update (DeepSeek-V3's
    aux-loss-free balancing): ``moe_router_bias_update_rate=rate`` where the routers carry an
    expert bias and ``update`` is not False (``megatron.moe_router_bias_update``; null means on
    for such models), nothing otherwise (the bias stays at the checkpoint's values). megatron
    updates the bias in ``finalize_model_grads`` from the tokens each expert received in the step's
    training passes, summed over the data-parallel ranks."""
    has_bias = arch.moe is not None and arch.moe.expert_bias
    if update and not has_bias:
        raise ValueError(
            f"{arch.architecture}: moe_router_bias_update=true, but its routers have no expert bias to update"
        )
    if not has_bias or update is False:
        return {}
    return {"moe_router_bias_update_rate": rate}


def moe_block_spec(config, use_te: bool, vp_stage: int | None, pp_rank: int):
    """The layer specs of one model chunk (its slice of the dense/sparse layer pattern)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage, pp_rank=pp_rank
    )
    if use_te:
        from megatron.core.transformer.enums import AttnMaskType

        # As for dense models: our masks combine causality with padding, which TE's "causal" ignores.
        for layer in spec.layer_specs:
            layer.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.arbitrary
    return spec


def has_experts(chunk: torch.nn.Module) -> bool:
    """Whether a model chunk (possibly wrapped in DDP / Float16Module) has an MoE layer."""
    inner = chunk
    while hasattr(inner, "module"):
        inner = inner.module
    config = getattr(inner, "config", None)
    return getattr(config, "num_moe_experts", None) is not None


# -- read-outs ---------------------------------------------------------------------------


def aux_losses(num_layers: int, reduce: bool = False) -> dict[int, float]:
    """Megatron's tracked load-balancing loss per sparse layer (global layer index), coefficient
    divided out, summed over the micro-batches since the last ``clear_aux_losses``.

    Only training forward passes (module in training mode, gradients on, coefficient > 0)
    compute it. ``reduce=True`` makes it the model's value: summed over the pipeline stages
    (each holds its own layers) and the tensor/context-parallel group (each of its ranks adds
    its share), averaged over data-parallel ranks. That is a collective every rank of the
    model must reach, including stages without sparse layers (they contribute zeros), so
    call it only when the coefficient is positive (megatron tracks nothing otherwise).
    Without ``reduce`` the values are this rank's shares.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    if AUX_LOSS_NAME in tracker:
        values = tracker[AUX_LOSS_NAME]["values"].detach().clone().float()
    else:
        values = torch.zeros(num_layers)
    if reduce:
        dist = torch.distributed
        dist.all_reduce(values, group=ps.get_pipeline_model_parallel_group())
        dist.all_reduce(values, group=ps.get_tensor_and_context_parallel_group())
        dp_group = ps.get_data_parallel_group()
        dist.all_reduce(values, group=dp_group)  # gloo has no AVG: sum, then divide
        values /= dist.get_world_size(dp_group)
    return {i: float(v) for i, v in enumerate(values.tolist()) if v != 0.0}


def clear_aux_losses() -> None:
    """Zero megatron's aux-loss tracker (call before the micro-batches to be read)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


class ExpertLoadRecorder:
    """Tokens routed to each expert, per sparse layer, while active (a context manager).

    ``with ExpertLoadRecorder(chunks) as load: engine.run(...)``; then ``load.counts``
    maps a global layer index to an int64 ``[num_experts]`` tensor: how many of this
    rank's valid tokens chose each expert (each token counts once per expert in its
    top-k, so a layer's counts sum to ``k x tokens``). Padding tokens are excluded when
    the forward pass is given the padding mask (``forward.model_forward`` does). Counts
    add up over micro-batches; with full activation recomputation a router runs twice
    per micro-batch and counts twice. ``all_reduce(group)`` sums them over a group
    (e.g. the data-parallel group) for a global view.
    """

    def __init__(self, chunks: torch.nn.Module | Sequence[torch.nn.Module]):
        self.chunks = list(chunks) if isinstance(chunks, Sequence) else [chunks]
        self.counts: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def _routers(self) -> Iterator[torch.nn.Module]:
        from megatron.core.transformer.moe.router import TopKRouter

        for chunk in self.chunks:
            yield from (m for m in chunk.modules() if isinstance(m, TopKRouter))

    def _hook(self, router, args, output) -> None:
        routing_map = output[1]  # (tokens, experts) bool, tokens in [s, b] order
        padding = args[1] if len(args) > 1 else None  # (s, b) bool, True = padding
        if padding is not None:
            routing_map = routing_map & ~padding.reshape(-1, 1)
        layer = router.layer_number - 1  # megatron numbers layers from 1, globally
        counts = routing_map.sum(dim=0).to(torch.int64).cpu()
        self.counts[layer] = self.counts.get(layer, torch.zeros_like(counts)) + counts

    def __enter__(self) -> ExpertLoadRecorder:
        self._handles = [r.register_forward_hook(self._hook) for r in self._routers()]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def all_reduce(self, group=None) -> dict[int, torch.Tensor]:
        """The counts summed over ``group`` (every rank of it must call; same layers on each)."""
        for layer in sorted(self.counts):
            torch.distributed.all_reduce(self.counts[layer], group=group)
        return self.counts


@contextlib.contextmanager
def eval_mode(chunks: Sequence[torch.nn.Module]):
    """Forward-only passes of an MoE model in eval mode, restored afterwards.

    megatron's MoE layer refuses to run in training mode with TP > 1 and no sequence
    parallelism (it would count each token's expert gradients once per TP rank); a
    forward-only pass computes no gradients, and with dropout 0 eval mode changes
    nothing else.
    """
    modes = [c.training for c in chunks]
    try:
        for c in chunks:
            c.eval()
        yield
    finally:
        for c, mode in zip(chunks, modes):
            c.train(mode)
