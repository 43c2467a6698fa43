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
  recompute (mask-free against the mask), a Llama-3.2-3B-shaped model, left/right-padded
  rows (mask-free rolled rows against the mask: same log-probs?), and DeepSeek-V3's layers at
  a small size (``deepseek-v3-small``: multi-latent attention, shared-expert MoE) with the local
  attention and with sdpa. The first run (its JSON keeps
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

Boundaries: the variants, the SDPA cases, the kernel profile and their report; how a step is
measured (timers, sections, the engine's step, the planner's side, the JSON file) is
``measure.py``'s, imported from beside this file.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import re
import sys
import tempfile
import time
import traceback
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
ROWS, MASK = {**AFTER, "causal_rows": 0}, {**AFTER, "causal_rows": None}  # mask-free rows always / never
LONG16, LONG32 = (1024, 15360, 2, 1), (1024, 31744, 2, 1)
LONG = dict(recompute="full", log_prob=False)  # long rows: full recompute, no log-prob pass
MLA_MOE = "deepseek-v3-small"
VARIANTS = [
    dict(name="base", profile=True),
    dict(name="after", **AFTER, profile=True),
    dict(name="after_rows", **ROWS),
    dict(name="after_m4", **AFTER, shape=(1024, 1024, 16, 4)),
    dict(name="after_m8", **AFTER, shape=(1024, 1024, 16, 8), profile=True),
    dict(name="after_m4_rows", **ROWS, shape=(1024, 1024, 16, 4)),
    dict(name="after_selective", **AFTER, recompute="selective"),
    dict(name="after_full", **AFTER, recompute="full"),
    dict(name="after_4k", **AFTER, shape=(1024, 3072, 8, 1)),
    dict(name="after_16k_full", **AFTER, **LONG, shape=LONG16),
    dict(name="after_16k_full_mask", **MASK, **LONG, shape=LONG16),
    dict(name="after_32k_full", **AFTER, **LONG, shape=LONG32),
    dict(name="after_32k_full_mask", **MASK, **LONG, shape=LONG32),
    dict(name="base_3b", model="llama-3b"),
    dict(name="after_3b", model="llama-3b", **AFTER),
    dict(name="after_3b_m4", model="llama-3b", **AFTER, shape=(1024, 1024, 16, 4)),
    dict(name="after_padded", **AFTER, padded=True),
    dict(name="after_padded_rows", **ROWS, padded=True),
    # DeepSeek-V3's multi-latent attention and shared-expert MoE layers (issue #54, item 4): the
    # unfused local attention, then torch's sdpa (MLA's 192-wide queries/keys, 128-wide values).
    dict(name="mla_moe_local", model=MLA_MOE),
    dict(name="mla_moe", model=MLA_MOE, **AFTER, profile=True),
    dict(name="mla_moe_m4", model=MLA_MOE, **AFTER, shape=(1024, 1024, 16, 4)),
]
TINY = {MLA_MOE: "tiny-deepseek-v3"}
"""``--tiny``: each model's CPU stand-in (``tiny`` for the Llama shapes)."""


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
                ms = measure.event_median(fn, repeats)
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
                    ms = measure.event_median(fn, max(3, repeats // 2))
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
    return [
        f"actor_rollout_ref.actor.megatron.attention_backend={v['attention']}",
        *measure.recompute_overrides(v["recompute"]),
    ]


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
    cuda = args.cuda
    a = variant_args(args, v)
    section_cfg, arch = measure.engine_inputs(a, model_dir, variant_overrides(v))
    deterministic = args.default_deterministic if v["deterministic"] is None else v["deterministic"]
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    out: dict = {
        "variant": {k: v[k] for k in v},
        "overrides": variant_overrides(v),
        "deterministic": deterministic,
    }
    engine, built = build_variant_engine(v, section_cfg, arch, model_dir, cuda)
    out.update(built)
    make = padded_batch if v["padded"] else measure.synthetic_batch
    step = measure.actor_step(a, section_cfg, arch, make(a, arch.vocab_size, seed=0))
    captured: list = []

    def forward_loss(output, micro):
        result = step.log_prob_fn(output, micro)
        if not captured:  # the first micro-batch's log-probs, for comparing variants
            captured.append(result)
        return output.new_zeros(()), {}

    def update():
        return engine.train_step(step.update_micros, step.policy_loss, "stop", "[mfu]")

    with measure.Timer(cuda) as t:
        first = update()
    out["warmup_s"] = round(t.seconds, 2)
    out["warmup_update_ok"] = bool(first["update_ok"])
    stats = functools.partial(measure.phase_stats, step=step, peak_tflops=args.peak_tflops, six_n=False)
    seconds, peaks, results = measure.timed(update, args.steps, cuda)
    out["update"] = stats(seconds, peaks, passes=3)
    out["update"]["grad_norms"] = [round(r["grad_norm"], 5) for r in results]
    out["update"]["update_ok"] = all(r["update_ok"] for r in results)
    if v["log_prob"]:
        seconds, peaks, _ = measure.timed(
            lambda: engine.run(step.forward_micros, forward_loss, forward_only=True), args.steps, cuda
        )
        out["log_prob"] = stats(seconds, peaks, passes=1)
        if captured:
            out["first_log_probs"] = _log_prob_tensor(captured[0])
    if v["profile"]:
        host: dict = {}
        kernels, wall = profiled_kernels(update, cuda, host)
        out["profile"] = {**kernel_table(kernels, wall), "host": host}
    engine = first = results = None
    _free_megatron_buffers()
    measure.free_memory(cuda)
    return out


def build_variant_engine(v: dict, section_cfg, arch, model_dir: str, cuda: bool) -> tuple:
    """(the variant's engine: megatron's model builder with the variant's fused kernels, torch's
    fused AdamW when asked; the JSON fields of its build)."""
    import rlhf_megatron.workers.megatron_engine as engine_mod
    from rlhf_megatron.models.builder import build_gpt_model
    from rlhf_megatron.platform.fused_adam import fuse_torch_adam

    # The engine builds its chunks through this name: the variant's fused kernels go in here.
    engine_mod.build_gpt_model = functools.partial(
        build_gpt_model, causal_rows=v["causal_rows"], fuse_swiglu=v["swiglu"]
    )
    try:
        engine, build_s = measure.build_engine(section_cfg, arch, model_dir, cuda)
    finally:
        engine_mod.build_gpt_model = build_gpt_model
    built = {"build_s": round(build_s, 2)}
    if v["fused_adam"]:
        built["fused_adam_optimizers"] = fuse_torch_adam(engine.optimizer)
    return engine, built


def _log_prob_tensor(result):
    """The log-probs tensor in what the actor's log-prob function returned (a tuple or a dict)."""
    lp = result[0] if isinstance(result, tuple) else result
    if isinstance(lp, dict):
        lp = next(iter(lp.values()))
    return lp.detach().float().cpu() if torch.is_tensor(lp) else None


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
    out = {}
    for name, run in runs.items():
        if "update" not in run:
            continue
        v = {**BASE, **run["variant"]}
        model_dir = model_dirs[model_name(args, v)]
        _, actor = measure.actor_plan(variant_args(args, v), model_dir, run["overrides"])
        entry = {
            "update_planned_gib": measure.gib(actor.training_phase()),
            "log_prob_planned_gib": measure.gib(actor.forward_phase()),
        }
        measure.add_measured(
            entry, run, {"update": actor.training_phase(), "log_prob": actor.forward_phase()}
        )
        out[name] = entry
    return out


# ---------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    """The flags, plus the measurement's shape under ``measure.py``'s argument names."""
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
    args.cuda = torch.cuda.is_available()
    args.transformer_impl = "local"
    args.n = 8
    if args.tiny:
        args.model, args.prompt, args.response, args.mini_batch, args.micro = "tiny", 32, 32, 8, 2
    else:
        args.model, args.prompt, args.response, args.mini_batch, args.micro = "llama-1b", 1024, 1024, 16, 2
    if not args.replan and not args.cuda and not args.tiny:
        parser.error("no CUDA device here: run on the GPU machine, or pass --tiny")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    out_path = Path(args.out)
    if args.replan:
        return replan(out_path, args)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results = measure.new_results(args)

    def save():
        measure.write_json(out_path, results, default=_jsonable)

    def section(name, fn):
        with measure.section(results, name, tag="mfu"):
            results[name] = fn()
        save()

    section("env", lambda: measure.env_info(args.cuda))
    section("ceilings", lambda: measure.ceilings(args.cuda, repeats=10))
    if not args.skip_sdpa:
        section("sdpa", lambda: sdpa_kernels(args.cuda))

    from rlhf_megatron.platform import destroy_distributed

    measure.init_one_rank()
    args.default_deterministic = torch.are_deterministic_algorithms_enabled()
    results["env"]["deterministic_after_init"] = args.default_deterministic
    variants = [{**BASE, **v} for v in VARIANTS if args.only is None or v["name"] in args.only]
    with tempfile.TemporaryDirectory(prefix="mfu_model_") as tmp:
        model_dirs = run_variants(args, variants, Path(tmp), results, save, start)
        runs = results["variants"]
        section(
            "padded_log_probs", lambda: compare_log_probs(runs, "after_padded_rows", "after_padded", args)
        )
        section("planner", lambda: planner(args, model_dirs, runs))
    for run in results["variants"].values():
        run.pop("first_log_probs", None)
    destroy_distributed()
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    results["elapsed_s"] = round(time.perf_counter() - start, 1)
    save()
    print(summary(results), flush=True)
    return 0


def run_variants(args, variants: list[dict], tmp: Path, results: dict, save, start: float) -> dict[str, str]:
    """Each variant in turn into ``results["variants"]`` (``save()``-d after each; a failure is recorded
    and the rest still run), skipping those that start ``--budget-s`` after ``start``. Returns the
    checkpoints: model name -> directory under ``tmp``, each written when first needed."""
    longest = max(sum((v["shape"] or (args.prompt, args.response))[:2]) for v in variants)
    model_dirs: dict[str, str] = {}

    def model_dir_of(name: str) -> str:
        if name not in model_dirs:
            path = tmp / name
            results.setdefault("models", {})[name] = measure.write_model(
                path, measure.MODELS[name], args.cuda, max(8192, longest)
            )
            model_dirs[name] = str(path)
        return model_dirs[name]

    results["variants"] = {}
    for v in variants:
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            results["variants"][v["name"]] = {"skipped": f"budget: {elapsed:.0f} s > {args.budget_s:.0f} s"}
            continue
        t0 = time.perf_counter()
        try:
            results["variants"][v["name"]] = run_variant(args, model_dir_of(model_name(args, v)), v)
        except Exception:  # noqa: BLE001 (recorded)
            results["variants"][v["name"]] = {"variant": v, "error": traceback.format_exc()}
            print(f"[mfu] {v['name']} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            _free_megatron_buffers()
            measure.free_memory(args.cuda)
        print(
            f"[mfu] {v['name']}: {time.perf_counter() - t0:.1f} s {_line(results['variants'][v['name']])}",
            flush=True,
        )
        save()
    return model_dirs


def model_name(args, v: dict) -> str:
    """The ``measure.MODELS`` entry variant ``v`` runs on (its CPU stand-in under ``--tiny``)."""
    return TINY.get(v["model"], "tiny") if args.tiny else v["model"]


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
            measure.write_config(Path(dirs[name]), model["shape"], longest)
        results["planner"] = planner(args, dirs, results["variants"])
    results["planner"]["recomputed"] = time.strftime("%Y-%m-%d %H:%M:%S")
    measure.write_json(path, results, default=_jsonable)
    print(summary(results), flush=True)
    return 0


def _jsonable(x):
    if torch.is_tensor(x):
        return None  # captured log-probs: compared in the run, not stored
    return str(x)


def _line(run: dict) -> str:
    if "update" not in run:
        return (run.get("skipped") or run.get("error", "?"))[-300:]
    return f"update {measure.phase_line(run['update'])}"


def summary(results: dict) -> str:
    lines = ["", "== summary ==", measure.device_line(results), measure.ceilings_line(results)]
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
