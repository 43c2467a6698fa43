"""LoRA on megatron-core: targets, PEFT round trips, and every layout computing what PEFT computes.

The reference is Hugging Face PEFT itself: a tiny Qwen2 (GQA, QKV biases) with a random rank-4
adapter on every projection, A and B both non-zero. Megatron loads the base from HF and the
adapter from PEFT's directory (``lora_adapter_path``) and must give PEFT's logits at TP1, TP2,
TP2+SP, PP2, PP2+VPP2 and TP2xPP2; its adapters, exported back (``full_adapter_tensors``), must be
PEFT's tensors. Then a real training step (DDP, finalize_model_grads, Adam) on adapters only,
where TP2, TP2+SP and PP2 must move the adapters exactly as TP1 does, and the base must not move.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.config.schema_model import LoraConfig
from rlhf_megatron.models.lora import LoraTargetError, resolve_targets
from rlhf_megatron.platform.multiproc import run_on_ranks

from . import tiny_hf

REL_TOL = 1e-4


def _arch(family="qwen2", **overrides):
    from rlhf_megatron.planning.model_arch import ModelArch

    return ModelArch.from_hf_config(tiny_hf.hf_config(family, **overrides).to_dict())


def _lora(targets="all-linear", exclude=(), rank=4):
    return LoraConfig(rank=rank, alpha=8, target_modules=targets, exclude_modules=exclude)


# ------------------------------------------------------------------ targets (pure)


def test_all_linear_adapts_every_projection_of_every_layer():
    targets = resolve_targets(_arch(), _lora())
    assert sorted(targets) == [0, 1, 2, 3]
    assert targets[0] == {
        "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
        "self_attention.linear_proj": ("o_proj",),
        "mlp.linear_fc1": ("gate_proj", "up_proj"),
        "mlp.linear_fc2": ("down_proj",),
    }


def test_names_and_regex_exclusions_select_parts_of_fused_linears():
    targets = resolve_targets(_arch(), _lora(("q_proj", "v_proj", "down_proj"), r".*layers\.[01]\.mlp\..*"))
    assert targets[0] == {"self_attention.linear_qkv": ("q_proj", "v_proj")}
    assert targets[3]["mlp.linear_fc2"] == ("down_proj",)
    listed = resolve_targets(_arch(), _lora(("q_proj",), ("model.layers.2.self_attn.q_proj",)))
    assert sorted(listed) == [0, 1, 3]


@pytest.mark.parametrize(
    "lora, message",
    [
        (_lora(("qkv_proj",)), "target_modules names ['qkv_proj'], which Qwen2ForCausalLM does not have"),
        (_lora(("q_proj",), r".*q_proj"), "selects no linear layer of Qwen2ForCausalLM"),
    ],
)
def test_targets_the_model_does_not_have_are_named(lora, message):
    with pytest.raises(LoraTargetError, match=message.replace("[", r"\[").replace("]", r"\]")):
        resolve_targets(_arch(), lora)


def test_moe_experts_are_left_out_by_all_linear_and_refused_by_name(tmp_path):
    from rlhf_megatron.planning.model_arch import ModelArch

    from . import tiny_moe

    arch = ModelArch.from_hf_dir(tiny_moe.make_model_dir(tmp_path, "qwen2_moe"))  # layer 1 dense
    targets = resolve_targets(arch, _lora())
    assert arch.is_moe_layer(0) and not arch.is_moe_layer(1)
    assert set(targets[0]) == {"self_attention.linear_qkv", "self_attention.linear_proj"}
    assert targets[1]["mlp.linear_fc1"] == ("gate_proj", "up_proj")
    with pytest.raises(
        LoraTargetError, match="model.layers.0.mlp.gate_proj.*experts of a mixture-of-experts"
    ):
        resolve_targets(arch, _lora(("gate_proj",)))


# ------------------------------------------------------------------ PEFT reference, every layout


LAYOUTS = [  # (tp, pp, vpp, sequence_parallel)
    (1, 1, None, False),
    (2, 1, None, False),
    (2, 1, None, True),
    (1, 2, None, False),
    (1, 2, 2, False),
    (2, 2, None, False),
]


def _peft_case(tmp_path):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    model = tiny_hf.make_hf_model("qwen2")
    hf_dir = tiny_hf.save_hf_model(model, tmp_path / "base")
    peft_cfg = PeftLoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, lora_dropout=0.0
    )
    torch.manual_seed(5)
    peft = get_peft_model(model, peft_cfg).eval()
    peft.save_pretrained(tmp_path / "adapter")
    batch = tiny_hf.padded_batch()
    ids, mask, pos = batch
    with torch.no_grad():
        ref = peft(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    state = {k: v.detach().clone() for k, v in peft.state_dict().items() if "lora_" in k}
    return str(hf_dir), str(tmp_path / "adapter"), batch, ref, state


def _forward_layouts(rank, world, hf_dir, adapter_dir, batch):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.forward import forward_logits_or_values
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.models.lora import (
        adapters_disabled,
        attach_lora,
        full_adapter_tensors,
        load_full_adapter_tensors,
        peft_keys,
        resolve_targets,
    )
    from rlhf_megatron.models.lora_io import read_peft_adapter
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import init_model_parallel

    arch = ModelArch.from_hf_dir(hf_dir)
    lora, tensors = read_peft_adapter(adapter_dir, arch)
    ids, mask, pos = batch
    rows = []
    for tp, pp, vpp, sp in LAYOUTS:
        info = init_model_parallel(tp, pp, vpp)
        chunks = build_gpt_model(arch, ParallelConfig(tp, pp, vpp, sequence_parallel=sp), init_weights=False)
        load_hf_weights(chunks, hf_dir, arch)
        attach_lora(chunks, arch, lora, tp_rank=info.tp_rank, tp_size=tp, sequence_parallel=sp)
        expected = peft_keys(resolve_targets(arch, lora))
        load_full_adapter_tensors(chunks, tensors, info.tp_rank, adapter_dir, expected)
        out = forward_logits_or_values(chunks, ids, mask, pos)
        with adapters_disabled(chunks):
            base = forward_logits_or_values(chunks, ids, mask, pos)
        from megatron.core import parallel_state as ps

        exported = full_adapter_tensors(
            chunks, ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
        )
        row = {"layout": (tp, pp, vpp, sp), "exported": exported if info.rank == 0 else None}
        if out is not None:
            row["logits"] = gather_from_tensor_model_parallel_region(out)[..., : arch.vocab_size]
            row["base"] = gather_from_tensor_model_parallel_region(base)[..., : arch.vocab_size]
        rows.append(row)
    return rows


@pytest.mark.slow
def test_every_layout_computes_pefts_logits_and_exports_pefts_tensors(tmp_path):
    from peft import PeftModel

    hf_dir, adapter_dir, batch, ref, state = _peft_case(tmp_path)
    base_ref = tiny_hf.hf_logits(tiny_hf.make_hf_model("qwen2"), *batch)
    valid = batch[1].bool()
    results = run_on_ranks(_forward_layouts, 4, hf_dir, adapter_dir, batch, timeout_s=600)
    seen = set()
    for rows in results:
        for row in rows:
            if "logits" in row:
                seen.add(row["layout"])
                err = (row["logits"] - ref).abs()[valid].max() / ref[valid].abs().max()
                assert err <= REL_TOL, (row["layout"], err.item())
                base_err = (row["base"] - base_ref).abs()[valid].max() / base_ref[valid].abs().max()
                assert base_err <= REL_TOL, (row["layout"], "adapters off", base_err.item())
            if row["exported"] is not None:
                want = {k.replace(".default", ""): v for k, v in state.items()}
                assert set(row["exported"]) == set(want), row["layout"]
                for key, value in want.items():
                    torch.testing.assert_close(row["exported"][key], value, rtol=0, atol=0)
    assert seen == set(LAYOUTS)
    # The adapter changes the model visibly, so equal logits are not the base's by accident.
    assert (ref - base_ref).abs()[valid].max() > 1e-2
    assert PeftModel  # imported: PEFT itself wrote the directory read above


# ------------------------------------------------------------------ training: layouts step alike


def _train(rank, world, hf_dir, tp, pp, sp):
    from rlhf_megatron.config.schema import MegatronConfig, OptimConfig
    from rlhf_megatron.data.batch import Batch
    from rlhf_megatron.models.builder import ParallelConfig
    from rlhf_megatron.models.forward import vocab_parallel_log_probs
    from rlhf_megatron.models.loader import unwrap_model
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import init_model_parallel
    from rlhf_megatron.workers.megatron_engine import MegatronEngine, split_micro_batches

    init_model_parallel(tp, pp, seed=1)
    arch = ModelArch.from_hf_dir(hf_dir)
    megatron = MegatronConfig(
        params_dtype="float32",
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sp,
    )
    engine = MegatronEngine(
        arch,
        ParallelConfig(tp, pp, sequence_parallel=sp),
        hf_dir,
        megatron,
        OptimConfig(lr=1e-2),
        total_steps=10,
        lora=_lora(),
    )
    trainable = [n for c in engine.chunks for n, p in unwrap_model(c).named_parameters() if p.requires_grad]
    base_before = {
        n: p.detach().clone()
        for c in engine.chunks
        for n, p in unwrap_model(c).named_parameters()
        if ".lora." not in n
    }
    ids = torch.randint(3, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    batch = Batch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(12).expand(4, -1),
        }
    )

    def loss_fn(logits, micro):
        logp = vocab_parallel_log_probs(logits[:, :-1], micro["input_ids"][:, 1:], arch.vocab_size)
        loss = -logp.mean()
        return loss * micro["_weight"], {"loss": loss.item()}

    norms = []
    for _ in range(3):
        micros = split_micro_batches(batch, ("input_ids", "attention_mask", "position_ids"), 2)
        norms.append(engine.train_step(micros, loss_fn)["grad_norm"])
    base_moved = [
        n
        for c in engine.chunks
        for n, p in unwrap_model(c).named_parameters()
        if n in base_before and not torch.equal(p, base_before[n])
    ]
    optimized = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
    return {
        "adapters": engine.full_adapters(),
        "norms": norms,
        "trainable_not_lora": [n for n in trainable if ".lora." not in n],
        "base_moved": base_moved,
        "optimized": optimized,
        "adapter_params": engine.adapter_params,
    }


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, sp", [(2, 1, False), (2, 1, True), (1, 2, False)])
def test_adapter_training_steps_alike_in_every_layout(tmp_path, tp, pp, sp):
    hf_dir = str(tiny_hf.save_hf_model(tiny_hf.make_hf_model("qwen2"), tmp_path / "base"))
    ((single,),) = [run_on_ranks(_train, 1, hf_dir, 1, 1, False, timeout_s=300)]
    assert single["trainable_not_lora"] == [] and single["base_moved"] == []
    assert single["optimized"] == single["adapter_params"] > 0
    # B starts at zero; three steps must have moved it.
    assert any(v.abs().max() > 0 for k, v in single["adapters"].items() if "lora_B" in k)
    for got in run_on_ranks(_train, tp * pp, hf_dir, tp, pp, sp, timeout_s=300):
        assert got["norms"] == pytest.approx(single["norms"], rel=1e-4)
        assert got["base_moved"] == []
        for key, value in single["adapters"].items():
            # Adam divides by sqrt(v): an element whose gradient is ~0 may move by a few 1e-5 on
            # float rounding alone; a wrong shard or a missing all-reduce moves it by ~lr (1e-2).
            torch.testing.assert_close(got["adapters"][key], value, rtol=1e-4, atol=2e-4)


# ------------------------------------------------------------------ mixture of experts: EP


def _moe_forward(rank, world, hf_dir, adapter_dir, batch):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.forward import forward_logits_or_values
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.models.lora import attach_lora, load_full_adapter_tensors
    from rlhf_megatron.models.lora_io import read_peft_adapter
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import init_model_parallel

    arch = ModelArch.from_hf_dir(hf_dir)
    lora, tensors = read_peft_adapter(adapter_dir, arch)
    rows = []
    for tp, ep, sp in ((1, 1, False), (1, 2, False), (2, 2, True)):
        info = init_model_parallel(tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
        parallel = ParallelConfig(
            tp, sequence_parallel=sp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1
        )
        chunks = build_gpt_model(arch, parallel, init_weights=False)
        load_hf_weights(chunks, hf_dir, arch)
        attach_lora(chunks, arch, lora, tp_rank=info.tp_rank, tp_size=tp, sequence_parallel=sp)
        load_full_adapter_tensors(chunks, tensors, info.tp_rank, adapter_dir)
        out = forward_logits_or_values(chunks, *batch)
        rows.append(((tp, ep, sp), gather_from_tensor_model_parallel_region(out)[..., : arch.vocab_size]))
    return rows


@pytest.mark.slow
def test_attention_adapters_on_a_moe_model_compute_pefts_logits_at_every_ep(tmp_path):
    """Qwen2-MoE (a dense layer 1, a shared expert) with adapters on attention and the dense MLP
    (``all-linear`` leaves the experts out), at EP1, EP2 and TP2 x EP2 with SP, against PEFT
    adapting the same modules."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from . import tiny_moe

    hf_dir = tiny_moe.make_model_dir(tmp_path, "qwen2_moe")
    model = tiny_moe.load_hf(hf_dir)
    targets = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    targets += [f"layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]  # the dense layer
    torch.manual_seed(7)
    peft = get_peft_model(
        model, PeftLoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    )
    peft.save_pretrained(tmp_path / "adapter")
    batch = tiny_moe.padded_batch(model.config.vocab_size)
    with torch.no_grad():
        ref = peft(input_ids=batch[0], attention_mask=batch[1], position_ids=batch[2]).logits
    valid = batch[1].bool()
    seen = set()
    for rows in run_on_ranks(_moe_forward, 4, str(hf_dir), str(tmp_path / "adapter"), batch, timeout_s=600):
        for layout, logits in rows:
            seen.add(layout)
            err = (logits - ref).abs()[valid].max() / ref[valid].abs().max()
            assert err <= REL_TOL, (layout, err.item())
    assert seen == {(1, 1, False), (1, 2, False), (2, 2, True)}


# ------------------------------------------------------------------ bf16 base, fp32 adapters


def _train_bf16(rank, world, hf_dir):
    from rlhf_megatron.config.schema import MegatronConfig, OptimConfig
    from rlhf_megatron.data.batch import Batch
    from rlhf_megatron.models.builder import ParallelConfig
    from rlhf_megatron.models.loader import unwrap_model
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import init_model_parallel
    from rlhf_megatron.workers.megatron_engine import MegatronEngine, split_micro_batches

    init_model_parallel(1, 1, seed=1)
    arch = ModelArch.from_hf_dir(hf_dir)
    engine = MegatronEngine(
        arch,
        ParallelConfig(),
        hf_dir,
        MegatronConfig(params_dtype="bfloat16"),
        OptimConfig(lr=1e-2),
        lora=_lora(),
    )
    named = {n: p for c in engine.chunks for n, p in unwrap_model(c).named_parameters()}
    before = {n: p.detach().clone() for n, p in named.items()}
    ids = torch.randint(3, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    batch = Batch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(12).expand(4, -1),
        }
    )
    keys = ("input_ids", "attention_mask", "position_ids")
    norms = [
        engine.train_step(
            split_micro_batches(batch, keys, 2), lambda o, m: (o.float().pow(2).mean() * m["_weight"], {})
        )["grad_norm"]
        for _ in range(2)
    ]
    return {
        "dtypes": {n: str(p.dtype) for n, p in named.items()},
        "moved": sorted(n for n, p in named.items() if not torch.equal(p, before[n])),
        "norms": norms,
    }


@pytest.mark.slow
def test_a_bf16_base_stays_frozen_while_fp32_adapters_train(tmp_path):
    hf_dir = str(tiny_hf.save_hf_model(tiny_hf.make_hf_model("qwen2"), tmp_path / "base"))
    ((got,),) = [run_on_ranks(_train_bf16, 1, hf_dir, timeout_s=300)]
    adapters = {n for n in got["dtypes"] if ".lora." in n}
    assert adapters and all(got["dtypes"][n] == "torch.float32" for n in adapters)
    assert all(
        got["dtypes"][n] == "torch.bfloat16" for n in got["dtypes"] if "layers" in n and n not in adapters
    )
    assert all(0 < n < float("inf") for n in got["norms"])
    # lora_B starts at zero and moves; every base weight is where it was loaded
    assert set(got["moved"]) <= adapters and any("lora_B" in n for n in got["moved"])
