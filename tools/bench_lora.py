"""LoRA vs full fine-tuning: step time on the quickstart task and memory of the actor + reference.

    .venv/bin/python tools/bench_lora.py [--steps 40] [--rounds 1] [--hidden 1024] [--layers 8]
                                         [--no-steps] [--no-memory]

Two measurements, printed as one JSON object:

- ``steps``: the CPU quickstart (``configs/quickstart_cpu.yaml``, full fine-tuning at lr 1e-4)
  and its LoRA variant (``configs/quickstart_lora_cpu.yaml``: rank-16 adapters on every
  projection, lr 1e-3), with the adapters served by vLLM (``lora``) and merged into its weights
  (``lora_merged``), run side by side through the real stack, alternating ``--rounds`` times:
  median seconds per step after ``--warmup`` steps, the median of each phase
  (generation, old and reference log-probs, update, sync), and validation reward before/after.
- ``memory``: what one rank holds for the actor and its reference with a larger random Llama
  (``--hidden`` x ``--layers``, fp32), built as the actor worker builds them: full fine-tuning =
  the trained actor (weights, DDP gradient buffers, Adam state) plus a frozen reference copy;
  LoRA = the frozen base with rank-16 adapters (their gradients and Adam state) and no second
  copy (the reference is the base with adapters off). Tensor bytes by kind, counted from the
  tensors after one training step and one reference pass, and the process's peak RSS growth
  over the same span (each variant in a fresh process).

Boundaries: a measurement tool; the step runs start the training CLI in subprocesses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from bench_step import MODEL, _project  # noqa: E402

RUNS = {  # name: (config, overrides)
    "full": ("quickstart_cpu", []),
    "lora": ("quickstart_lora_cpu", []),
    "lora_merged": ("quickstart_lora_cpu", ["actor_rollout_ref.rollout.lora_sync=merged"]),
}
PHASES = (
    "timing_s/gen",
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/update_actor",
    "timing_s/sync_weights",
)


def _steps(steps: int, rounds: int, warmup: int, out: Path) -> dict:
    import subprocess

    if not MODEL.exists():
        subprocess.run([sys.executable, str(ROOT / "tools/make_tiny_model.py")], cwd=ROOT, check=True)
    results: dict[str, list[dict]] = {name: [] for name in RUNS}
    for r in range(rounds):
        for name, (config, overrides) in RUNS.items():
            results[name].append(_project(f"{name}_{r}", steps, overrides, out, config=config))
    summary = {}
    for name, runs in results.items():
        per_step = [s for run in runs for s in run["s_per_step"][warmup:]]
        phases = {
            p.removeprefix("timing_s/"): round(statistics.median(v), 3)
            for p in PHASES
            if (v := [x for run in runs for x in run["phases"].get(p, [])][warmup:])
        }
        summary[name] = {
            "s_per_step": round(statistics.median(per_step), 3),
            "phases_s": phases,
            "val_before": runs[0]["val_before"],
            "val_after": [run["val_after"] for run in runs],
            "wall_s": [run["wall_s"] for run in runs],
        }
    for name in ("lora", "lora_merged"):
        summary[f"{name}_vs_full_speed"] = round(
            summary["full"]["s_per_step"] / summary[name]["s_per_step"], 2
        )
    return summary


def _memory_rank(rank, world, model_dir, lora_rank):
    import resource

    import torch

    from rlhf_megatron.config.schema import MegatronConfig, OptimConfig
    from rlhf_megatron.config.schema_model import LoraConfig
    from rlhf_megatron.data.batch import Batch
    from rlhf_megatron.models.builder import ParallelConfig
    from rlhf_megatron.models.loader import unwrap_model
    from rlhf_megatron.models.lora import adapters_disabled
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import init_model_parallel
    from rlhf_megatron.workers.megatron_engine import MegatronEngine, split_micro_batches

    init_model_parallel(1, 1, seed=1)
    arch = ModelArch.from_hf_dir(model_dir)
    megatron = MegatronConfig(params_dtype="float32")
    lora = LoraConfig(rank=lora_rank, alpha=2 * lora_rank, target_modules="all-linear") if lora_rank else None
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    actor = MegatronEngine(
        arch, ParallelConfig(), model_dir, megatron, OptimConfig(lr=1e-4), total_steps=10, lora=lora
    )
    ref = None if lora else MegatronEngine(arch, ParallelConfig(), model_dir, megatron)
    ids = torch.randint(3, arch.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    batch = Batch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(64).expand(4, -1),
        }
    )
    keys = ("input_ids", "attention_mask", "position_ids")
    actor.train_step(
        split_micro_batches(batch, keys, 2), lambda out, m: (out.float().pow(2).mean() * m["_weight"], {})
    )
    with torch.no_grad(), adapters_disabled(actor.chunks) if lora else _nothing():
        (ref or actor).run(
            split_micro_batches(batch, keys, 2), lambda out, m: (out.float().mean(), {}), forward_only=True
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def nbytes(tensors) -> int:
        seen, total = set(), 0
        for t in tensors:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total

    params = [p for c in actor.chunks for p in unwrap_model(c).parameters()]
    state = [v for opt in actor._sub_optimizers() for s in opt.optimizer.state.values() for v in s.values()]
    gib = 2**30
    return {
        "weights_gib": round(nbytes(params) / gib, 3),
        "reference_copy_gib": round(
            nbytes(p for c in ref.chunks for p in unwrap_model(c).parameters()) / gib, 3
        )
        if ref
        else 0.0,
        "grad_buffers_gib": round(
            sum(b.grad_data.numel() * b.grad_data.element_size() for b in actor._buffers()) / gib, 3
        ),
        "optimizer_state_gib": round(nbytes(v for v in state if torch.is_tensor(v)) / gib, 3),
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "peak_rss_growth_gib": round((peak - start) * 1024 / gib, 3),
    }


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _memory(hidden: int, layers: int, out: Path) -> dict:
    from rlhf_megatron.models.tiny import make_tiny_hf_model
    from rlhf_megatron.platform.multiproc import run_on_ranks

    model = make_tiny_hf_model(
        out / "model",
        "llama",
        num_layers=layers,
        hidden_size=hidden,
        num_heads=hidden // 64,
        num_kv_heads=hidden // 128,
        ffn_hidden_size=hidden * 4,
        max_position_embeddings=256,
    )
    result = {"model": {"hidden": hidden, "layers": layers}}
    for name, rank in (("full", 0), ("lora", 16)):
        ((row,),) = [run_on_ranks(_memory_rank, 1, str(model), rank, timeout_s=900)]
        result[name] = row
    total = {
        n: sum(result[n][k] for k in result[n] if k.endswith("_gib") and k != "peak_rss_growth_gib")
        for n in ("full", "lora")
    }
    result["tensor_gib"] = {n: round(v, 3) for n, v in total.items()}
    result["saved_by_ref_as_base_gib"] = result["full"]["reference_copy_gib"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--no-steps", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args(argv)
    report: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if not args.no_memory:
            report["memory"] = _memory(args.hidden, args.layers, out)
        if not args.no_steps:
            report["steps"] = _steps(args.steps, args.rounds, args.warmup, out)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
