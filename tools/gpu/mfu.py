"""Single-GPU MFU of the update step: megatron's local layers against torch's fused kernels (issue #38).

Run on the GPU machine through ``tools/gpu/run.sh`` with ``--mfu`` (it installs the carried
wheels first); writes ONE JSON file. Every variant runs in the same process on the same card,
so before and after are comparable. Sections (a failing one records its traceback, the rest
still run; a ``--budget-s`` deadline skips what would not finish):

- ``env``, ``ceilings``: as ``measure.py`` (copy bandwidth, bf16 8192^3 matmul).
- ``sdpa``: which ``scaled_dot_product_attention`` kernel runs (flash / memory-efficient /
  cuDNN / math, from the profiler's kernel names) and how fast, forward + backward, for the
  1.24B model's attention (32 query / 8 KV heads, head 64, 2 x 2048 tokens): causal without a
  mask, and with the explicit causal + padding mask, each with GQA (``enable_gqa``) and with K/V
  expanded to every head; then each backend forced, to see which accept the case.
- ``variants``: ``MegatronEngine`` runs of one optimizer step (the actor's GRPO loss, as
  ``measure.py``): build, a warm-up update (compilation included), ``--steps`` timed updates
  and log-prob passes; seconds, tokens/s, MFU, peak memory. ``base`` is megatron's local layers
  with torch's deterministic algorithms and multi-tensor AdamW (the defaults before issue #38);
  ``after`` what this checkout does on CUDA (sdpa attention, mask-free rows from 8K-token micro-batches,
  deterministic algorithms off) with torch's fused AdamW; then ``after`` with mask-free rows at
  2K, larger micro-batches, recompute selective/full, 4K tokens, 16K/32K tokens with full
  recompute (mask-free against the mask), a Llama-3.2-3B-shaped model, and left/right-padded
  rows (mask-free rolled rows against the mask: same log-probs?). The first run (its JSON keeps
  its own variant list) added one change at a time instead.
- ``profile`` (inside a variant): one update under torch's profiler: GPU kernel time by category
  and the top kernels, how much of the step the GPU was busy, and on the host the ops with the
  most self time and the calls that wait for the device.
- ``planner``: ``rlhf-megatron plan``'s actor numbers for each variant's config against its
  measured peaks (``--replan`` recomputes it on CPU from the JSON).

MFU as ``measure.py``: model FLOPs (matrix parameters + causal attention, no recomputation)
against ``--peak-tflops`` (989: dense bf16 of an H100/H200 SXM).

    bash tools/gpu/run.sh --mfu OUT.json            # on the GPU machine
    .venv/bin/python tools/gpu/mfu.py --tiny --out /tmp/mfu.json   # CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure  # noqa: E402  (tools/gpu/measure.py)

# Keys: model (measure.MODELS), attention (local | sdpa | auto), causal_rows (builder's: "auto", a
# width from which rows go mask-free, None: never), deterministic (torch's deterministic algorithms;
# None: what init_model_parallel set, the default), fused_adam (torch's fused AdamW), swiglu
# (megatron's compiled SwiGLU), recompute, shape (prompt, response, mini-batch rows, micro-batch
# rows; None: --prompt/--response/16/2), padded (random left/right padding), log_prob, profile.
BASE = dict(
    model="llama-1b",
    attention="local",
    causal_rows=None,
    deterministic=True,
    fused_adam=False,
    swiglu=False,
    recompute="none",
    shape=None,
    padded=False,
    log_prob=True,
    profile=False,
)
# What this checkout does on CUDA by default (attention auto = sdpa, mask-free rows from 8K-token
# micro-batches, no deterministic algorithms), plus torch's fused AdamW.
AFTER = dict(attention="auto", causal_rows="auto", deterministic=None, fused_adam=True)
LONG16, LONG32 = (1024, 15360, 2, 1), (1024, 31744, 2, 1)
VARIANTS = [
    dict(name="base", profile=True),
    dict(name="after", **AFTER, profile=True),
    dict(name="after_rows", **{**AFTER, "causal_rows": 0}),
    dict(name="after_m4", **AFTER, shape=(1024, 1024, 16, 4)),
    dict(name="after_m8", **AFTER, shape=(1024, 1024, 16, 8), profile=True),
    dict(name="after_m4_rows", **{**AFTER, "causal_rows": 0}, shape=(1024, 1024, 16, 4)),
    dict(name="after_selective", **AFTER, recompute="selective"),
    dict(name="after_full", **AFTER, recompute="full"),
    dict(name="after_4k", **AFTER, shape=(1024, 3072, 8, 1)),
    dict(name="after_16k_full", **AFTER, recompute="full", shape=LONG16, log_prob=False),
    dict(
        name="after_16k_full_mask",
        **{**AFTER, "causal_rows": None},
        recompute="full",
        shape=LONG16,
        log_prob=False,
    ),
    dict(name="after_32k_full", **AFTER, recompute="full", shape=LONG32, log_prob=False),
    dict(
        name="after_32k_full_mask",
        **{**AFTER, "causal_rows": None},
        recompute="full",
        shape=LONG32,
        log_prob=False,
    ),
    dict(name="base_3b", model="llama-3b"),
    dict(name="after_3b", model="llama-3b", **AFTER),
    dict(name="after_3b_m4", model="llama-3b", **AFTER, shape=(1024, 1024, 16, 4)),
    dict(name="after_padded", **AFTER, padded=True),
    dict(name="after_padded_rows", **{**AFTER, "causal_rows": 0}, padded=True),
]


def gib(x: float) -> float:
    return round(x / 2**30, 3)


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


# ---------------------------------------------------------------------- kernel categories
CATEGORIES = (  # first match wins; names are lower-cased
    ("nccl", r"nccl"),
    ("attention (fused)", r"flash|fmha|sdpa|attention|mem_eff"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_|ampere_|wgmma|splitk"),
    ("softmax", r"softmax"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("compiled (triton)", r"triton"),
    ("norm", r"rms|layer_norm|layernorm|gammabeta"),
    ("reduction", r"reduce_kernel|reduce|argmax"),
    ("index / scatter", r"index|scatter|gather|embedding|sort|radix|cumsum|scan"),
    ("copy / fill", r"copy|memcpy|memset|fill|catarray"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
)


def kernel_category(name: str) -> str:
    """The category of a CUDA kernel by its (demangled) name."""
    low = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, low):
            return label
    return "other"


def kernel_table(events, wall_s: float, top: int = 60) -> dict:
    """``events``: ``(name, microseconds)`` per kernel launch -> time by category, the top kernels,
    and the GPU's busy share of ``wall_s``."""
    by_name: dict[str, list[float]] = {}
    for name, us in events:
        by_name.setdefault(name, []).append(us)
    total_us = sum(sum(v) for v in by_name.values())
    cats: dict[str, float] = {}
    for name, times in by_name.items():
        cats[kernel_category(name)] = cats.get(kernel_category(name), 0.0) + sum(times)
    top_rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "kernel_ms": round(total_us / 1e3, 2),
        "wall_ms": round(wall_s * 1e3, 2),
        "gpu_busy": round(total_us / 1e6 / wall_s, 3) if wall_s else None,
        "categories": {
            k: {"ms": round(v / 1e3, 2), "share": round(v / total_us, 3) if total_us else 0.0}
            for k, v in sorted(cats.items(), key=lambda kv: -kv[1])
        },
        "top_kernels": [
            {
                "name": name[:160],
                "category": kernel_category(name),
                "calls": len(times),
                "ms": round(sum(times) / 1e3, 2),
            }
            for name, times in top_rows
        ],
    }


def profiled_kernels(fn, cuda: bool, host: dict | None = None) -> tuple[list[tuple[str, float]], float]:
    """Run ``fn`` once under torch's profiler: ``(kernel name, microseconds)`` per launch (user
    annotations left out), wall seconds. ``host``, when given, gets the host side: the ops with the
    most self CPU time, and the calls that wait for the device."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(cuda)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        sync(cuda)
        wall = time.perf_counter() - start
    kernels = [
        (e.name, e.time_range.elapsed_us())
        for e in prof.events()
        if getattr(e, "device_type", None) == DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and "#" not in e.name
    ]
    if host is not None:
        averages = [a for a in prof.key_averages() if getattr(a, "device_type", None) == DeviceType.CPU]
        averages.sort(key=lambda a: -a.self_cpu_time_total)
        host["top_self_cpu"] = [
            {"name": a.key[:100], "calls": a.count, "self_ms": round(a.self_cpu_time_total / 1e3, 2)}
            for a in averages[:30]
        ]
        waits = [
            a for a in averages if re.search(r"synchronize|memcpy|item|_local_scalar_dense", a.key, re.I)
        ]
        host["waits"] = [
            {"name": a.key[:100], "calls": a.count, "self_ms": round(a.self_cpu_time_total / 1e3, 2)}
            for a in waits[:12]
        ]
    return kernels, wall


# ---------------------------------------------------------------------- SDPA kernels
ATTN = dict(batch=2, heads=32, kv_heads=8, seq=2048, head_dim=64)


def _attention_kernel_names(kernels) -> list[str]:
    names = sorted({n for n, _ in kernels if kernel_category(n) in ("attention (fused)", "softmax")})
    return [n[:120] for n in names]


def sdpa_kernels(cuda: bool, repeats: int = 10) -> dict:
    """Which SDPA kernel each attention case takes, and its forward + backward time."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not cuda:
        return {"skipped": "no CUDA"}
    a = ATTN
    b, h, g, s, d = a["batch"], a["heads"], a["kv_heads"], a["seq"], a["head_dim"]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

    q, k, v = rand(b, h, s, d), rand(b, g, s, d), rand(b, g, s, d)
    grad = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    pad = torch.ones(b, s, dtype=torch.long, device="cuda")
    pad[0, :300] = 0  # row 0: 300 columns of left padding
    from rlhf_megatron.models.forward import build_attention_mask

    allowed = ~build_attention_mask(pad)  # [b, 1, s, s], True = may attend
    causal_flops = 4 * b * h * s * s * d / 2  # QK^T and AV over half the square
    cases = {
        "causal_gqa": dict(is_causal=True, gqa=True),
        "causal_expanded": dict(is_causal=True, gqa=False),
        "mask_gqa": dict(mask=True, gqa=True),
        "mask_expanded": dict(mask=True, gqa=False),
    }

    def make(case):
        def fn():
            kk, vv = (
                (k, v)
                if case.get("gqa")
                else (k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1))
            )
            out = F.scaled_dot_product_attention(
                q,
                kk,
                vv,
                attn_mask=allowed if case.get("mask") else None,
                is_causal=bool(case.get("is_causal")),
                enable_gqa=bool(case.get("gqa")),
            )
            out.backward(grad)
            q.grad = k.grad = v.grad = None

        return fn

    out: dict = {"shape": a}
    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    for label, case in cases.items():
        fn = make(case)
        entry: dict = {}
        for det in (False, True):
            torch.use_deterministic_algorithms(det, warn_only=True)
            key = "deterministic" if det else "default"
            try:
                ms = measure._event_median(fn, repeats)
                kernels, _ = profiled_kernels(fn, cuda)
                entry[key] = {
                    "ms": round(ms, 3),
                    "tflops": round(3.5 * causal_flops / ms / 1e9, 1),
                    "kernels": _attention_kernel_names(kernels),
                }
            except Exception as exc:  # noqa: BLE001 (recorded)
                entry[key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        torch.use_deterministic_algorithms(False)
        for name, backend in backends.items():
            try:
                with sdpa_kernel([backend]):
                    ms = measure._event_median(fn, max(3, repeats // 2))
                entry[name] = {"ms": round(ms, 3), "tflops": round(3.5 * causal_flops / ms / 1e9, 1)}
            except Exception as exc:  # noqa: BLE001 (recorded)
                entry[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        out[label] = entry
        print(f"[mfu] sdpa {label}: {json.dumps(entry)[:400]}", flush=True)
    return out


# ---------------------------------------------------------------------- engine variants
def variant_args(args, v: dict) -> argparse.Namespace:
    """The measurement's shape for variant ``v`` (``measure.py``'s argument names)."""
    a = copy.copy(args)
    if v["shape"] is not None:
        a.prompt, a.response, a.mini_batch, a.micro = v["shape"]
        a.n = min(args.n, a.mini_batch)
    return a


def variant_overrides(v: dict) -> list[str]:
    """Config overrides beyond ``measure.run_config``: the attention backend and recomputation."""
    key = "actor_rollout_ref.actor.megatron"
    out = [f"{key}.attention_backend={v['attention']}"]
    for k, value in measure.RECOMPUTE[v["recompute"]].items():
        out.append(f"{key}.{k}={value}")
    return out


def padded_batch(args, vocab: int, seed: int) -> dict:
    """``measure.synthetic_batch`` with rollout-shaped padding: prompts left-padded by 0..prompt/2
    columns, responses right-padded by 0..response/2, per row."""
    batch = measure.synthetic_batch(args, vocab, seed)
    g = torch.Generator().manual_seed(seed + 1)
    rows, p, r = args.mini_batch, args.prompt, args.response
    left = torch.randint(0, p // 2 + 1, (rows,), generator=g)
    right = torch.randint(0, r // 2 + 1, (rows,), generator=g)
    col = torch.arange(p + r)
    mask = ((col[None] >= left[:, None]) & (col[None] < (p + r - right)[:, None])).long()
    batch["attention_mask"] = mask
    batch["input_ids"] = batch["input_ids"] * mask
    batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    batch["responses"] = batch["input_ids"][:, p:]
    batch["response_mask"] = mask[:, p:].float()
    return batch


def run_variant(args, model_dir: str, v: dict) -> dict:
    """One engine per variant: build, warm-up update, timed updates and log-prob passes."""
    from omegaconf import OmegaConf

    import rlhf_megatron.workers.megatron_engine as engine_mod
    from rlhf_megatron.config.model_arch import ModelArch
    from rlhf_megatron.data.batch import Batch
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.platform.fused_adam import fuse_torch_adam
    from rlhf_megatron.workers.actor import UPDATE_KEYS, ActorRolloutRefWorker
    from rlhf_megatron.workers.megatron_engine import MODEL_KEYS, MegatronEngine, split_micro_batches

    cuda = args.cuda
    a = variant_args(args, v)
    cfg = measure.load_config_with(a, model_dir, variant_overrides(v))
    section_cfg = OmegaConf.to_object(cfg.actor_rollout_ref)
    arch = ModelArch.from_hf_dir(model_dir)
    deterministic = args.default_deterministic if v["deterministic"] is None else v["deterministic"]
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    out: dict = {
        "variant": {k: v[k] for k in v},
        "overrides": variant_overrides(v),
        "deterministic": deterministic,
    }
    # The engine builds its chunks through this name: the variant's fused kernels go in here.
    engine_mod.build_gpt_model = functools.partial(
        build_gpt_model, causal_rows=v["causal_rows"], fuse_swiglu=v["swiglu"]
    )
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with measure.Timer(cuda) as t:
            engine = MegatronEngine(
                arch,
                ParallelConfig(1),
                model_dir,
                section_cfg.actor.megatron,
                section_cfg.actor.optim,
                total_steps=100,
            )
    finally:
        engine_mod.build_gpt_model = build_gpt_model
    out["build_s"] = round(t.seconds, 2)
    if v["fused_adam"]:
        out["fused_adam_optimizers"] = fuse_torch_adam(engine.optimizer)
    worker = types.SimpleNamespace(section=section_cfg, arch=arch)
    policy_loss = ActorRolloutRefWorker._policy_loss_fn(worker)
    log_prob_fn = ActorRolloutRefWorker._log_prob_fn(worker)
    captured: list = []

    def forward_loss(output, micro):
        result = log_prob_fn(output, micro)
        if not captured:  # the first micro-batch's log-probs, for comparing variants
            captured.append(result)
        return output.new_zeros(()), {}

    make = padded_batch if v["padded"] else measure.synthetic_batch
    batch = Batch.from_dict(make(a, arch.vocab_size, seed=0))
    update_micros = split_micro_batches(batch, (*MODEL_KEYS, *UPDATE_KEYS, "ref_log_probs"), a.micro)
    forward_micros = split_micro_batches(batch, (*MODEL_KEYS, "responses"), a.micro)
    tokens = int(batch["attention_mask"].sum())
    flops = measure.flops_per_token(arch, a.prompt + a.response)
    peak = args.peak_tflops * 1e12

    def update():
        return engine.train_step(update_micros, policy_loss, "stop", "[mfu]")

    with measure.Timer(cuda) as t:
        first = update()
    out["warmup_s"] = round(t.seconds, 2)
    out["warmup_update_ok"] = bool(first["update_ok"])

    def timed(fn, n):
        seconds, peaks, results = [], [], []
        for _ in range(n):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            with measure.Timer(cuda) as tm:
                results.append(fn())
            seconds.append(tm.seconds)
            if cuda:
                peaks.append(torch.cuda.max_memory_allocated())
        return seconds, peaks, results

    def stats(seconds, peaks, passes):
        s = statistics.median(seconds)
        return {
            "seconds": [round(x, 4) for x in seconds],
            "median_s": round(s, 4),
            "tokens": tokens,
            "tokens_per_s": round(tokens / s, 1),
            "mfu": round(passes * flops["forward"] * tokens / s / peak, 4),
            "peak_allocated_bytes": max(peaks) if peaks else None,
            "peak_allocated_gib": gib(max(peaks)) if peaks else None,
        }

    seconds, peaks, results = timed(update, args.steps)
    out["update"] = stats(seconds, peaks, passes=3)
    out["update"]["grad_norms"] = [round(r["grad_norm"], 5) for r in results]
    out["update"]["update_ok"] = all(r["update_ok"] for r in results)
    if v["log_prob"]:
        seconds, peaks, _ = timed(
            lambda: engine.run(forward_micros, forward_loss, forward_only=True), args.steps
        )
        out["log_prob"] = stats(seconds, peaks, passes=1)
        if captured:
            lp = captured[0]
            lp = lp[0] if isinstance(lp, tuple) else lp
            if isinstance(lp, dict):
                lp = next(iter(lp.values()))
            out["first_log_probs"] = lp.detach().float().cpu() if torch.is_tensor(lp) else None
    if v["profile"]:
        host: dict = {}
        kernels, wall = profiled_kernels(update, cuda, host)
        out["profile"] = {**kernel_table(kernels, wall), "host": host}
    engine = first = results = None
    _free_megatron_buffers()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def _free_megatron_buffers() -> None:
    """Drop megatron's global buffer (local attention keeps one layer's scores there), so the next
    variant's peak memory is its own."""
    from megatron.core import parallel_state

    parallel_state.destroy_global_memory_buffer()
    parallel_state._set_global_memory_buffer()


def compare_log_probs(runs: dict, a: str, b: str, args) -> dict:
    """Max |difference| of two variants' first micro-batch log-probs over its response tokens."""
    la, lb = runs.get(a, {}).get("first_log_probs"), runs.get(b, {}).get("first_log_probs")
    if la is None or lb is None:
        return {"skipped": f"no log-probs from {a} or {b}"}
    batch = padded_batch(variant_args(args, {"shape": None}), 100, seed=0)
    mask = batch["response_mask"][: la.shape[0], : la.shape[1]].bool()
    diff = (la - lb).abs()[mask]
    return {
        "variants": [a, b],
        "tokens": int(mask.sum()),
        "max_abs_diff": round(float(diff.max()), 5) if diff.numel() else None,
        "mean_abs_diff": round(float(diff.mean()), 6) if diff.numel() else None,
    }


# ---------------------------------------------------------------------- planner
def planner(args, model_dirs: dict[str, str], runs: dict) -> dict:
    """The planner's actor numbers for each variant's config (``model_dirs``: model name ->
    checkpoint or config directory), against its measured peaks."""
    from rlhf_megatron.config.planner import plan_memory

    out = {}
    for name, run in runs.items():
        if "update" not in run:
            continue
        v = {**BASE, **run["variant"]}
        a = variant_args(args, v)
        model_dir = model_dirs["tiny" if args.tiny else v["model"]]
        cfg = measure.load_config_with(a, model_dir, run["overrides"])
        actor = next(r for r in plan_memory(cfg, world_size=1).roles if r.role == "actor")
        entry = {
            "update_planned_gib": gib(actor.training_phase()),
            "log_prob_planned_gib": gib(actor.forward_phase()),
        }
        for phase, planned in (("update", actor.training_phase()), ("log_prob", actor.forward_phase())):
            measured = run.get(phase, {}).get("peak_allocated_bytes")
            if measured:
                entry[f"{phase}_measured_gib"] = gib(measured)
                entry[f"{phase}_ratio"] = round(planned / measured, 3)
        out[name] = entry
    return out


# ---------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch (CPU smoke run)")
    parser.add_argument("--steps", type=int, default=3, help="timed repeats per phase")
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run (default: all)")
    parser.add_argument(
        "--budget-s", type=float, default=330.0, help="skip variants once this many seconds passed"
    )
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0)
    parser.add_argument("--replan", action="store_true", help="recompute the planner section of --out (CPU)")
    parser.add_argument("--skip-sdpa", action="store_true", help="leave out the SDPA kernel section")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    args.cuda = torch.cuda.is_available()
    args.transformer_impl = "local"
    args.n = 8
    if args.tiny:
        args.model, args.prompt, args.response, args.mini_batch, args.micro = "tiny", 32, 32, 8, 2
    else:
        args.model, args.prompt, args.response, args.mini_batch, args.micro = "llama-1b", 1024, 1024, 16, 2
    out_path = Path(args.out)
    if args.replan:
        return replan(out_path, args)
    if not args.cuda and not args.tiny:
        parser.error("no CUDA device here: run on the GPU machine, or pass --tiny")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "started": time.strftime("%F %T"),
    }

    def save():
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1, default=_jsonable))
        os.replace(tmp, out_path)

    def section(name, fn):
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001 (recorded, the rest still runs)
            results[name] = {"error": traceback.format_exc()}
            print(f"[mfu] {name} FAILED:\n{results[name]['error']}", file=sys.stderr, flush=True)
        print(f"[mfu] {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        save()

    section("env", lambda: measure.env_info(args.cuda))
    section("ceilings", lambda: measure.ceilings(args.cuda, repeats=10))
    if not args.skip_sdpa:
        section("sdpa", lambda: sdpa_kernels(args.cuda))

    from rlhf_megatron.platform import destroy_distributed, init_distributed, init_model_parallel
    from rlhf_megatron.platform.multiproc import find_free_port

    init_distributed(0, 1, "127.0.0.1", find_free_port())
    init_model_parallel(1, 1, seed=1)
    args.default_deterministic = torch.are_deterministic_algorithms_enabled()
    results["env"]["deterministic_after_init"] = args.default_deterministic
    variants = [{**BASE, **v} for v in VARIANTS if args.only is None or v["name"] in args.only]
    with tempfile.TemporaryDirectory(prefix="mfu_model_") as tmp:
        longest = max(sum((v["shape"] or (args.prompt, args.response))[:2]) for v in variants)
        model_dirs: dict[str, str] = {}

        def model_dir_of(name: str) -> str:
            """The checkpoint of model ``name``, written when first needed."""
            if name not in model_dirs:
                path = Path(tmp) / name
                results.setdefault("models", {})[name] = measure.write_model(
                    path, measure.MODELS[name], args.cuda, max(8192, longest)
                )
                model_dirs[name] = str(path)
            return model_dirs[name]

        results["variants"] = {}
        for v in variants:
            elapsed = time.perf_counter() - start
            if elapsed > args.budget_s:
                results["variants"][v["name"]] = {
                    "skipped": f"budget: {elapsed:.0f} s > {args.budget_s:.0f} s"
                }
                continue
            t0 = time.perf_counter()
            try:
                model = "tiny" if args.tiny else v["model"]
                results["variants"][v["name"]] = run_variant(args, model_dir_of(model), v)
            except Exception:  # noqa: BLE001 (recorded)
                results["variants"][v["name"]] = {"variant": v, "error": traceback.format_exc()}
                print(f"[mfu] {v['name']} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
                _free_megatron_buffers()
                gc.collect()
                if args.cuda:
                    torch.cuda.empty_cache()
            print(
                f"[mfu] {v['name']}: {time.perf_counter() - t0:.1f} s {_line(results['variants'][v['name']])}",
                flush=True,
            )
            save()
        runs = results["variants"]
        section(
            "padded_log_probs", lambda: compare_log_probs(runs, "after_padded_rows", "after_padded", args)
        )
        section("planner", lambda: planner(args, model_dirs, runs))
    for run in results["variants"].values():
        run.pop("first_log_probs", None)
    destroy_distributed()
    results["finished"] = time.strftime("%F %T")
    results["elapsed_s"] = round(time.perf_counter() - start, 1)
    save()
    print(summary(results), flush=True)
    return 0


def replan(path: Path, args) -> int:
    """The planner section of ``path`` recomputed by this checkout's planner (CPU is enough)."""
    results = json.loads(path.read_text())
    saved = results["args"]
    for key in ("prompt", "response", "mini_batch", "micro", "n", "gpu_memory_gb", "transformer_impl"):
        setattr(args, key, saved[key])
    args.cuda, args.tiny = saved.get("cuda", True), saved.get("tiny", False)
    models = results.get("models") or {"llama-1b": results["model"]}  # the first run wrote one model
    with tempfile.TemporaryDirectory(prefix="replan_") as tmp:
        longest = max(
            8192,
            *(
                sum((r["variant"].get("shape") or (0, 0))[:2])
                for r in results["variants"].values()
                if "variant" in r
            ),
        )
        dirs = {}
        for name, model in models.items():  # config.json only: the planner needs no weights
            dirs[name] = str(Path(tmp) / name)
            measure.llama_config(model["shape"], longest).save_pretrained(dirs[name])
        results["planner"] = planner(args, dirs, results["variants"])
    results["planner"]["recomputed"] = time.strftime("%F %T")
    path.write_text(json.dumps(results, indent=1, default=_jsonable))
    print(summary(results), flush=True)
    return 0


def _jsonable(x):
    if torch.is_tensor(x):
        return None  # captured log-probs: compared in the run, not stored
    return str(x)


def _line(run: dict) -> str:
    if "update" not in run:
        return (run.get("skipped") or run.get("error", "?"))[-300:]
    u = run["update"]
    return f"update {u['median_s']:.3f} s {u['tokens_per_s']:.0f} tok/s MFU {u['mfu']:.3f} peak {u['peak_allocated_gib']} GiB"


def summary(results: dict) -> str:
    env, c = results.get("env", {}), results.get("ceilings", {})
    lines = [
        "",
        "== summary ==",
        f"device {env.get('device', 'cpu')}  torch {env.get('torch')}  megatron-core {env.get('megatron_core')}",
        f"ceilings: copy {c.get('copy_gb_per_s')} GB/s, bf16 matmul {c.get('matmul_tflops')} TFLOP/s",
    ]
    sdpa = results.get("sdpa", {})
    for case in ("causal_gqa", "causal_expanded", "mask_gqa", "mask_expanded"):
        e = sdpa.get(case, {}).get("default", {})
        if e:
            lines.append(
                f"sdpa {case:16s} {e.get('ms')} ms {e.get('tflops')} TFLOP/s {e.get('kernels') or e.get('error')}"
            )
    plan = results.get("planner", {})
    header = f"{'variant':28s} {'update s':>8s} {'tok/s':>8s} {'MFU':>6s} {'peak GiB':>8s} {'plan':>6s} | {'log-prob tok/s':>14s} {'MFU':>6s}"
    lines.append(header)
    for name, run in results.get("variants", {}).items():
        if "update" not in run:
            lines.append(f"{name:28s} {(run.get('skipped') or run.get('error', '?'))[-200:]}")
            continue
        u, f, p = run["update"], run.get("log_prob", {}), plan.get(name, {})
        lines.append(
            f"{name:28s} {u['median_s']:8.3f} {u['tokens_per_s']:8.0f} {u['mfu']:6.3f} {u['peak_allocated_gib']!s:>8s} "
            f"{p.get('update_ratio')!s:>6s} | {f.get('tokens_per_s', 0):14.0f} {f.get('mfu', 0):6.3f}"
        )
        prof = run.get("profile")
        if prof:
            cats = ", ".join(f"{k} {v['ms']:.0f} ms" for k, v in list(prof["categories"].items())[:8])
            lines.append(f"  profile: GPU busy {prof['gpu_busy']}, kernels {prof['kernel_ms']} ms: {cats}")
    lines.append(f"padded rows, mask-free vs mask: {results.get('padded_log_probs')}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
