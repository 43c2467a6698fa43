"""Where a training step's time goes, per phase and per process, with a sampling profiler.

    .venv/bin/python tools/profile_step.py [--config quickstart_cpu] [--steps 30] [--warmup 8] [overrides...]

Runs the training CLI for ``--steps`` steps and, once ``--warmup`` steps are logged, attaches
``py-spy`` (``pip install py-spy``; it reads other processes' stacks, so it needs ptrace
rights: root, or ``kernel.yama.ptrace_scope=0``) to the driver and to every Ray worker for
``--seconds``. Samples of busy threads only are kept (py-spy drops idle ones). Each sample is
attributed to

- the phase it belongs to: the worker method on its stack (``generate_sequences``,
  ``compute_log_prob``, ``update_actor``, ...), or the driver's ``PPOTrainer`` method;
- a category: walking from the innermost frame out, the first frame that matches one of
  ``CATEGORIES`` (gloo collectives, Ray (de)serialization, attention, MLP, the backward pass,
  log-prob/entropy over the vocabulary, the optimizer, vLLM, ...); a sample whose innermost
  frame is the CPU-compat wrappers' own Python (any line but the one calling the wrapped
  torch function) counts as that layer's overhead;

and the JSON printed gives, per process, the share of samples per phase and per category,
next to the driver's own per-phase timings (``timing_s/*`` medians after warm-up). A
category's share is of that process's busy samples; "other" is everything unmatched.

Boundaries: a measurement tool; starts the CLI in a subprocess and py-spy beside it.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from train_runs import train_command  # noqa: E402

PHASES = (
    "generate_sequences",
    "compute_log_prob",
    "compute_ref_log_prob",
    "compute_values",
    "update_actor",
    "update_critic",
    "sync_weights",
    "compute_rm_score",
    "save_checkpoint",
)
# (category, pattern on a frame "function (file:line)"); the first match walking from the leaf wins.
CATEGORIES = (
    ("vllm (generation)", re.compile(r"\bvllm/")),
    (
        "gloo collectives",
        re.compile(r"(all_reduce|all_gather|broadcast|barrier|reduce_scatter|all_to_all)\b"),
    ),
    ("ray (de)serialization", re.compile(r"(serializ|pickle|cloudpickle)")),
    ("batch split/concat", re.compile(r"rlhf_megatron/data/batch\.py")),
    ("shared-prompt packing", re.compile(r"rlhf_megatron/data/packing\.py")),
    ("vocab log-prob / entropy", re.compile(r"(vocab_parallel_|_shifted_softmax_stats|_VocabParallel)")),
    ("backward (autograd)", re.compile(r"(_engine_run_backward|torch/autograd/__init__\.py)")),
    ("attention", re.compile(r"(DotProductAttention|core_attention|scaled_dot_product|Attention\.forward)")),
    ("mlp", re.compile(r"MLP\.forward")),
    ("embedding", re.compile(r"LanguageModelEmbedding")),
    ("output layer", re.compile(r"(_postprocess|output_layer)")),
    ("optimizer + grad clip", re.compile(r"(optimizer\.py|clip_grads|_multi_tensor|adam)")),
    (
        "grad buffers / DDP",
        re.compile(r"(distributed_data_parallel|param_and_grad_buffer|finalize_model_grads)"),
    ),
    ("weight sync (plan/convert)", re.compile(r"rlhf_megatron/weights/")),
    ("rollout assembly", re.compile(r"rlhf_megatron/rollout/")),
    ("reward scoring", re.compile(r"rlhf_megatron/rewards/")),
    ("megatron schedule (other)", re.compile(r"pipeline_parallel/schedules\.py")),
    ("ray worker loop", re.compile(r"\bray/")),
)


def _stacks(path: Path) -> list[tuple[list[str], int]]:
    """py-spy raw (collapsed) output: ``frame;frame;...;leaf count`` per line, root first."""
    out = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            out.append((stack.split(";"), int(count)))
    return out


def _phase(frames: list[str], driver: bool) -> str:
    """The innermost phase on the stack (a colocated generation runs its batch's log-prob passes,
    and a stale rollout its weight sync, inside ``generate_sequences``)."""
    names = [frame.split(" (")[0] for frame in frames]
    if driver:
        inner = [name for name in names if name.startswith("PPOTrainer.")]
        return inner[-1] if inner else "other"
    methods = [name.rsplit(".", 1)[-1] for name in names]
    return next((m for m in reversed(methods) if m in PHASES), "other")


def _compat_call_lines() -> set[int]:
    """The lines of the CPU-compat wrappers that call the wrapped torch function itself."""
    from rlhf_megatron.platform import cpu_compat

    lines = Path(cpu_compat.__file__).read_text().splitlines()
    return {i + 1 for i, line in enumerate(lines) if re.search(r"return (fn|_ORIGINALS\[.*\])\(", line)}


_COMPAT_LEAF = re.compile(r"\(.*cpu_compat\.py:(\d+)\)")


def _category(frames: list[str], call_lines: set[int]) -> str:
    # py-spy charges time inside a C op to the Python line that called it; a leaf in the CPU-compat
    # wrappers on any other line than the call is their own Python (the per-call overhead).
    leaf = _COMPAT_LEAF.search(frames[-1]) if frames else None
    if leaf and int(leaf.group(1)) not in call_lines:
        return "cpu-compat wrappers (own Python)"
    for frame in reversed(frames):
        for name, pattern in CATEGORIES:
            if pattern.search(frame):
                return name
    return "other"


def summarize(path: Path, driver: bool) -> dict:
    stacks = _stacks(path)
    total = sum(n for _, n in stacks) or 1
    phases: collections.Counter = collections.Counter()
    categories: collections.Counter = collections.Counter()
    by_phase: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    call_lines = _compat_call_lines()
    for frames, n in stacks:
        phase, category = _phase(frames, driver), _category(frames, call_lines)
        phases[phase] += n
        categories[category] += n
        by_phase[phase][category] += n
    share = lambda c: {k: round(v / total, 3) for k, v in c.most_common()}  # noqa: E731
    return {
        "busy_samples": total,
        "phases": share(phases),
        "categories": share(categories),
        "categories_by_phase": {
            p: {k: round(v / sum(c.values()), 3) for k, v in c.most_common(5)} for p, c in by_phase.items()
        },
    }


def _worker_pids() -> dict[str, list[int]]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    pids: dict[str, list[int]] = collections.defaultdict(list)
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        match = re.match(r"ray::(\w+Worker)", args)
        if match:
            pids[match.group(1)].append(int(pid))
    return dict(pids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="quickstart_cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=8, help="steps before sampling starts")
    parser.add_argument("--seconds", type=int, default=15, help="how long to sample")
    parser.add_argument("--rate", type=int, default=200, help="samples per second per process")
    parser.add_argument("--raw-dir", type=Path, help="keep py-spy's raw stacks (one file per process) here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise SystemExit("profile_step: py-spy is not installed (pip install py-spy)")
    with tempfile.TemporaryDirectory(prefix="profile_step_") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = train_command(args.config, run_dir, args.steps, args.overrides)
        driver = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        metrics = run_dir / "metrics.jsonl"
        while driver.poll() is None and (
            not metrics.exists() or len(metrics.read_text().splitlines()) < args.warmup
        ):
            time.sleep(0.5)
        if driver.poll() is not None:
            raise SystemExit(
                f"profile_step: the run ended before the warm-up:\n{driver.stderr.read()[-3000:]}"
            )
        targets = {"driver": [driver.pid], **_worker_pids()}
        spies = []
        for role, pids in targets.items():
            for i, pid in enumerate(pids):
                out = Path(tmp) / f"{role}_{i}.txt"
                spies.append(
                    (
                        f"{role}[{i}]",
                        role == "driver",
                        out,
                        subprocess.Popen(
                            [
                                spy,
                                "record",
                                "-p",
                                str(pid),
                                "-d",
                                str(args.seconds),
                                "-r",
                                str(args.rate),
                                "-f",
                                "raw",
                                "-o",
                                str(out),
                                "--nonblocking",
                            ],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        ),
                    )
                )
        for *_, proc in spies:
            proc.wait()
        if args.raw_dir:
            args.raw_dir.mkdir(parents=True, exist_ok=True)
            for _, _, out, _ in spies:
                if out.exists():
                    shutil.copy(out, args.raw_dir / out.name)
        driver.wait()
        if driver.returncode:
            raise SystemExit(f"profile_step: the run failed:\n{driver.stderr.read()[-3000:]}")
        records = [json.loads(line) for line in metrics.read_text().splitlines()][args.warmup :]
        timings = sorted({k for r in records for k in r if k.startswith("timing_s/")})
        result = {
            "config": args.config,
            "overrides": args.overrides,
            "steps_timed": len(records),
            "driver_timing_s_median": {
                k.removeprefix("timing_s/"): round(statistics.median(r[k] for r in records if k in r), 4)
                for k in timings
            },
            "processes": {
                name: summarize(out, is_driver) for name, is_driver, out, _ in spies if out.exists()
            },
        }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
