"""Benchmark one actor → vLLM weight sync on CPU: seconds by phase, peak extra memory, memcpy floor.

Issue #7 (sync memory and speed). Builds a random Llama-style HF checkpoint
(~500M parameters by default: hidden 1536, 18 layers, 12 query / 4 KV heads,
FFN 3584, vocabulary 32000, untied head), then for every ``--tp`` runs that
many gloo ranks, each holding a Megatron actor (TP = ``--tp``, PP = 1) and an
in-process vLLM engine at the same TP (``external_launcher``), and measures
one sync per ``--load-format`` (after ``--warmup`` unmeasured ones):

- ``plan_s``: ``build_sync_plan``; ``gather_s`` / ``broadcast_s`` /
  ``convert_s``: ``WeightSyncer.stats``; ``generator_s``: all time spent
  inside the syncer's generator (those phases plus Python overhead);
  ``load_s``: the rest of ``update_weights``: with ``hf``, vLLM's
  ``reload_weights`` (its loader, layer re-materialisation and CPU
  repacking); with ``sharded``, ``refit_cpu_in_place`` (copies into the live
  parameters, then the CPU GEMM repacking); ``total_s``.
- ``peak_extra_bytes``: resident memory above the pre-sync baseline,
  sampled by a background thread every ``--sample-ms`` (``peak_after_tensor``
  names the last tensor handed to vLLM when it peaked); next to it the
  syncer's ``peak_bucket_bytes`` and the plan's largest tensor, and
  ``retained_bytes``, what is still resident after the sync. glibc keeps
  freed blocks (up to 32 MiB each) resident for reuse, so by default RSS
  over-counts; ``--mmap-threshold-mb 1`` makes RSS follow the live tensors
  (at some speed cost: every large allocation faults its pages in afresh).
- ``floor_s``: one read plus one write of the model's bytes at the memcpy
  bandwidth measured in the same processes just before the sync (all ranks
  copying at once, so TP=2 shares the memory bus as the sync does);
  ``total_over_floor`` is the target metric (≤ 2 at TP=1).
  ``first_touch_gb_per_s`` is the speed of writing into freshly allocated
  pages, which every step that allocates (vLLM re-materialising a layer, a
  gather's output) pays instead of the memcpy bandwidth.

Dtype: ``--dtype`` is the dtype of the HF checkpoint and of the Megatron
actor, hence of the streamed tensors and of the floor's bytes. vLLM on CPU
always runs float32 here (``VLLMEngine`` forces it), so ``bfloat16`` adds a
cast inside vLLM's loader; float32 (the default) keeps every side the same.

Per-rank numbers come back under ``ranks``; the summary takes the slowest
rank's times and the largest rank's memory. Prints ONE JSON object.

``--moe`` benchmarks a random Qwen3-MoE instead (~500M parameters by default:
the dense model's attention, layers and vocabulary, every layer sparse with
28 experts of FFN 128, top-4, so the experts hold as many parameters as the
dense FFN), once per ``--ep``: EP ranks (actor TP 1, each rank holding
``experts / EP`` experts; vLLM at TP = EP, every rank holding a TP slice of
every expert, as vLLM's own expert parallelism is off). Each run reports the
dense run's fields plus ``ep``; at actor TP 1 nothing is gathered, so
``gather_s`` is the experts' broadcast over the EP group (the syncer counts
it with the gathers; ``broadcast_s`` is the pipeline's). Next to it,
``dense_same_bytes``: a dense Llama of the same layers, hidden size, heads and
vocabulary whose FFN width gives it the MoE's parameter count, synced on the
same ranks the same way (actor TP 1, data-parallel over the EP ranks, vLLM at
TP = EP), and per MoE run ``dense_total_s`` and ``ratio_to_dense`` (MoE
``total_s`` / dense ``total_s``), which isolates what the experts cost: many
small tensors, the EP broadcast, and vLLM's fused-expert loading. vLLM's
CPU MoE kernel pads each rank's expert width (``--expert-ffn / EP``) to a
multiple of 32, and its reload (``--load-format hf``) then fails on the
padded experts, so ``hf`` runs need that width to be a multiple of 32.

    .venv/bin/python tools/bench_weight_sync.py --tp 1 2
    .venv/bin/python tools/bench_weight_sync.py --tp 1 2 --load-format hf sharded
    .venv/bin/python tools/bench_weight_sync.py --tp 1 --layers 4 --profile 25   # small + cProfile of rank 0
    .venv/bin/python tools/bench_weight_sync.py --moe                    # Qwen3-MoE at EP 1 and 2, vs dense
    .venv/bin/python tools/bench_weight_sync.py --moe --ep 2 --load-format hf sharded

Boundaries: the driver (flags, the runs, the per-rank body, the JSON); the checkpoints, the
rank's actor and engine and the measuring are the library's (``tools/weight_sync_bench/``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# tests/weights/test_sync_memory.py loads this script and reaches set_malloc_mmap_threshold,
# build_actor_and_engine, make_syncer, measure_sync, write_random_checkpoint and numel through it.
from weight_sync_bench.checkpoints import (  # noqa: E402
    DTYPES,
    dense_ffn_for_params,
    model_summary,
    write_random_checkpoint,
    write_random_moe_checkpoint,
)
from weight_sync_bench.checkpoints import numel as numel  # noqa: E402  (re-exported, see above)
from weight_sync_bench.engines import build_actor_and_engine, make_syncer  # noqa: E402
from weight_sync_bench.measuring import (  # noqa: E402
    copy_bandwidth,
    first_touch_bandwidth,
    measure_sync,
    set_malloc_mmap_threshold,
)

VLLM_CPU_MOE_ALIGNMENT = 32
"""vLLM 0.32's CPU MoE kernels pad each rank's expert width to a multiple of this (``cpu_moe.py``)."""
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


# -- one rank ----------------------------------------------------------------------------------------


def bench_rank(
    rank,
    world_size,
    hf_dir,
    tp,
    ep,
    dtype,
    load_format,
    bucket_bytes,
    warmup,
    sample_s,
    profile,
    threads,
    mmap_threshold,
) -> dict:
    """Per-rank body (``run_on_ranks``): build, warm up, measure the bandwidth, measure one sync."""
    import torch

    if mmap_threshold:
        set_malloc_mmap_threshold(mmap_threshold)

    # vLLM logs to stdout; keep the parent's stdout for the one JSON object.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    # torch is imported before run_on_ranks applies OMP_NUM_THREADS, and vLLM's CPU worker
    # disables set_num_threads once it is up: set the thread count here, first.
    torch.set_num_threads(threads)
    arch, chunks, info, groups, engine = build_actor_and_engine(hf_dir, tp, dtype, load_format, ep=ep)
    try:
        syncer, plan_s = make_syncer(arch, chunks, info, groups, world_size, load_format, bucket_bytes)
        warm_s = []
        for _ in range(warmup):
            t0 = time.perf_counter()
            engine.update_weights(syncer.iter_weights())
            warm_s.append(time.perf_counter() - t0)
        barrier = torch.distributed.barrier if world_size > 1 else None
        bandwidth = copy_bandwidth(barrier=barrier)
        first_touch = first_touch_bandwidth(barrier=barrier)
        gc.collect()
        if barrier:
            barrier()  # start the measured sync together: the gathers would make the first rank wait anyway
        sync = measure_sync(engine, syncer, sample_s, profile if rank == 0 else 0)
        plan = syncer.plan
        largest = max(t.nbytes(syncer.dtype.itemsize) for t in plan.transfers)
        return {
            "rank": rank,
            "plan_s": plan_s,
            "warmup_total_s": warm_s,
            "copy_bandwidth_bytes_per_s": bandwidth,
            "first_touch_bytes_per_s": first_touch,
            "torch_threads": torch.get_num_threads(),
            "vllm_dtype": str(engine.llm.llm_engine.model_config.dtype).removeprefix("torch."),
            "buckets": len(plan.buckets),
            "largest_tensor_bytes": largest,
            **sync,
        }
    finally:
        engine.shutdown()


# -- the driver --------------------------------------------------------------------------------------


def run_tp(
    tp: int, load_format: str, hf_dir: str, args, model_bytes: int, ep: int = 1, world: int | None = None
) -> dict:
    """One measured sync on ``world`` ranks (default ``tp``; actor TP ``tp`` and EP ``ep``, the rest
    data-parallel; vLLM at TP ``world``), summarised: the slowest rank's seconds, the largest rank's memory."""
    from rlhf_megatron.platform.multiproc import run_on_ranks

    world = world or tp
    # Two cores: one process gets both, two processes get one each.
    threads = max(1, (os.cpu_count() or 1) // world)
    env = {**ENV, "OMP_NUM_THREADS": str(threads)}
    ranks = run_on_ranks(
        bench_rank,
        world,
        hf_dir,
        tp,
        ep,
        args.dtype,
        load_format,
        args.bucket_mb * 2**20,
        args.warmup,
        args.sample_ms / 1000,
        args.profile,
        threads,
        int(args.mmap_threshold_mb * 2**20),
        env=env,
        timeout_s=args.timeout_s,
    )
    profile = ranks[0].pop("profile", None)
    if profile:
        layout = f"TP={tp}" + (f", EP={ep}" if ep > 1 else "")
        print(f"--- cProfile, {layout}, {load_format}, rank 0, measured sync ---\n{profile}", file=sys.stderr)
    slowest = max(ranks, key=lambda r: r["total_s"])
    # All ranks copy at once, so the machine's bandwidth is their sum.
    bandwidth = sum(r["copy_bandwidth_bytes_per_s"] for r in ranks)
    floor_s = 2 * model_bytes / bandwidth
    keys = ("plan_s", "gather_s", "broadcast_s", "convert_s", "generator_s", "load_s", "total_s")
    return {
        "tp": tp,
        "ep": ep,
        "world_size": world,
        "load_format": load_format,
        "seconds": {k: round(slowest[k], 4) for k in keys},
        "floor_s": round(floor_s, 4),
        "total_over_floor": round(slowest["total_s"] / floor_s, 2),
        "copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 2),
        "first_touch_gb_per_s": round(sum(r["first_touch_bytes_per_s"] for r in ranks) / 1e9, 2),
        "peak_extra_bytes": max(r["peak_extra_bytes"] for r in ranks),
        "peak_bucket_bytes": max(r["peak_bucket_bytes"] for r in ranks),
        "largest_tensor_bytes": slowest["largest_tensor_bytes"],
        "buckets": slowest["buckets"],
        "warmup_total_s": [round(s, 3) for s in slowest["warmup_total_s"]],
        "torch_threads_per_rank": slowest["torch_threads"],
        "vllm_dtype": slowest["vllm_dtype"],
        "ranks": ranks,
    }


def _build(model_dir: Path, write) -> float:
    """Seconds to write a checkpoint into ``model_dir`` with ``write`` (0 when one is already there)."""
    t0 = time.perf_counter()
    if not (model_dir / "config.json").exists():
        write(model_dir)
    return time.perf_counter() - t0


def run_dense(args, model_dir: Path) -> dict:
    """The dense benchmark: one Llama, one run per ``--tp`` and ``--load-format``."""
    build_s = _build(
        model_dir,
        lambda d: write_random_checkpoint(
            d,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            ffn=args.ffn,
            vocab=args.vocab,
            dtype=args.dtype,
        ),
    )
    model = model_summary(model_dir, args.dtype, build_s)
    runs = [
        run_tp(tp, fmt, str(model_dir), args, model["bytes"]) for tp in args.tp for fmt in args.load_format
    ]
    return {"model": model, "runs": runs}


def run_moe(args, model_dir: Path) -> dict:
    """The ``--moe`` benchmark: a Qwen3-MoE at every ``--ep`` (actor TP 1, one rank per EP rank, vLLM at
    TP = EP), and a dense Llama of about the same bytes on the same ranks (actor TP 1, DP = EP).

    Both models share layers, hidden size, heads and vocabulary; the dense one's FFN width
    is chosen so that its parameters match the MoE's (``dense_ffn_for_params``). Each MoE
    run gets ``dense_total_s`` (the dense run of the same ranks and load format) and
    ``ratio_to_dense`` = MoE ``total_s`` / dense ``total_s``.
    """
    for ep in args.ep:
        if args.experts % ep:
            raise SystemExit(f"--ep {ep} does not divide --experts {args.experts}")
        if args.expert_ffn % ep:
            raise SystemExit(
                f"--ep {ep} puts vLLM at TP {ep}, which does not divide --expert-ffn {args.expert_ffn} "
                "(vLLM splits every expert over its TP ranks)"
            )
        width = args.expert_ffn // ep
        if "hf" in args.load_format and width % VLLM_CPU_MOE_ALIGNMENT:
            raise SystemExit(
                f"--ep {ep}: each vLLM rank holds experts {width} wide, which vLLM's CPU MoE kernel pads to a "
                f"multiple of {VLLM_CPU_MOE_ALIGNMENT}; its reload (--load-format hf) then fails on the padded "
                f"experts. Pick --expert-ffn so that --expert-ffn / EP is a multiple of {VLLM_CPU_MOE_ALIGNMENT}, "
                "or use --load-format sharded"
            )
    moe_dir, dense_dir = model_dir / "moe", model_dir / "dense_same_bytes"
    sizes = dict(
        layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab
    )
    build_s = _build(
        moe_dir,
        lambda d: write_random_moe_checkpoint(
            d, experts=args.experts, top_k=args.top_k, expert_ffn=args.expert_ffn, dtype=args.dtype, **sizes
        ),
    )
    moe = model_summary(moe_dir, args.dtype, build_s)
    ffn = dense_ffn_for_params(moe["params"], **sizes)
    build_s = _build(dense_dir, lambda d: write_random_checkpoint(d, ffn=ffn, dtype=args.dtype, **sizes))
    dense = model_summary(dense_dir, args.dtype, build_s)
    if dense["ffn"] != ffn:
        raise SystemExit(
            f"{dense_dir} holds a dense model of FFN {dense['ffn']}, not {ffn}: remove it or pick "
            "another --model-dir"
        )
    runs, dense_runs = [], []
    for ep in args.ep:
        for fmt in args.load_format:
            run = run_tp(1, fmt, str(moe_dir), args, moe["bytes"], ep=ep, world=ep)
            # The same ranks and layout without experts: actor TP 1 (DP = EP), vLLM at TP = EP.
            base = run_tp(1, fmt, str(dense_dir), args, dense["bytes"], world=ep)
            run["dense_total_s"] = base["seconds"]["total_s"]
            run["ratio_to_dense"] = round(run["seconds"]["total_s"] / base["seconds"]["total_s"], 3)
            runs.append(run)
            dense_runs.append(base)
    return {"model": moe, "runs": runs, "dense_same_bytes": {"model": dense, "runs": dense_runs}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tp",
        type=int,
        nargs="+",
        default=None,
        help="TP sizes to run (training TP = rollout TP; default 1 2)",
    )
    p.add_argument(
        "--load-format", nargs="+", choices=("hf", "sharded"), default=["hf"], help="one run per format"
    )
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--heads", type=int, default=12, help="query heads (head_dim = hidden / heads)")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=3584, help="the dense model's FFN width (not used with --moe)")
    p.add_argument("--vocab", type=int, default=32000)
    moe = p.add_argument_group("mixture of experts")
    moe.add_argument(
        "--moe",
        action="store_true",
        help="benchmark a Qwen3-MoE at every --ep instead, next to a dense model of the same bytes",
    )
    moe.add_argument(
        "--ep",
        type=int,
        nargs="+",
        default=None,
        help="with --moe: EP sizes to run (one rank per EP rank, actor TP 1, vLLM at TP = EP; default 1 2)",
    )
    moe.add_argument("--experts", type=int, default=28, help="routed experts per layer (every layer sparse)")
    moe.add_argument("--top-k", type=int, default=4, help="experts per token")
    moe.add_argument(
        "--expert-ffn", type=int, default=128, help="one expert's FFN width (/ EP: a multiple of 32 for hf)"
    )
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="checkpoint and actor dtype")
    p.add_argument("--bucket-mb", type=int, default=512, help="update_weights_bucket_megabytes")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured syncs before the measured one")
    p.add_argument("--sample-ms", type=float, default=2.0, help="RSS polling interval")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="cProfile rank 0's measured sync; print the top N functions by own time to stderr",
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="reuse (or create and keep) the checkpoint here (with --moe: its moe/ and dense_same_bytes/); "
        "default: a temporary directory",
    )
    p.add_argument(
        "--mmap-threshold-mb",
        type=float,
        default=0,
        help="fixed glibc mmap threshold in the ranks (e.g. 1) so RSS follows live tensors; "
        "0 keeps glibc's default, which retains freed memory (faster, but RSS over-counts)",
    )
    p.add_argument("--timeout-s", type=float, default=600)
    args = p.parse_args(argv)
    if args.moe:
        if args.tp is not None:
            p.error("--tp is for the dense run; with --moe the actor runs at TP 1 and --ep sets the ranks")
        args.ep = args.ep or [1, 2]
    else:
        if args.ep is not None:
            p.error("--ep needs --moe")
        args.tp = args.tp or [1, 2]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    tmp = None
    if args.model_dir is None:
        tmp = tempfile.mkdtemp(prefix="bench_weight_sync_")
        model_dir = Path(tmp)
    else:
        model_dir = Path(args.model_dir)
    try:
        measured = run_moe(args, model_dir) if args.moe else run_dense(args, model_dir)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "model": measured.pop("model"),
        "bucket_bytes": args.bucket_mb * 2**20,
        "malloc": f"mmap_threshold={args.mmap_threshold_mb}MiB"
        if args.mmap_threshold_mb
        else "glibc default",
        "cpus": os.cpu_count(),
        **measured,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
