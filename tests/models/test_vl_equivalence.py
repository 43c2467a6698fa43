"""Qwen2.5-VL / Qwen2-VL / Qwen3-VL on megatron-core compute what transformers computes, forward
and backward.

Real megatron-core on 4 gloo ranks, one process start for every case (parallel state is
re-initialised between layouts): fp32 logits on an image+text batch (images of different
sizes in different rows, a text-only row, a row with two images, left padding) against
transformers' ``*ForConditionalGeneration`` at TP1, TP2 and TP2 x PP2 (one row per
micro-batch, so the images are split across micro-batches); gradients of a weighted log-likelihood through the
vision tower against transformers' autograd; and a frozen tower that gets no gradient,
no DDP buffer, no optimizer state and no update. Qwen3-VL (learned positions, DeepStack,
interleaved M-RoPE, frames apart) against transformers numbering its own positions, on images
and videos, and its gradients through the DeepStack mergers under full recomputation.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.platform.multiproc import run_on_ranks

from . import tiny_vl

REL_TOL = 1e-5
GRAD_TOL = 1e-4
# megatron parameters whose gradients are compared with transformers' (vision: patch embedding,
# a windowed and a full-attention block with the padded MLP, the merger; language model).
GRAD_PARAMS = (
    "vision_model.patch_embed.weight",
    "vision_model.decoder.layers.0.self_attention.linear_qkv.weight",
    "vision_model.decoder.layers.0.self_attention.linear_proj.weight",
    "vision_model.decoder.layers.1.mlp.linear_fc1.weight",
    "vision_model.decoder.layers.1.mlp.linear_fc2.weight",
    "vision_model.merger.mlp.linear_fc1.weight",
    "vision_model.merger.ln_q.weight",
    "language_model.embedding.word_embeddings.weight",
    "language_model.decoder.layers.1.self_attention.linear_qkv.weight",
)


VISUALS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def _images(batch):
    """The batch's images (and videos, with their seconds per temporal patch) as keywords."""
    return {k: batch[k] for k in VISUALS if k in batch}


def _forward_cases(cases):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from rlhf_megatron.models import ModelArch
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.forward import forward_logits_or_values
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.platform import init_model_parallel

    rows = []
    for case in cases:
        arch = ModelArch.from_hf_dir(case["hf_dir"], head=case.get("head"))
        b = case["batch"]
        valid = b["attention_mask"].bool()
        for tp, pp, micro in case["layouts"]:
            info = init_model_parallel(tp, pp)
            chunks = build_gpt_model(arch, ParallelConfig(tp, pp), init_weights=False)
            report = load_hf_weights(chunks, case.get("load_dir", case["hf_dir"]), arch)
            positions = b["position_ids"] if case.get("positions", True) else None
            out = forward_logits_or_values(
                chunks, b["input_ids"], b["attention_mask"], positions, micro_batch_size=micro, **_images(b)
            )
            row = {
                "name": case["name"],
                "layout": (tp, pp, micro),
                "info": info,
                "kept": report.kept_initialised,
            }
            if out is not None:
                row["shape"] = tuple(out.shape)
                if case.get("ref") is not None:
                    full = gather_from_tensor_model_parallel_region(out)[..., : arch.vocab_size]
                    ref = case["ref"]
                    row["rel_err"] = ((full - ref).abs()[valid].max() / ref[valid].abs().max()).item()
            rows.append(row)
    return rows


def _full_grads(chunk, arch, names):
    """HF name -> gradient, for the megatron parameters ``names`` (global) this pipeline stage holds,
    gathered over TP; and the largest gradient in the vision MLP's padding rows."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlhf_megatron.models.spec import gather_tp_shards, mcore_to_hf, param_owner

    params = dict(chunk.named_parameters())
    tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    out, padding = {}, {}
    for name in names:
        owner, _, local = param_owner(name, arch.num_layers, pp)
        if owner != pp_rank:
            continue
        grad = params[local].grad
        shards = [torch.empty_like(grad) for _ in range(tp)]
        dist.all_gather(shards, grad.contiguous(), group=group)
        full = gather_tp_shards(name, shards, arch)
        swiglu = arch.vision.mlp == "swiglu"  # [gate; up], each half padded
        if swiglu and name.endswith("mlp.linear_fc1.weight") and name.startswith("vision_model.decoder"):
            f = arch.vision.intermediate_size
            padding[name] = float(torch.cat([g[f:] for g in full.chunk(2)]).abs().max())
        out.update(mcore_to_hf(name, full, arch))
    return out, padding


def _rel_errors(grads, reference):
    return {n: float((g - reference[n]).abs().max() / reference[n].abs().max()) for n, g in grads.items()}


def _pipeline_grads(train):
    """The same gradients through megatron's pipeline schedule at TP2 x PP2, one row per micro-batch."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rlhf_megatron.models import ModelArch
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.forward import model_forward, vocab_parallel_log_probs
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.models.multimodal import images_per_row, select_rows
    from rlhf_megatron.platform import init_model_parallel

    arch = ModelArch.from_hf_dir(train["hf_dir"])
    b, weights = train["batch"], train["weights"]
    init_model_parallel(2, 2)
    chunk = build_gpt_model(arch, ParallelConfig(2, 2), init_weights=False)[0]
    load_hf_weights([chunk], train["hf_dir"], arch)
    rows = images_per_row(b["input_ids"], b["image_grid_thw"], arch.image_token_id, 2)
    n = b["input_ids"].shape[0]
    micro = []
    for r in range(n):
        pixels, grids = select_rows(b["pixel_values"], b["image_grid_thw"], rows, range(r, r + 1))
        micro.append(
            {k: b[k][r : r + 1] for k in ("input_ids", "attention_mask", "position_ids")}
            | {"pixel_values": pixels, "image_grid_thw": grids, "weights": weights[r : r + 1]}
        )

    def step(data_iter, model):
        m = next(data_iter)
        out = model_forward(
            model,
            m["input_ids"],
            m["attention_mask"],
            m["position_ids"],
            pixel_values=m["pixel_values"],
            image_grid_thw=m["image_grid_thw"],
        )

        def loss(logits):
            logp = vocab_parallel_log_probs(logits[:, :-1], m["input_ids"][:, 1:], arch.vocab_size)
            return -(logp * m["weights"]).sum() * n, {}  # the schedule divides by the micro-batch count

        return out, loss

    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter(micro),
        model=[chunk],
        num_microbatches=n,
        seq_length=b["input_ids"].shape[1],
        micro_batch_size=1,
        forward_only=False,
    )
    grads, _ = _full_grads(chunk, arch, GRAD_PARAMS)
    return _rel_errors(grads, train["hf_grads"])


def _train_step(train):
    """Gradients at TP=2 against transformers', then a frozen tower under megatron DDP + Adam."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from rlhf_megatron.models import ModelArch
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.forward import model_forward, vocab_parallel_log_probs
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.models.vision_language import freeze_vision_tower
    from rlhf_megatron.platform import init_model_parallel

    arch = ModelArch.from_hf_dir(train["hf_dir"])
    b, weights = train["batch"], train["weights"]
    init_model_parallel(2, 1)
    chunk = build_gpt_model(arch, ParallelConfig(2, 1), init_weights=False)[0]
    load_hf_weights([chunk], train["hf_dir"], arch)

    def loss_of(model):
        logits = model_forward(model, b["input_ids"], b["attention_mask"], b["position_ids"], **_images(b))
        logp = vocab_parallel_log_probs(logits[:, :-1], b["input_ids"][:, 1:], arch.vocab_size)
        return -(logp * weights).sum()

    loss_of(chunk).backward()
    grads, padding = _full_grads(chunk, arch, GRAD_PARAMS)
    errors = {
        n: float((g - train["hf_grads"][n]).abs().max() / train["hf_grads"][n].abs().max())
        for n, g in grads.items()
    }
    lm_grad = dict(chunk.named_parameters())[GRAD_PARAMS[-1]].grad.clone()

    # Frozen: no gradient reaches the tower, the language model's are unchanged.
    chunk.zero_grad(set_to_none=True)
    frozen = freeze_vision_tower([chunk])
    loss_of(chunk).backward()
    vision = [p for n, p in chunk.named_parameters() if n.startswith("vision_model.")]
    result = {
        "grad_errors": errors,
        "padding_grad": padding,
        "frozen": frozen,
        "frozen_vision_grads": sum(p.grad is not None for p in vision),
        "lm_grad_unchanged": torch.equal(dict(chunk.named_parameters())[GRAD_PARAMS[-1]].grad, lm_grad),
    }
    # Megatron DDP and Adam hold nothing for the frozen tower; a step moves the language model only.
    chunk.zero_grad(set_to_none=True)
    ddp = DistributedDataParallel(chunk.config, DistributedDataParallelConfig(), chunk)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, params_dtype=torch.float32), [ddp]
    )
    in_ddp = {p for buffer in ddp.buffers for p in buffer.params}
    in_optimizer = {p for group in optimizer.param_groups for p in group["params"]}
    before = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    ddp.zero_grad_buffer()
    loss_of(ddp).backward()
    ddp.finish_grad_sync()
    optimizer.step()
    moved = {n for n, p in chunk.named_parameters() if not torch.equal(p.detach(), before[n])}
    result.update(
        vision_in_ddp=sum(p in in_ddp for p in vision),
        vision_in_optimizer=sum(p in in_optimizer for p in vision),
        lm_in_ddp=sum(p in in_ddp for n, p in chunk.named_parameters() if n.startswith("language_model.")),
        moved_vision=sorted(n for n in moved if n.startswith("vision_model.")),
        moved_lm=len([n for n in moved if n.startswith("language_model.")]),
    )
    return result


def _bad_inputs(case):
    """Errors a malformed micro-batch raises before any model runs."""
    from rlhf_megatron.models import ModelArch
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.forward import forward_logits_or_values
    from rlhf_megatron.platform import init_model_parallel

    arch = ModelArch.from_hf_dir(case["hf_dir"])
    init_model_parallel(1, 1)
    chunks = build_gpt_model(arch, ParallelConfig(1, 1))
    b = case["batch"]
    ids = b["input_ids"].clone()
    ids[2, (ids[2] == arch.image_token_id).nonzero()[0, 0]] = 5  # row 2 loses one image token
    errors = []
    for kwargs in (
        dict(input_ids=ids),
        dict(pixel_values=b["pixel_values"][:-4]),
        dict(position_ids=b["position_ids"][:, 0]),
    ):
        args = {**b, **kwargs}
        try:
            forward_logits_or_values(
                chunks,
                args["input_ids"],
                args["attention_mask"],
                args["position_ids"],
                pixel_values=args["pixel_values"],
                image_grid_thw=args["image_grid_thw"],
            )
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


# Qwen3-VL parameters whose gradients are compared: learned positions, the patch bias, both
# DeepStack mergers (their norm spans the merged width), a tanh-GELU block MLP, the language model.
QWEN3_GRAD_PARAMS = (
    "vision_model.pos_embed",
    "vision_model.patch_embed.bias",
    "vision_model.deepstack_mergers.0.mlp.linear_fc1.weight",
    "vision_model.deepstack_mergers.1.ln_q.weight",
    "vision_model.decoder.layers.0.mlp.linear_fc1.weight",
    "language_model.decoder.layers.1.self_attention.linear_qkv.weight",
)


def _deepstack_grads_under_recompute(train):
    """Qwen3-VL at TP2 with every layer recomputed in the backward pass: the DeepStack features
    ride in as the decoder's checkpointed ``context``, so their gradients are transformers'."""
    from rlhf_megatron.models import ModelArch
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.forward import model_forward, vocab_parallel_log_probs
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.platform import init_model_parallel

    arch = ModelArch.from_hf_dir(train["hf_dir"])
    b, weights = train["batch"], train["weights"]
    init_model_parallel(2, 1)
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    chunk = build_gpt_model(arch, ParallelConfig(2, 1), init_weights=False, **recompute)[0]
    load_hf_weights([chunk], train["hf_dir"], arch)
    chunk.train()
    logits = model_forward(chunk, b["input_ids"], b["attention_mask"], b["position_ids"], **_images(b))
    logp = vocab_parallel_log_probs(logits[:, :-1], b["input_ids"][:, 1:], arch.vocab_size)
    (-(logp * weights).sum()).backward()
    grads, _ = _full_grads(chunk, arch, QWEN3_GRAD_PARAMS)
    return _rel_errors(grads, train["hf_grads"])


def _run(rank, world_size, cases, train, bad, qwen3_train):
    return {
        "forward": _forward_cases(cases),
        "train": _train_step(train),
        "pipeline": _pipeline_grads(train),
        "bad": _bad_inputs(bad),
        "qwen3_recompute": _deepstack_grads_under_recompute(qwen3_train),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case in ONE 4-rank run: process start-up dominates on CPU."""
    root = tmp_path_factory.mktemp("vl_equivalence")
    q25 = tiny_vl.make_model_dir(root)
    q2 = tiny_vl.make_model_dir(root, "qwen2_vl", tie_word_embeddings=True)
    # 4 layers: both DeepStack levels (after layers 0 and 1) on the first of two pipeline stages.
    q3 = tiny_vl.make_model_dir(root, "qwen3_vl", num_layers=4)
    q3_model = tiny_vl.load_hf(q3)
    q3_images, q3_video = tiny_vl.image_batch(q3), tiny_vl.video_batch(q3)
    batch = tiny_vl.image_batch(q25)
    q25_model = tiny_vl.load_hf(q25)
    ref = tiny_vl.hf_logits(q25_model, batch)
    video = tiny_vl.video_batch(q25)
    # transformers-5 names (model.visual.*, model.language_model.*) load the same weights.
    alias = _renamed_checkpoint(q25, root / "q25-model-prefix")
    cases = [
        {
            "name": "qwen2_5_vl",
            "hf_dir": str(q25),
            "batch": batch,
            "ref": ref,
            "layouts": [(1, 1, None), (2, 1, None), (2, 2, 1)],
        },
        {
            "name": "qwen2_5_vl-own-positions",
            "hf_dir": str(q25),
            "batch": batch,
            "ref": ref,
            "positions": False,
            "layouts": [(1, 2, None)],
        },
        {
            "name": "qwen2_5_vl-model-prefix",
            "hf_dir": str(q25),
            "load_dir": str(alias),
            "batch": batch,
            "ref": ref,
            "layouts": [(2, 1, None)],
        },
        {
            "name": "qwen2_vl-tied",
            "hf_dir": str(q2),
            "batch": batch,
            "ref": tiny_vl.hf_logits(tiny_vl.load_hf(q2), batch),
            "layouts": [(1, 1, None), (2, 2, 1)],
        },
        {
            "name": "qwen2_5_vl-video",
            "hf_dir": str(q25),
            "batch": video,
            "ref": tiny_vl.hf_logits(q25_model, video),
            "layouts": [(1, 1, None), (2, 2, 1)],
        },
        {
            "name": "qwen2_5_vl-video-own-positions",
            "hf_dir": str(q25),
            "batch": video,
            "ref": tiny_vl.hf_logits(q25_model, video),
            "positions": False,
            "layouts": [(2, 1, 2)],
        },
        {
            "name": "qwen3_vl",
            "hf_dir": str(q3),
            "batch": q3_images,
            "ref": tiny_vl.hf_logits(q3_model, q3_images),
            "layouts": [(1, 1, None), (2, 2, 1)],
        },
        {
            "name": "qwen3_vl-video",
            "hf_dir": str(q3),
            "batch": q3_video,
            "ref": tiny_vl.hf_logits(q3_model, q3_video),
            "layouts": [(1, 1, None), (2, 2, 1)],
        },
        {
            "name": "qwen3_vl-video-own-positions",
            "hf_dir": str(q3),
            "batch": q3_video,
            "ref": tiny_vl.hf_logits(q3_model, q3_video),
            "positions": False,
            "layouts": [(2, 1, 2)],
        },
        {
            "name": "qwen2_5_vl-critic",
            "hf_dir": str(q25),
            "head": "value",
            "batch": batch,
            "layouts": [(2, 2, None)],
        },
    ]
    weights = tiny_vl.loss_weights(batch)
    train = {
        "hf_dir": str(q25),
        "batch": batch,
        "weights": weights,
        "hf_grads": _hf_grads(q25_model, batch, weights),
    }
    bad = {"hf_dir": str(q25), "batch": batch}
    q3_weights = tiny_vl.loss_weights(q3_video)
    qwen3_train = {
        "hf_dir": str(q3),
        "batch": q3_video,
        "weights": q3_weights,
        "hf_grads": _hf_grads(q3_model, q3_video, q3_weights, QWEN3_GRAD_PARAMS),
    }
    out = run_on_ranks(_run, 4, cases, train, bad, qwen3_train, timeout_s=900)
    return {"forward": [r for o in out for r in o["forward"]], "train": out, "batch": batch}


def _renamed_checkpoint(src, dst):
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    state = load_file(str(src / "model.safetensors"))
    renamed = {
        (
            "model.visual." + k[7:]
            if k.startswith("visual.")
            else "model.language_model." + k[6:]
            if k.startswith("model.")
            else k
        ): v
        for k, v in state.items()
    }
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    return dst


def _hf_grads(model, batch, weights, params=GRAD_PARAMS):
    from rlhf_megatron.models import ModelArch
    from rlhf_megatron.models.spec import hf_names

    model.zero_grad(set_to_none=True)
    if "mm_token_type_ids" in batch:  # Qwen3-VL: transformers numbers the positions itself
        positions = {"mm_token_type_ids": batch["mm_token_type_ids"]}
    else:
        positions = {"position_ids": batch["position_ids"].transpose(0, 1)}
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **_images(batch), **positions
    ).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    (-(logp * weights).sum()).backward()
    arch = ModelArch.from_hf_config({**model.config.to_dict(), "architectures": [type(model).__name__]})
    hub = arch.model_type != "qwen3_vl"  # Qwen3-VL checkpoints keep transformers' module paths
    state = {_hub_name(n) if hub else n: p for n, p in model.named_parameters()}
    wanted = {h for name in params for h in hf_names(name, arch)}
    return {h: state[h].grad.detach().clone() for h in wanted}


def _hub_name(name: str) -> str:
    """transformers' module path -> the checkpoint name (what save_pretrained writes)."""
    if name.startswith("model.visual."):
        return "visual." + name[len("model.visual.") :]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


def _errors(results, name):
    by_layout: dict = {}
    for r in results["forward"]:
        if r["name"] == name and "shape" in r:
            by_layout.setdefault(r["layout"], []).append(r)
            if "rel_err" in r:
                assert r["rel_err"] <= REL_TOL, (name, r["layout"], r["rel_err"])
    return by_layout


@pytest.mark.slow
def test_qwen2_5_vl_logits_match_transformers_at_tp1_tp2_and_tp2pp2(results):
    by_layout = _errors(results, "qwen2_5_vl")
    assert set(by_layout) == {(1, 1, None), (2, 1, None), (2, 2, 1)}
    vocab = 256 // 2  # 119 tokens padded to 256 at TP=2: each rank its half
    assert {r["shape"] for r in by_layout[(2, 2, 1)]} == {(4, results["batch"]["input_ids"].shape[1], vocab)}
    assert set(_errors(results, "qwen2_5_vl-own-positions")) == {(1, 2, None)}


@pytest.mark.slow
def test_video_rows_match_transformers_with_their_clips_split_across_micro_batches(results):
    # A 4-frame clip (2 temporal patches a second apart), an image, an image before a one-frame
    # clip, text: at TP1, at TP2 x PP2 one row per micro-batch, and at TP2 two rows per micro-batch
    # with the positions computed inside from the grids and seconds (Qwen2.5-VL's timed M-RoPE).
    assert set(_errors(results, "qwen2_5_vl-video")) == {(1, 1, None), (2, 2, 1)}
    assert set(_errors(results, "qwen2_5_vl-video-own-positions")) == {(2, 1, 2)}
    rel = [
        r["rel_err"]
        for r in results["forward"]
        if r["name"].startswith("qwen2_5_vl-video") and "rel_err" in r
    ]
    assert rel and max(rel) <= REL_TOL


@pytest.mark.slow
def test_qwen3_vl_matches_transformers_on_images_and_videos(results):
    # Learned positions resampled per image, DeepStack features added after layers 0 and 1,
    # interleaved M-RoPE, each video frame its own run after a timestamp; transformers numbers its
    # own positions (mm_token_type_ids), ours come from data.rope_index or, in the last case, from
    # inside the model with two rows per micro-batch.
    assert set(_errors(results, "qwen3_vl")) == {(1, 1, None), (2, 2, 1)}
    assert set(_errors(results, "qwen3_vl-video")) == {(1, 1, None), (2, 2, 1)}
    assert set(_errors(results, "qwen3_vl-video-own-positions")) == {(2, 1, 2)}
    assert sum(r["name"].startswith("qwen3_vl") and "rel_err" in r for r in results["forward"]) >= 5


@pytest.mark.slow
def test_qwen3_vl_deepstack_gradients_match_transformers_under_full_recompute(results):
    for out in results["train"]:
        errors = out["qwen3_recompute"]
        assert len(errors) == 8  # the language model's qkv gives q, k and v
        assert "model.visual.deepstack_merger_list.1.norm.weight" in errors
        for name, err in errors.items():
            assert err <= GRAD_TOL, (name, err)


@pytest.mark.slow
def test_transformers5_prefixed_checkpoint_loads_the_same(results):
    assert set(_errors(results, "qwen2_5_vl-model-prefix")) == {(2, 1, None)}


@pytest.mark.slow
def test_qwen2_vl_layernorm_quick_gelu_tied_matches_transformers(results):
    assert set(_errors(results, "qwen2_vl-tied")) == {(1, 1, None), (2, 2, 1)}


@pytest.mark.slow
def test_vision_language_critic_has_a_scalar_head(results):
    rows = [r for r in results["forward"] if r["name"] == "qwen2_5_vl-critic"]
    last = [r for r in rows if r["info"].pp_rank == 1]
    kept = ["language_model.output_layer.weight", "language_model.output_layer.bias"]
    assert last and all(r["kept"] == kept for r in last)
    assert {r["shape"] for r in rows if "shape" in r} == {(4, results["batch"]["input_ids"].shape[1])}


@pytest.mark.slow
def test_gradients_through_the_vision_tower_match_transformers(results):
    for rank, out in enumerate(results["train"]):
        train = out["train"]
        assert len(train["grad_errors"]) == 12  # fc1 gives gate and up; the language model's qkv q, k, v
        for name, err in train["grad_errors"].items():
            assert err <= GRAD_TOL, (rank, name, err)
        # The padded MLP rows (252 -> 256) get exactly zero gradient, so they stay zero.
        assert train["padding_grad"] == {"vision_model.decoder.layers.1.mlp.linear_fc1.weight": 0.0}


@pytest.mark.slow
def test_gradients_through_the_pipeline_schedule_match_transformers(results):
    # Stage 0 (ranks 0, 1) holds the tower, the embedding and layer 0; stage 1 layer 1.
    stage0, stage1 = results["train"][0]["pipeline"], results["train"][3]["pipeline"]
    assert "visual.patch_embed.proj.weight" in stage0 and "model.embed_tokens.weight" in stage0
    assert set(stage1) == {f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"}
    for out in results["train"]:
        for name, err in out["pipeline"].items():
            assert err <= GRAD_TOL, (name, err)


@pytest.mark.slow
def test_frozen_vision_tower_gets_no_gradient_state_or_update(results):
    for out in results["train"]:
        train = out["train"]
        assert train["frozen"] > 20 and train["frozen_vision_grads"] == 0
        assert train["lm_grad_unchanged"]
        assert train["vision_in_ddp"] == 0 and train["vision_in_optimizer"] == 0 and train["lm_in_ddp"] > 0
        assert train["moved_vision"] == [] and train["moved_lm"] > 0


@pytest.mark.slow
def test_malformed_image_inputs_name_the_row(results):
    token, patches, positions = results["train"][0]["bad"]
    assert token is not None and token.startswith("row 2: 11 image tokens (id 117)"), token
    assert patches is not None and "pixel_values has 108 patches but image_grid_thw implies 112" in patches, (
        patches
    )
    assert positions is not None and "needs M-RoPE position_ids [B, 3, S]" in positions, positions
