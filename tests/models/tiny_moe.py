"""Tiny mixture-of-experts checkpoints (no hub) and transformers references for the MoE tests.

Five families, each small enough for 4 gloo ranks on 2 cores and valid for vLLM's CPU
attention (head_dim 64): Qwen3-MoE (q/k norms, renormalised top-2 of 4 experts),
Qwen2-MoE (q/k/v biases, a gated shared expert, softmax-then-top-2 without
renormalisation, layer 1 dense through ``mlp_only_layers``), Mixtral (top-2 of 8) and GLM-4.5
(DeepSeekMoE's sigmoid router with score-correction bias, top-2 of 4 in the best of 2 groups,
a shared expert, layer 0 dense, half-rotary heads, q/k/v biases and q/k norms) and DeepSeek-V3
(the same MoE, routed scaling 2.5, with multi-latent attention and YaRN: ``models/tiny.py``).
Hidden 256 in 4 heads of 64 with 2 KV heads, so TP 2 splits them.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = {
    "qwen3_moe": dict(num_experts=4),
    "qwen2_moe": dict(num_experts=4, mlp_only_layers=(1,)),
    "mixtral": dict(num_experts=8),
    "glm4_moe": dict(num_experts=4, mlp_only_layers=(0,), groups=(2, 1)),
    "deepseek_v3": dict(num_experts=4, mlp_only_layers=(0,), groups=(2, 1)),
}
SIGMOID_ROUTED = ("glm4_moe", "deepseek_v3")
"""Families whose transformers router reports raw logits, not softmax top-k: their choices come
from a forward hook on the router (``hf_expert_choices``)."""
SIZES = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, top_k=2)


def make_model_dir(root: Path, family: str, **overrides) -> Path:
    from rlhf_megatron.models.tiny import make_tiny_moe_model

    return make_tiny_moe_model(root / family, family, **{**SIZES, **FAMILIES[family], **overrides})


def load_hf(hf_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def padded_batch(vocab: int, batch: int = 4, seq: int = 12, seed: int = 1):
    """Left-padded ``(input_ids, attention_mask, position_ids)`` like RL prompts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    lengths = torch.tensor([seq, seq - 3, seq - 5, 4, seq, seq - 1, 7, seq - 2][:batch])
    mask = (torch.arange(seq)[None] >= (seq - lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def hf_outputs(model, ids, mask, pos):
    """transformers' logits and per-layer router logits (sparse layers only, ``[B*S, E]`` each)."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
    return out.logits.float(), [r.float() for r in out.router_logits]


@torch.no_grad()
def hf_expert_choices(model, ids, mask, pos) -> list[torch.Tensor]:
    """The experts transformers' routers chose (``[B*S, k]`` per sparse layer), read from the
    ``(logits, weights, indices)`` a DeepSeekMoE-style ``*TopkRouter`` returns."""
    chosen = []
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
    hooks = [r.register_forward_hook(lambda _m, _i, out: chosen.append(out[2])) for r in routers]
    try:
        model(input_ids=ids, attention_mask=mask, position_ids=pos)
    finally:
        for h in hooks:
            h.remove()
    return chosen


def add_mtp_layer(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Write a next-token-prediction layer (``model.layers.<num_hidden_layers>.*``, random) into
    ``hf_dir``'s weights and set ``num_nextn_predict_layers`` to 1, as a GLM-4.5 / DeepSeek-V3
    checkpoint ships (transformers builds none); returns the tensors written."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((hf_dir / "config.json").read_text())
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    g = torch.Generator().manual_seed(7)
    mtp = {
        f"model.layers.{n}.eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g),
        f"model.layers.{n}.enorm.weight": torch.randn(hidden, generator=g),
        f"model.layers.{n}.hnorm.weight": torch.randn(hidden, generator=g),
        f"model.layers.{n}.shared_head.norm.weight": torch.randn(hidden, generator=g).to(torch.bfloat16),
        f"model.layers.{n}.mlp.gate.e_score_correction_bias": torch.randn(4, generator=g),
    }
    weights = load_file(str(hf_dir / "model.safetensors"))
    save_file({**weights, **mtp}, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (hf_dir / "config.json").write_text(json.dumps(config, indent=2))
    return mtp


def megatron_aux_loss(router_logits: torch.Tensor, valid: torch.Tensor, top_k: int) -> float:
    """megatron's per-layer load-balancing loss (coefficient divided out), computed here from the
    router logits: ``E / (k T^2) * sum_i c_i S_i`` over the ``T`` valid tokens, ``c_i`` the tokens
    whose top-k holds expert ``i``, ``S_i`` their summed softmax probability for ``i``."""
    probs = torch.softmax(router_logits[valid.reshape(-1)].double(), dim=-1)  # (T, E)
    tokens, experts = probs.shape
    chosen = torch.zeros_like(probs).scatter(1, probs.topk(top_k, dim=-1).indices, 1.0)
    return float((chosen.sum(0) * probs.sum(0)).sum() * experts / (top_k * tokens**2))


def expert_counts(router_logits: torch.Tensor, valid: torch.Tensor, top_k: int) -> torch.Tensor:
    """Tokens per expert of one layer (valid tokens only), from transformers' router logits."""
    chosen = router_logits[valid.reshape(-1)].topk(top_k, dim=-1).indices
    return torch.bincount(chosen.reshape(-1), minlength=router_logits.shape[-1])
