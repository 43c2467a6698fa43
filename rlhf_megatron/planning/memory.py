"""Per-GPU memory estimate of a config, before anything is launched (``rlhf-megatron plan``).

Role: from the architecture numbers and the parallel layout, estimate what one GPU holds
for every role and every phase of a PPO step, and whether the peak fits
``trainer.gpu_memory_gb``. The model:

* Training state per parameter on a GPU (Megatron mixed precision): bf16 weights (2 B),
  fp32 main gradients (4 B), fp32 master weights + Adam m and v (12 B). The distributed
  optimizer shards the 12 B over the DP group (Megatron's 6 + 12/DP bytes per parameter).
  A rank holds its pipeline stage's layers / TP; the first stage adds the embedding, the
  last the final norm and LM head (or value head).
* Activations per layer follow Korthikanti et al. 2022 ("Reducing Activation Recomputation
  in Large Transformer Models"), adapted to RMSNorm, GQA and SwiGLU without dropout (RL
  fine-tuning runs with dropout 0): per token, 4h (norm inputs and outputs) + (2 q + 2 kv
  + 3 ffn widths) in the activation dtype, plus the softmax when attention is not
  recomputed: 2 a s bytes per token with transformer-engine (Korthikanti's term; not measured
  here), 6 a s with megatron's local attention (``megatron.transformer_impl=local``, or
  ``auto`` on CPU), which keeps the fp32 softmax output and its bf16 copy and also holds a
  bf16 buffer of one layer's scores (megatron's global memory buffer) once it has run; the
  local figures were measured on an H100 (``tools/gpu/measure.py``,
  ``docs/gpu_h100_measure.json``). Local layers with torch's fused attention
  (``megatron.attention_backend=sdpa``, or ``auto`` on GPU) keep no scores (only each row's
  log-sum-exp) and do not repeat K and V (measured on an H200, ``docs/gpu_h200_mfu*.json``). With sequence parallelism everything divides by TP,
  otherwise the 4h part does not; CP divides the sequence. Selective recomputation drops
  the softmax term; full recomputation keeps only each layer's input plus the layers being
  recomputed. The first 1F1B stage holds PP micro-batches in flight (x (1 + (PP-1)/(PP VPP))
  with interleaving); the last stage holds one plus the logits.
* Logits of a micro-batch (vocab / TP per rank): the LM head's bf16 logits over every token,
  the loss functions' fp32 blocks (they go through the logits in blocks of 32 Mi logits and
  recompute the softmax in backward), and for an update one gradient of the logits' size (the
  response window's, then widened to every position). Measured on an H100 before the loss functions
  worked in blocks: 7.25 fp32 copies of the response window's logits at an update's peak, 3.0
  for a log-prob pass. A forward-only pass frees each layer's activations as it goes, so its
  peak is the larger of one layer's and the logits' (two copies of them for a moment: megatron
  writes them sequence-first and copies them batch-first).
* vLLM claims ``gpu_memory_utilization`` x GPU memory for weights (bf16 / rollout TP), its
  profiling activations and the KV cache; the KV cache gets what is left.
* Phases of a colocated step: weight sync, generation, old/ref log-probs, critic values,
  critic update, actor update. Outside its own phase a role keeps what its offload flags
  do not move to CPU; vLLM keeps its weights unless sleep mode offloads them, and its KV
  cache unless ``free_cache_engine``/sleep mode frees it. The peak is the max over phases.
* Disaggregated (``actor_rollout_ref.hybrid_engine=false``): two pools, each with its own
  phases and peak. The trainer pool (``trainer.nnodes x n_gpus_per_node``) runs the same
  phases less generation, with no vLLM memory at all; a weight sync there stages two of the
  cross-pool sender's buckets. The rollout pool (``rollout.nnodes x n_gpus_per_node``) holds
  only vLLM (weights / rollout TP, overhead, KV cache within its budget), plus up to three
  received buckets while it loads a new version.

Roles' worst pipeline stages are summed as if on one GPU, which errs on the safe side.

LoRA (``actor_rollout_ref.model.lora_rank > 0``, terms in ``planner_lora.py``): the actor's base
weights are frozen and held once in the model dtype; only its adapters (fp32, counted per
pipeline stage and TP rank from ``config.lora_targets.resolve_targets``) have weights in fp32, fp32 main
grads and Adam m and v (no master copy: they are fp32 already), and an update keeps each
adapted linear's fp32 input copy. The actor's layers are megatron's local ones (the adapters
hook them): ``transformer_impl=auto`` reads as local. The reference policy is the actor with its
adapters off: it has no weights of its own, runs in the actor's layout, and its log-prob phase
brings the actor's weights back (``ref`` keeps only its activations and logits). vLLM holds one
adapter slot beside the base weights. The weight-sync phase still counts the actor's weights on
the GPU, although only the adapters are sent (it errs on the safe side and is rarely the peak).

Mixture-of-experts models: a rank holds its stage's dense parts (attention, norms, routers,
shared experts, dense MLPs, embedding) split by TP, and its stage's routed experts split by
EP x ETP; the experts' fp32 grads and Adam state shard over the expert data-parallel group
(world / (ETP x EP x PP)) with the distributed optimizer, the dense parts' over DP. Per
token, a sparse layer keeps k dispatched copies of its input and each copy's expert
activations (fc1 gate/up and product, / ETP), the router's fp32 logits and probabilities
and the shared expert's activations; one layer's all-to-all send and receive buffers (k
copies of every token, x ETP after the expert-TP gather) are added as a transient. vLLM
holds every expert, split by its TP (its expert parallelism is off). The first line of the
plan gives total and active (per token) parameters.

Multi-latent attention (DeepSeek-V3, Kimi-K2): a layer keeps its query and key/value latents
(before and after their norms, and the shared rotary key: not split by TP, as megatron's
down-projections are not) and per head the query, the up-projected key and value, the assembled
key and the output (/ TP), in place of GQA's q, k, v widths. vLLM caches the latent and the rotary
key per token and layer (``kv_lora_rank + qk_rope_head_dim`` values, the same on every rollout TP
rank) instead of a key and a value per KV head. Parameters count the latent projections and norms
(``arch.count_attention_parameters``); sparse layers count their shared experts and expert bias,
and the leading dense layers (``first_k_dense_replace``) their full MLP.

Vision-language models: the vision tower's parameters count on the first pipeline stage
(with the embedding) and in vLLM's weights. Images enter the language model as placeholder
tokens, one per merged patch (``t·h·w / m²`` per image, e.g. 1,024 for an 896 x 896 image
with Qwen2.5-VL's 14-pixel patches merged 2 x 2) that the processor writes into the prompt,
so ``data.max_prompt_length`` must already include them and the sequence length planned
here (prompt + response) counts them like text. The tower's own activations (``m²``
patches per image token through its blocks, on the first stage) are not modelled: leave
headroom on the first stage for image-heavy prompts.

Boundaries: arithmetic only; reads a loaded config. The CLI wrapper is ``rlhf_megatron.cli``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from rlhf_megatron.config import roles as roles_mod
from rlhf_megatron.config.errors import ConfigError
from rlhf_megatron.config.roles import (
    ACTOR_TRAIN_MICRO,
    CRITIC_TRAIN_MICRO,
    MICRO_BATCH_SPECS,
    active_roles,
    data_parallel_size,
    megatron_section,
)
from rlhf_megatron.planning.arch import arch_for_role, count_parameters, kv_cache_values_per_token
from rlhf_megatron.planning.memory_lora import AdapterPlan, adapter_plan
from rlhf_megatron.planning.model_arch import ModelArch

__all__ = [
    "GIB",
    "ROLLOUT_POOL",
    "TRAINER_POOL",
    "MemoryPlan",
    "Phase",
    "RoleMemory",
    "RolloutMemory",
    "format_plan",
    "plan_memory",
]

GIB = 1024**3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# CUDA context, NCCL communicators and allocator fragmentation, per GPU, in every phase.
RUNTIME_OVERHEAD_GIB = 3.0
# In CPU mode: the process's own footprint (interpreter, torch, vLLM, gloo buffers).
CPU_RUNTIME_OVERHEAD_GIB = 1.0
# vLLM memory outside torch tensors (its own CUDA context share, NCCL for its TP group).
VLLM_NON_TORCH_GIB = 0.5
# CUDA graphs captured when enforce_eager is off.
VLLM_CUDA_GRAPH_GIB = 1.0

_SPECS = {spec.per_gpu_key: spec for spec in MICRO_BATCH_SPECS}
# per-GPU micro-batch key -> the token budget used instead when dynamic batching is on
_TOKEN_BUDGETS = {
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
    "critic.ppo_micro_batch_size_per_gpu": "critic.ppo_max_token_len_per_gpu",
    "critic.forward_micro_batch_size_per_gpu": "critic.forward_max_token_len_per_gpu",
    "reward_model.micro_batch_size_per_gpu": "reward_model.forward_max_token_len_per_gpu",
}


@dataclass
class RoleMemory:
    """One role on its worst pipeline stage of one GPU (bytes; ``params`` is a count)."""

    role: str
    layout: str
    params: int
    weights: float
    grads: float
    optimizer: float
    optimizer_other: float  # with the other use_distributed_optimizer setting (not in totals)
    activations: float  # training activations with the configured recompute
    activations_other: float  # without recompute if configured, else selective (not in totals)
    logits: float  # training logits
    forward_activations: float  # log-prob / value / reward forward pass: one layer live
    forward_logits: float
    trains: bool
    offload: dict[str, bool]
    adapter_params: int = 0
    """LoRA adapter parameters on this rank (fp32, inside ``weights``; with LoRA the only ones
    with ``grads`` and ``optimizer`` state); 0 without LoRA."""
    shares_weights: str | None = None
    """The role whose weights this role's passes run on (LoRA's reference: ``actor``, with its
    adapters off); its own ``weights`` are then 0. None: the role holds its own."""

    def _kept_state(self) -> float:
        if not self.trains:
            return 0.0
        grads = 0.0 if self.offload["grad"] else self.grads
        return grads + (0.0 if self.offload["optimizer"] else self.optimizer)

    def resident(self) -> float:
        """What stays on the GPU while other roles run."""
        return (0.0 if self.offload["param"] else self.weights) + self._kept_state()

    def with_weights(self) -> float:
        """Resident state with the weights brought back (weight sync, forward passes)."""
        return self.weights + self._kept_state()

    def forward_phase(self) -> float:
        """A forward-only pass (log-probs, values, rewards); offloaded grads/optimizer stay away."""
        # layer by layer, then the logits: no layer's activations are left when the logits exist
        return self.with_weights() + max(self.forward_activations, self.forward_logits)

    def training_phase(self) -> float:
        """An update: everything on the GPU."""
        return self.weights + self.grads + self.optimizer + self.activations + self.logits


@dataclass
class RolloutMemory:
    """vLLM on one GPU (bytes)."""

    tp: int
    budget: float  # gpu_memory_utilization x GPU memory
    weights: float
    overhead: float
    kv_cache: float
    kv_bytes_per_token: float
    sequence_tokens: int
    sequences: int
    keeps_weights: bool
    keeps_kv: bool
    bucket: float
    adapters: float = 0.0
    """LoRA: one adapter slot (the actor's adapters in vLLM's dtype, split like ours over its TP)."""


TRAINER_POOL, ROLLOUT_POOL = "trainer", "rollout"


@dataclass
class Phase:
    name: str
    parts: dict[str, float]
    pool: str | None = None
    """The GPUs it runs on when disaggregated (``TRAINER_POOL`` / ``ROLLOUT_POOL``); None when colocated."""

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass
class MemoryPlan:
    gpu_memory: float
    world: int
    sequence_tokens: int
    roles: list[RoleMemory]
    rollout: RolloutMemory
    phases: list[Phase]
    problems: list[str] = field(default_factory=list)
    model_params: int = 0
    """The actor's total parameter count (vision tower included)."""
    vision_params: int = 0
    """Of which the vision tower and merger (0 for text models)."""
    active_params: int = 0
    """Parameters one token passes through (a mixture-of-experts model's top-k experts; else the total)."""
    rollout_world: int | None = None
    """GPUs of the rollout's own pool (``actor_rollout_ref.hybrid_engine=false``); None when colocated."""
    adapters: AdapterPlan | None = None
    """The actor's LoRA adapters (``actor_rollout_ref.model.lora_rank > 0``); None for full fine-tuning."""

    @property
    def peak(self) -> Phase:
        """The largest phase on any GPU (of either pool when disaggregated)."""
        return max(self.phases, key=lambda p: p.total)

    def pool_peaks(self) -> dict[str | None, Phase]:
        """The largest phase of each pool: ``{None: peak}`` colocated, else keyed by
        ``TRAINER_POOL`` and ``ROLLOUT_POOL``."""
        peaks: dict[str | None, Phase] = {}
        for p in self.phases:
            if p.pool not in peaks or p.total > peaks[p.pool].total:
                peaks[p.pool] = p
        return peaks

    def pool_world(self, pool: str | None) -> int:
        """GPUs of ``pool`` (the whole world when colocated)."""
        return self.rollout_world if pool == ROLLOUT_POOL and self.rollout_world is not None else self.world

    @property
    def fits(self) -> bool:
        return not self.problems


def _expert_split(m: DictConfig) -> tuple[int, int]:
    """(EP, ETP) of a role's megatron section; ETP null means the TP size."""
    return m.expert_model_parallel_size, m.expert_tensor_parallel_size or m.tensor_model_parallel_size


def _mlp_width(arch: ModelArch, m: DictConfig) -> float:
    """Activation values per token one layer's MLP keeps, averaged over the layers: SwiGLU fc1
    output (gate + up), their product / TP for a dense layer; for a sparse layer k dispatched
    copies of the token (input and expert output, hidden each) and each copy's expert fc1/product
    / ETP, the router's fp32 logits and probabilities, and the shared expert's / TP."""
    tp, e = m.tensor_model_parallel_size, DTYPE_BYTES[m.params_dtype]
    dense = 3 * arch.ffn_hidden_size / tp
    moe = arch.moe
    if moe is None:
        return dense
    _, etp = _expert_split(m)
    sparse = moe.top_k * (2 * arch.hidden_size + 3 * moe.ffn_hidden_size / etp)
    sparse += 2 * moe.num_experts * 4 / e  # fp32 router logits and probabilities
    sparse += 3 * (moe.shared_expert_ffn_hidden_size or 0) / tp
    frac = len(moe.moe_layers) / arch.num_layers
    return frac * sparse + (1 - frac) * dense


def _attention_width(arch: ModelArch, tp: int) -> float:
    """Activation values per token one layer's attention keeps on a TP rank. Grouped-query: q, k,
    v and the attention output, split by TP. Multi-latent (megatron's MLA, whose down-projections
    are not split by TP): the query and key/value latents before and after their norms and the
    rotary key, then per head the query, the up-projected key and value, the assembled key
    ``[nope | rope]`` and the attention output."""
    mla = arch.mla
    if mla is None:
        q, kv = arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        return (2 * q + 2 * kv) / tp
    latents = 2 * (mla.q_lora_rank or 0) + 2 * mla.kv_lora_rank + mla.qk_rope_head_dim
    per_head = 2 * mla.q_head_dim + (mla.qk_nope_head_dim + mla.v_head_dim) + mla.v_head_dim
    return latents + arch.num_attention_heads * per_head / tp


def _qkv_width(arch: ModelArch, tp: int) -> float:
    """Values per token of one layer's query/key/value projections on a TP rank (vLLM's profiling
    pass): q + k + v, or for multi-latent attention the latents and the per-head q, k and v."""
    mla = arch.mla
    if mla is None:
        return (arch.num_attention_heads + 2 * arch.num_kv_heads) * arch.head_dim / tp
    latents = (mla.q_lora_rank or 0) + mla.kv_lora_rank + mla.qk_rope_head_dim
    per_head = mla.q_head_dim + mla.qk_nope_head_dim + mla.v_head_dim
    return latents + arch.num_attention_heads * per_head / tp


def _dispatch_bytes(arch: ModelArch, m: DictConfig, tokens: float) -> float:
    """One sparse layer's all-to-all buffers: send and receive of k copies of every token (the
    receive gathered over ETP). Transient: one layer at a time."""
    if arch.moe is None:
        return 0.0
    _, etp = _expert_split(m)
    per_copy = arch.hidden_size * DTYPE_BYTES[m.params_dtype]
    return tokens / m.context_parallel_size * arch.moe.top_k * per_copy * (1 + etp)


# Bytes per attention score (query x key pair) a layer keeps for backward: transformer-engine
# (Korthikanti et al.'s bf16 softmax output), megatron's local attention (fp32 softmax output
# + its bf16 copy). The local attention also keeps one bf16 buffer of a layer's scores, and
# while a layer's softmax runs it holds 12 bytes a score (bf16 scores, their fp32 copy, the
# fp32 softmax and its bf16 copy): the peak of a forward-only pass, and of a backward that
# recomputes the core attention (selective).
SCORE_BYTES = {"transformer_engine": 2, "local": 6, "sdpa": 0}
LOCAL_SCORE_BUFFER_BYTES = 2
LOCAL_SOFTMAX_PEAK_BYTES = 12
# The loss functions (``models.forward.vocab_parallel_log_probs`` / ``_entropy``) go through the
# logits in blocks of ``CHUNK_ELEMENTS`` (32 Mi) logits, with up to 4 fp32 temporaries each.
LOSS_CHUNK_BYTES = 4 * 4 * 32 * 2**20


def transformer_impl(cfg: DictConfig, m: DictConfig, lora: bool = False) -> str:
    """The layers a role is built with: ``megatron.transformer_impl``, ``auto`` read as
    transformer-engine on GPU (the GPU image carries it) and local on CPU, and as local for a
    model with LoRA adapters (``lora``: they hook megatron's local linears); local layers with
    ``megatron.attention_backend=sdpa`` (or ``auto`` on GPU) read as ``sdpa``."""
    impl = m.transformer_impl
    cpu = cfg.trainer.device == "cpu"
    if impl == "auto":
        impl = "local" if cpu or lora else "transformer_engine"
    sdpa = m.attention_backend == "sdpa" or (m.attention_backend == "auto" and not cpu)
    return "sdpa" if impl == "local" and sdpa else impl


def _scores(arch: ModelArch, m: DictConfig, tokens: float, seq: int) -> float:
    """Attention scores of ``tokens`` tokens on one rank: heads / TP x (local) queries x keys."""
    tp, cp = m.tensor_model_parallel_size, m.context_parallel_size
    return tokens / cp * arch.num_attention_heads / tp * seq / cp


def _score_buffer(arch: ModelArch, m: DictConfig, tokens: float, seq: int, impl: str) -> float:
    """megatron's bf16 buffer of one layer's scores (local attention), held once attention has run."""
    return LOCAL_SCORE_BUFFER_BYTES * _scores(arch, m, tokens, seq) if impl == "local" else 0.0


def _softmax_peak(arch: ModelArch, m: DictConfig, tokens: float, seq: int, impl: str) -> float:
    """One layer's softmax while it runs (local attention): what a forward-only pass, or a backward
    that recomputes the core attention, holds at its peak beyond the layer's other activations."""
    return LOCAL_SOFTMAX_PEAK_BYTES * _scores(arch, m, tokens, seq) if impl == "local" else 0.0


def _activation_per_layer(
    arch: ModelArch,
    m: DictConfig,
    tokens: float,
    seq: int,
    with_scores: bool,
    impl: str = "transformer_engine",
    lora_bytes: float = 0.0,
) -> float:
    """Bytes one layer keeps for backward for ``tokens`` tokens (micro-batch x sequence);
    ``lora_bytes`` per local token for the layer's adapters (``AdapterPlan.activation_bytes``)."""
    e = DTYPE_BYTES[m.params_dtype]
    tp, cp = m.tensor_model_parallel_size, m.context_parallel_size
    sp = m.sequence_parallel and tp > 1
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_kv_heads * d
    local_tokens = tokens / cp
    replicated = 4 * h / (tp if sp else 1)  # norm inputs + norm outputs feeding QKV and fc1
    split = _attention_width(arch, tp) + _mlp_width(arch, m)  # attention, MLP (fc1 gate+up, fc2 input)
    if impl in ("local", "sdpa"):
        # megatron's local SwiGLU is unfused: beside the product it keeps silu(gate) and
        # up + glu_linear_offset (a new tensor even at offset 0) (measured on an H100 and an H200)
        split += 2 * arch.ffn_hidden_size / tp if arch.moe is None else 0.0
    if impl == "local":
        # megatron's local attention repeats K and V to every query head (GQA) (measured on an H100)
        split += 2 * (q - kv) / tp
    per_token = e * (replicated + split) + lora_bytes
    scores = SCORE_BYTES[impl] * _scores(arch, m, tokens, seq) if with_scores else 0.0
    return local_tokens * per_token + scores


def _stage_activations(
    arch: ModelArch,
    m: DictConfig,
    tokens: float,
    seq: int,
    granularity: str | None,
    impl: str,
    lora_bytes: float = 0.0,
) -> tuple[float, float]:
    """(first stage, last stage) training activations, bytes, excluding logits (``lora_bytes``:
    the adapters' per token and layer)."""
    pp, vpp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size or 1
    layers = arch.num_layers // pp
    # 1F1B: the first stage runs PP forwards before its first backward. Interleaving (VPP)
    # raises that by (1 + (PP - 1) / (PP x VPP)) (Korthikanti et al., section 4.2.3).
    inflight = float(pp)
    if vpp > 1:
        inflight *= 1 + (pp - 1) / (pp * vpp)
    full = _activation_per_layer(arch, m, tokens, seq, granularity is None, impl, lora_bytes)
    if granularity == "full":
        e, tp, sp = DTYPE_BYTES[m.params_dtype], m.tensor_model_parallel_size, m.sequence_parallel
        layer_input = e * tokens / m.context_parallel_size * arch.hidden_size / (tp if sp and tp > 1 else 1)
        k = m.recompute_num_layers or 1
        dense = _activation_per_layer(arch, m, tokens, seq, True, impl, lora_bytes)
        if m.recompute_method == "block":  # first k layers of the stage recomputed, rest stored
            k = min(k, layers)
            per_microbatch, transient = k * layer_input + (layers - k) * dense, dense
        else:  # uniform: one checkpoint per k layers, k layers re-materialised at a time
            per_microbatch, transient = math.ceil(layers / k) * layer_input, k * dense
        transient += _dispatch_bytes(arch, m, tokens) + _score_buffer(arch, m, tokens, seq, impl)
        return per_microbatch * inflight + transient, per_microbatch + transient
    held = _dispatch_bytes(arch, m, tokens) + _score_buffer(arch, m, tokens, seq, impl)
    if granularity == "selective":  # a layer's softmax, recomputed in backward
        held += _softmax_peak(arch, m, tokens, seq, impl)
    return layers * full * inflight + held, layers * full + held


def _logits(tokens: float, response_share: float, vocab: float, e: int, trains: bool) -> float:
    """The LM head's logits of ``tokens`` tokens (``vocab`` per rank, activation dtype), the loss
    functions' fp32 blocks, and for an update one gradient of the logits' size (the response
    window's gradient is widened to every position; at the peak the two together hold about one
    copy beside the logits: measured on an H200 from 2K to 32K tokens, ``tools/gpu/mfu.py``)."""
    blocks = min(LOSS_CHUNK_BYTES, 4 * 4 * tokens * response_share * vocab)
    logits = tokens * vocab * e
    if not trains:
        # megatron writes the logits sequence-first and copies them batch-first: two copies for a
        # moment, more than the loss's blocks beside one (measured on an H200)
        return logits + max(logits, blocks)
    return logits + blocks + logits  # the logits, the loss's blocks, one gradient


def _stage_layers(arch: ModelArch, pp: int, vpp: int | None = None) -> list[list[int]]:
    """Global decoder layers of the first and the last pipeline rank (one entry, every layer,
    when PP = 1); with VPP a rank holds every PP-th chunk of layers."""
    if pp == 1:
        return [list(range(arch.num_layers))]
    chunks = pp * (vpp or 1)
    size = arch.num_layers // chunks

    def layers_of(rank: int) -> list[int]:
        return [i for chunk in range(rank, chunks, pp) for i in range(chunk * size, (chunk + 1) * size)]

    return [layers_of(0), layers_of(pp - 1)]


def _stage_params(arch: ModelArch, pp: int, vpp: int | None = None) -> list[tuple[int, int]]:
    """``(dense, routed experts)`` parameter counts of the first and the last pipeline rank (one
    entry when PP = 1), as ``_stage_layers`` places the layers."""
    c = count_parameters(arch)
    if pp == 1:
        return [(c.total - sum(c.experts), sum(c.experts))]
    value_head = arch.head != "lm"
    # A tied LM head keeps a copy of the embedding on the last stage.
    last_output = c.embedding if (arch.tie_word_embeddings and not value_head) else c.output
    out = []
    extras = (c.embedding + c.vision, c.final_norm + last_output)
    for mine, extra in zip(_stage_layers(arch, pp, vpp), extras):
        out.append((sum(c.layers[i] for i in mine) + extra, sum(c.experts[i] for i in mine)))
    return out


def _micro_tokens(cfg: DictConfig, spec_key: str, seq: int) -> float:
    """Tokens in one micro-batch of the pair whose per-GPU key is ``spec_key``."""
    spec = _SPECS[spec_key]
    if OmegaConf.select(cfg, spec.dynamic_key):
        return float(OmegaConf.select(cfg, _TOKEN_BUDGETS[spec_key]))
    micro = OmegaConf.select(cfg, spec.per_gpu_key) or 1
    return float(micro * seq)


# role -> (training micro-batch key or None, forward micro-batch key)
_ROLE_MICRO_KEYS = {
    "actor": (ACTOR_TRAIN_MICRO.per_gpu_key, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
    "ref": (None, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
    "critic": (CRITIC_TRAIN_MICRO.per_gpu_key, "critic.forward_micro_batch_size_per_gpu"),
    "reward_model": (None, "reward_model.micro_batch_size_per_gpu"),
}


def _stage_state(
    m: DictConfig,
    local_dense: float,
    local_experts: float,
    dp: int,
    edp: int,
    trains: bool,
    adapters: tuple[AdapterPlan, list[int]] | None,
) -> dict[str, float]:
    """One rank's parameter counts and weights, grads and optimizer bytes. A trained role in
    Megatron's mixed precision: fp32 grads and Adam (+ master copy unless fp32), over DP for the
    dense parts and expert DP for the experts with the distributed optimizer. With LoRA
    (``adapters``: the plan and the rank's layers) the base is frozen; only the fp32 adapters train."""
    e, tp = DTYPE_BYTES[m.params_dtype], m.tensor_model_parallel_size
    local = local_dense + local_experts
    state = {
        "params": int(local),
        "adapter_params": 0,
        "weights": local * e,
        "grads": 0.0,
        "optimizer": 0.0,
        "optimizer_other": 0.0,
    }
    if not trains:
        return state
    distributed = m.use_distributed_optimizer
    if adapters is not None:
        plan, layers = adapters
        lora = plan.training_state(tp, layers, dp, distributed)
        return state | {
            "adapter_params": lora["params"],
            "weights": state["weights"] + lora["weights"],
            "grads": lora["grads"],
            "optimizer": lora["optimizer"],
            "optimizer_other": lora["optimizer_other"],
        }
    master = 0 if m.params_dtype == "float32" else 4  # fp32 master copy only in mixed precision
    full = local * (master + 8)
    sharded = (local_dense / dp + local_experts / edp) * (master + 8)
    return state | {
        "grads": local * 4,
        "optimizer": sharded if distributed else full,
        "optimizer_other": full if distributed else sharded,
    }


def _role_memory(
    cfg: DictConfig, role: str, arch: ModelArch, world: int, seq: int, adapters: AdapterPlan | None = None
) -> RoleMemory:
    """``role`` on its worst pipeline stage. With LoRA (``adapters``) the actor trains only its
    adapters and the reference is the actor's model with them off: the actor's layout, no weights."""
    shared = role == "ref" and adapters is not None
    layout_role = "actor" if shared else role
    m = megatron_section(cfg, layout_role)
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    dp = data_parallel_size(cfg, layout_role, world) or 1
    e = DTYPE_BYTES[m.params_dtype]
    train_key, forward_key = _ROLE_MICRO_KEYS[role]
    trains = train_key is not None
    value_head = role in ("critic", "reward_model")
    vocab = 0 if value_head else arch.vocab_size
    fwd_tokens = _micro_tokens(cfg, forward_key, seq)
    impl = transformer_impl(cfg, m, lora=adapters is not None and role in ("actor", "ref"))
    # one layer: its stored scores, or (local attention) its softmax at the peak
    fwd_act = _activation_per_layer(arch, m, fwd_tokens, seq, impl != "local", impl)
    fwd_act += _softmax_peak(arch, m, fwd_tokens, seq, impl)
    fwd_held = _score_buffer(arch, m, fwd_tokens, seq, impl)  # from the first layer on
    fwd_act += _dispatch_bytes(arch, m, fwd_tokens) + fwd_held
    trained_adapters = adapters if role == "actor" else None
    if trains:
        tokens = _micro_tokens(cfg, train_key, seq)
        lora_bytes = 0.0
        if trained_adapters is not None:
            lora_bytes = trained_adapters.activation_bytes(tp, m.sequence_parallel, m.params_dtype)
        acts = _stage_activations(arch, m, tokens, seq, m.recompute_granularity, impl, lora_bytes)
        other = None if m.recompute_granularity else "selective"
        acts_other = _stage_activations(arch, m, tokens, seq, other, impl, lora_bytes)

    # Value heads score the last token; the LM losses read the response positions.
    response_share = cfg.data.max_response_length / seq
    ep, etp = _expert_split(m)
    edp = max(1, world // (etp * ep * pp))  # expert data-parallel size: shards the experts' optimizer
    layout = f"TP{tp} PP{pp} VPP{m.virtual_pipeline_model_parallel_size or '-'} CP{cp} DP{dp}"
    if arch.moe is not None:
        layout += f" EP{ep} ETP{etp}"
    if shared:
        layout += " (actor's weights)"
    stage_layers = _stage_layers(arch, pp, m.virtual_pipeline_model_parallel_size)
    candidates = []
    for stage, (dense, experts) in enumerate(_stage_params(arch, pp, m.virtual_pipeline_model_parallel_size)):
        first, last = stage == 0, stage == len(stage_layers) - 1
        lora = (trained_adapters, stage_layers[stage]) if trained_adapters is not None else None
        state = _stage_state(m, dense / tp, experts / (ep * etp), dp, edp, trains, lora)
        if shared:  # the actor's weights: counted once, in the actor's row
            state |= {"params": 0, "weights": 0.0}
        candidates.append(
            RoleMemory(
                role=role,
                layout=layout,
                params=int(state["params"]),
                weights=state["weights"],
                grads=state["grads"],
                optimizer=state["optimizer"],
                optimizer_other=state["optimizer_other"],
                activations=(acts[0] if first else acts[1]) if trains else 0.0,
                activations_other=(acts_other[0] if first else acts_other[1]) if trains else 0.0,
                # bf16 logits of every token, the loss's fp32 blocks, (update) the logits' gradient
                logits=_logits(tokens, response_share, vocab / tp / cp, e, True) if trains and last else 0.0,
                forward_activations=fwd_act,
                forward_logits=_logits(fwd_tokens, response_share, vocab / tp / cp, e, False) + fwd_held
                if last
                else 0.0,
                trains=trains,
                offload={"param": m.param_offload, "grad": m.grad_offload, "optimizer": m.optimizer_offload},
                adapter_params=int(state["adapter_params"]),
                shares_weights="actor" if shared else None,
            )
        )
    return max(candidates, key=lambda r: max(r.training_phase() if trains else 0.0, r.forward_phase()))


def _rollout_memory(
    cfg: DictConfig, arch: ModelArch, gpu: float, adapters: AdapterPlan | None = None
) -> RolloutMemory:
    """vLLM on one GPU; with LoRA (``adapters``) it also holds one adapter slot."""
    r = cfg.actor_rollout_ref.rollout
    tp, e = r.tensor_model_parallel_size, DTYPE_BYTES[r.dtype]
    weights = count_parameters(arch).total * e / tp
    lora = adapters.params(tp=tp) * e if adapters is not None else 0.0
    h, f = arch.hidden_size, arch.ffn_hidden_size
    if arch.moe is not None:  # every token through k experts (and the shared one); dense layers if any
        routed = arch.moe.top_k * arch.moe.ffn_hidden_size + (arch.moe.shared_expert_ffn_hidden_size or 0)
        f = max(routed, f if len(arch.moe.moe_layers) < arch.num_layers else 0)
    # vLLM's profiling forward over max_num_batched_tokens: widest live tensors of one layer,
    # plus fp32 logits of the last token of each scheduled sequence (gathered over TP).
    profile = r.max_num_batched_tokens * e * (2 * h + _qkv_width(arch, tp) + 2 * f / tp)
    profile += min(r.max_num_seqs, r.max_num_batched_tokens) * arch.vocab_size * 4
    overhead = profile + VLLM_NON_TORCH_GIB * GIB + (0 if r.enforce_eager else VLLM_CUDA_GRAPH_GIB * GIB)
    budget = r.gpu_memory_utilization * gpu
    kv_per_token = kv_cache_values_per_token(arch, tp) * e
    kv_cache = budget - weights - lora - overhead
    sequence_tokens = r.prompt_length + r.response_length
    sequences = max(0, int(kv_cache // (kv_per_token * sequence_tokens)))
    sleeps = r.enable_sleep_mode and cfg.trainer.device != "cpu"
    return RolloutMemory(
        tp=tp,
        budget=budget,
        weights=weights,
        overhead=overhead,
        kv_cache=kv_cache,
        kv_bytes_per_token=kv_per_token,
        sequence_tokens=sequence_tokens,
        sequences=sequences,
        keeps_weights=not sleeps,
        keeps_kv=not (sleeps or r.free_cache_engine),
        bucket=r.update_weights_bucket_megabytes * 1024**2,
        adapters=lora,
    )


def _role_parts(roles: dict[str, RoleMemory], running: str | None, own: float) -> dict[str, float]:
    """Each role's memory while ``running`` runs: ``own`` for it; the role whose weights it runs
    on (LoRA's reference on the actor's) with its weights brought back; the rest what they keep."""
    lender = roles[running].shares_weights if running in roles else None
    return {
        role: own if role == running else mem.with_weights() if role == lender else mem.resident()
        for role, mem in roles.items()
    }


def _phases(
    roles: dict[str, RoleMemory], rollout: RolloutMemory, runtime: float, colocated: bool = True
) -> list[Phase]:
    """Per-GPU memory of each phase of one PPO step, in step order. Disaggregated, the trainer's
    GPUs hold no vLLM memory (the weight stream stages up to two buckets beside the one being
    gathered) and the rollout pool's GPUs hold only vLLM: ``rollout pool:`` phases."""
    if not colocated:
        return _disaggregated_phases(roles, rollout, runtime)
    vllm_idle = (rollout.weights if rollout.keeps_weights else 0.0) + (
        max(rollout.kv_cache, 0.0) if rollout.keeps_kv else 0.0
    )

    def phase(name: str, running: str | None, own: float, vllm: float) -> Phase:
        return Phase(name, _role_parts(roles, running, own) | {"vllm": vllm, "runtime": runtime})

    actor = roles["actor"]
    # Weight sync: the actor's weights are gathered into vLLM's (awake) weights bucket by bucket.
    phases = [
        phase("weight sync", "actor", actor.with_weights(), rollout.weights + rollout.bucket),
        phase("generate", None, 0.0, rollout.budget),
        phase("old log-prob", "actor", actor.forward_phase(), vllm_idle),
    ]
    for role, name in (
        ("ref", "ref log-prob"),
        ("reward_model", "reward model"),
        ("critic", "critic values"),
    ):
        if role in roles:
            phases.append(phase(name, role, roles[role].forward_phase(), vllm_idle))
    if "critic" in roles:
        phases.append(phase("critic update", "critic", roles["critic"].training_phase(), vllm_idle))
    phases.append(phase("actor update", "actor", actor.training_phase(), vllm_idle))
    return phases


def _disaggregated_phases(
    roles: dict[str, RoleMemory], rollout: RolloutMemory, runtime: float
) -> list[Phase]:
    def phase(name: str, running: str | None, own: float, extra: dict[str, float] | None = None) -> Phase:
        parts = _role_parts(roles, running, own)
        return Phase(name, parts | (extra or {}) | {"runtime": runtime}, TRAINER_POOL)

    actor = roles["actor"]
    bucket = min(rollout.bucket, rollout.weights * rollout.tp)  # a bucket never exceeds the model
    phases = [phase("weight sync", "actor", actor.with_weights(), {"stream": 2 * bucket})]
    phases.append(phase("old log-prob", "actor", actor.forward_phase()))
    for role, name in (
        ("ref", "ref log-prob"),
        ("reward_model", "reward model"),
        ("critic", "critic values"),
    ):
        if role in roles:
            phases.append(phase(name, role, roles[role].forward_phase()))
    if "critic" in roles:
        phases.append(phase("critic update", "critic", roles["critic"].training_phase()))
    phases.append(phase("actor update", "actor", actor.training_phase()))
    # The rollout pool: vLLM awake the whole time; a sync loads into its weights while the
    # receiver holds up to three buckets (one loading, one queued, one on the wire).
    vllm = {"vllm": rollout.budget, "runtime": runtime}
    phases.append(Phase("rollout: generate", vllm, ROLLOUT_POOL))
    phases.append(Phase("rollout: sync", vllm | {"stream": 3 * bucket}, ROLLOUT_POOL))
    return phases


def plan_memory(
    cfg: DictConfig, gpu_memory_gb: float | None = None, world_size: int | None = None
) -> MemoryPlan:
    """Estimate per-GPU memory of every role and phase of a loaded config (see module doc).

    ``gpu_memory_gb`` overrides ``trainer.gpu_memory_gb`` and ``world_size`` the trainer's
    nnodes x n_gpus_per_node. Raises ``ConfigError`` when the
    actor's architecture is unknown. ``MemoryPlan.problems`` lists why it does not fit.
    """
    gpu = (gpu_memory_gb if gpu_memory_gb is not None else cfg.trainer.gpu_memory_gb) * GIB
    world = roles_mod.world_size(cfg, world_size)
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    archs = {role: arch_for_role(cfg, role) for role in active_roles(cfg)}
    if archs["actor"][0] is None:
        raise ConfigError(f"cannot plan memory: {archs['actor'][1]}; add a model_arch section to the preset")
    adapters = adapter_plan(cfg, archs["actor"][0])
    roles = {}
    skipped = []
    for role, (arch, source) in archs.items():
        if arch is None:
            skipped.append(f"{role} ({source})")
            continue
        roles[role] = _role_memory(
            cfg, role, arch, world, seq, adapters if role in ("actor", "ref") else None
        )
    rollout = _rollout_memory(cfg, archs["actor"][0], gpu, adapters)
    runtime = CPU_RUNTIME_OVERHEAD_GIB if cfg.trainer.device == "cpu" else RUNTIME_OVERHEAD_GIB
    colocated = bool(OmegaConf.select(cfg, "actor_rollout_ref.hybrid_engine", default=True))
    phases = _phases(roles, rollout, runtime * GIB, colocated)
    plan = MemoryPlan(
        gpu_memory=gpu,
        world=world,
        sequence_tokens=seq,
        roles=list(roles.values()),
        rollout=rollout,
        phases=phases,
        model_params=count_parameters(archs["actor"][0]).total,
        vision_params=count_parameters(archs["actor"][0]).vision,
        active_params=count_parameters(archs["actor"][0]).active,
        rollout_world=None if colocated else roles_mod.rollout_world_size(cfg),
        adapters=adapters,
    )
    for phase in phases:
        if phase.total > gpu:
            where = f" of the {phase.pool} pool" if phase.pool else ""
            plan.problems.append(
                f"{phase.name} needs {phase.total / GIB:.1f} GiB per GPU{where}, more than the "
                f"{gpu / GIB:.0f} GiB available"
            )
    if rollout.sequences < 1:
        plan.problems.append(
            f"vLLM's KV cache ({rollout.kv_cache / GIB:.1f} GiB after "
            f"{(rollout.weights + rollout.adapters) / GIB:.1f} GiB of weights and "
            f"{rollout.overhead / GIB:.1f} GiB overhead) cannot hold one {seq}-token sequence; raise "
            "actor_rollout_ref.rollout.gpu_memory_utilization or tensor_model_parallel_size"
        )
    plan.problems += [f"not planned: {s}" for s in skipped]
    return plan


def _count(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.1f}M"


def _gib(value: float) -> str:
    return f"{value / GIB:7.2f}"


def format_plan(plan: MemoryPlan, title: str = "") -> str:
    """The plan as a plain-text table (GiB per GPU)."""
    total = f"{_count(plan.model_params)} parameters"
    if plan.active_params and plan.active_params != plan.model_params:
        total += f", {_count(plan.active_params)} active per token"
    if plan.vision_params:
        total += f", of which vision tower {_count(plan.vision_params)}"
    lines = [f"memory plan: {title} ({total})" if title else f"memory plan ({total})"]
    lines += _format_lora(plan)
    pools = (
        f"world {plan.world} GPUs"
        if plan.rollout_world is None
        else f"trainer pool {plan.world} GPUs + rollout pool {plan.rollout_world} GPUs (disaggregated)"
    )
    lines.append(
        f"{pools} x {plan.gpu_memory / GIB:.0f} GiB; sequence {plan.sequence_tokens} tokens "
        "(prompt + response); GiB per GPU, worst pipeline stage"
    )
    lines.append("")
    width = max(26, *(len(r.layout) + 1 for r in plan.roles))
    header = f"{'role':<13}{'layout':<{width}}{'params':>9}{'weights':>9}{'grads':>9}{'optim':>9}{'optim*':>9}{'activ':>9}{'activ*':>9}{'logits':>9}"
    lines += [header, "-" * len(header)]
    for r in plan.roles:
        lines.append(
            f"{r.role:<13}{r.layout:<{width}}{_count(r.params):>9}{_gib(r.weights):>9}{_gib(r.grads):>9}"
            f"{_gib(r.optimizer):>9}{_gib(r.optimizer_other):>9}{_gib(r.activations):>9}"
            f"{_gib(r.activations_other):>9}{_gib(r.logits):>9}"
        )
    lines.append("optim* = with the other use_distributed_optimizer setting; activ* = without the configured")
    lines.append("recompute (or with selective recompute when none is configured). Neither is in the totals.")
    ro = plan.rollout
    # Consecutive groups of rollout-TP ranks form one engine (a rollout data-parallel replica).
    where = (
        "" if plan.rollout_world is None else f", on the rollout pool: {plan.rollout_world // ro.tp} engines"
    )
    adapters = f" + LoRA adapters {ro.adapters / GIB:.2f}" if ro.adapters else ""
    lines += [
        "",
        f"vLLM (TP{ro.tp}{where}): budget {ro.budget / GIB:.2f} GiB = weights {ro.weights / GIB:.2f}{adapters} + "
        f"overhead {ro.overhead / GIB:.2f} + KV cache {ro.kv_cache / GIB:.2f} GiB",
        f"  KV cache {ro.kv_bytes_per_token / 1024:.1f} KiB/token -> {ro.sequences} sequences of {ro.sequence_tokens} tokens",
        "",
    ]
    names = list(dict.fromkeys(k for p in plan.phases for k in p.parts))
    first = max(15, *(len(p.name) + 1 for p in plan.phases))
    header = f"{'phase':<{first}}" + "".join(f"{n:>14}" for n in names) + f"{'total':>10}"
    lines += [header, "-" * len(header)]
    for p in plan.phases:
        cells = "".join(f"{_gib(p.parts[n]) if n in p.parts else '-':>14}" for n in names)
        lines.append(f"{p.name:<{first}}{cells}{_gib(p.total):>10}")
    lines += ["", *_format_peaks(plan)]
    lines += [f"  - {p}" for p in plan.problems]
    return "\n".join(lines)


def _format_lora(plan: MemoryPlan) -> list[str]:
    """LoRA's lines under the title: the adapters' size and where the reference's weights are."""
    a = plan.adapters
    if a is None:
        return []
    targets = a.lora.target_modules
    shown = targets if isinstance(targets, str) else ",".join(targets)
    actor = next((r for r in plan.roles if r.role == "actor"), None)
    per_gpu = f"; {_count(actor.adapter_params)} on the worst GPU" if actor is not None else ""
    lines = [
        f"LoRA rank {a.lora.rank}, alpha {a.lora.alpha:g}, target_modules {shown}: {_count(a.total)} adapter "
        f"parameters ({100 * a.total / plan.model_params:.2f}% of the model{per_gpu})",
        "  train in fp32 with fp32 grads and Adam m, v; the base weights are frozen (no grads, no optimizer state)",
    ]
    if any(r.shares_weights for r in plan.roles):
        lines.append(
            "  the reference is the actor with its adapters off: it shares the actor's weights (none of its own)"
        )
    return lines


def _format_peaks(plan: MemoryPlan) -> list[str]:
    """``peak: ...`` colocated; one line per pool, then the verdict, when disaggregated."""
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    gpu = plan.gpu_memory

    def share(p: Phase) -> str:
        return f"{p.name}, {p.total / GIB:.2f} of {gpu / GIB:.0f} GiB ({100 * p.total / gpu:.0f}%)"

    peaks = plan.pool_peaks()
    if None in peaks:
        return [f"peak: {share(peaks[None])} -> {verdict}"]
    lines = [f"peak, {pool} pool ({plan.pool_world(pool)} GPUs): {share(p)}" for pool, p in peaks.items()]
    return [*lines, f"-> {verdict}"]
