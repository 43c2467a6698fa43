"""A tiny random Llama, the arith task, the shared reference run, and a helper that runs the real
`rlhf-megatron train` CLI.

A uniquely named module (not conftest) so tests of other directories can import it unambiguously.
The fixtures here are built once per session for all xdist workers (``conftest.shared_artifact``);
tests read them and copy a run directory before changing it.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from shared_artifacts import shared_artifact

ROOT = Path(__file__).resolve().parents[1]

TINY_POLICY_SHAPE = dict(
    num_layers=2,
    hidden_size=256,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=512,
    max_position_embeddings=128,
)
"""The session's tiny policy (``tiny_run_inputs``): the quickstart preset's architecture."""

REFERENCE_STEPS = {"trainer.total_training_steps": 3, "trainer.save_freq": 1}
"""The reference run: the quickstart GRPO config, three steps, a checkpoint after each."""


@pytest.fixture(scope="session")
def tool_run_inputs(tmp_path_factory):
    """The tool quickstart's policy, pre-trained briefly (tool calls in about half the samples),
    and the tool_mult parquet: shared by the multi-turn runs and the agent endpoint's tests.

    80 steps at lr 2e-3 (54 s here): sampled, it calls the tool in 56% of the probe's samples and
    copies the tool's answer in 44% of those; greedy, it always calls and copies 75%. (120 steps
    at the tool's 1e-3 took 90 s for 50% and 88%: the tests need calls and answers, not right ones.)"""

    def build(root: Path) -> dict[str, str]:
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "tools/make_tiny_tool_model.py"),
                *("--out", str(root / "model"), "--data-dir", str(root / "data")),
                *("--steps", "80", "--lr", "2e-3", "--eval-every", "1000", "--tool-share", "0.6"),
                *("--train-size", "64", "--test-size", "8", "--probe-size", "8", "--samples-per-prompt", "2"),
            ],
            check=True,
            capture_output=True,
        )
        return {"model": str(root / "model"), "data": str(root / "data")}

    return shared_artifact(tmp_path_factory, "tool_run_inputs", build)[1]


@pytest.fixture(scope="session")
def tiny_run_inputs(tmp_path_factory):
    def build(root: Path) -> dict[str, str]:
        from rlhf_megatron.models.tiny import make_tiny_hf_model

        subprocess.run(
            [
                sys.executable,
                str(ROOT / "tools/data/arith.py"),
                "--output-dir",
                str(root / "data"),
                "--train-size",
                "64",
                "--test-size",
                "8",
                "--seed",
                "0",
            ],
            check=True,
            capture_output=True,
        )
        # The quickstart preset's architecture (its model_arch must match the checkpoint), random weights.
        model = make_tiny_hf_model(root / "model", "llama", **TINY_POLICY_SHAPE)
        return {"model": str(model), "data": str(root / "data")}

    return shared_artifact(tmp_path_factory, "trainer_inputs", build)[1]


@pytest.fixture(scope="session")
def reference_run(tiny_run_inputs, tmp_path_factory) -> tuple[Path, list[dict]]:
    """One uninterrupted run of ``quickstart_cpu`` (``REFERENCE_STEPS``): ``(run dir, records)``.

    Read-only: the resume and fault tests compare their restarted runs with its metrics, the trainer
    tests check its steps and checkpoints, and a test that needs its checkpoints to change copies the
    directory."""

    def build(root: Path) -> list[dict]:
        proc, records = run_train(
            "quickstart_cpu", train_overrides(tiny_run_inputs, root / "run", **REFERENCE_STEPS)
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert [r["step"] for r in records] == [1, 2, 3]
        return records

    root, records = shared_artifact(tmp_path_factory, "reference_run", build)
    return root / "run", records


def train_overrides(inputs, run_dir, **extra):
    base = {
        "actor_rollout_ref.model.path": inputs["model"],
        "critic.model.path": inputs["model"],
        "data.train_files": f"{inputs['data']}/train.parquet",
        "data.val_files": f"{inputs['data']}/test.parquet",
        "trainer.default_local_dir": str(run_dir),
        # Small, fast steps, independent of the quickstart's tuning: 8 prompts x n=4, 2 mini-batches.
        "data.train_batch_size": 8,
        "actor_rollout_ref.rollout.n": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 16,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 16,
        "trainer.logger": "['jsonl']",
        "trainer.total_training_steps": 2,
        "trainer.test_freq": -1,
        "trainer.val_before_train": False,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


# Started by a Python process that holds the cluster until its stdin closes (this pytest process
# exits, or ``_stop_ray_head`` closes it), so no `ray stop` is needed, which would stop every Ray
# on the machine. Its system config is the one `rlhf-megatron train` gives a Ray it starts. Ray
# turns token authentication on for a new local cluster: the head gets a token of this process's
# in RAY_AUTH_TOKEN (as `rlhf-megatron launch local` does) and the drivers the same token and the
# auth mode the head's Ray chose.
_HEAD = """
import os, sys, ray
from rlhf_megatron.trainer.run import INLINE_OBJECT_BYTES
ctx = ray.init(num_cpus=16, object_store_memory=2 << 30, include_dashboard=False, log_to_driver=False,
               _system_config={"max_direct_call_object_size": INLINE_OBJECT_BYTES})
print(ctx.address_info["gcs_address"], os.environ.get("RAY_AUTH_MODE", ""), flush=True)
sys.stdin.read()
ray.shutdown()
"""
_head: subprocess.Popen | None = None
_head_env: dict[str, str] = {}
_head_lock = threading.Lock()


def shared_ray_env() -> dict[str, str]:
    """What a driver needs to join this process's shared Ray cluster (started on first use)."""
    global _head
    with _head_lock:
        if _head is None or _head.poll() is not None:
            token = secrets.token_hex(32)
            env = {**os.environ, "RAY_AUTH_TOKEN": token}
            env.pop("RAY_ADDRESS", None)
            _head = subprocess.Popen(
                [sys.executable, "-c", _HEAD],
                stdin=subprocess.PIPE,
                env=env,
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
            atexit.register(_stop_ray_head, _head)
            address, *mode = _head.stdout.readline().split()
            if not address:
                raise RuntimeError("the shared Ray cluster for the CLI tests did not start")
            _head_env.clear()
            _head_env.update(RAY_ADDRESS=address, RAY_AUTH_TOKEN=token)
            if mode:
                _head_env["RAY_AUTH_MODE"] = mode[0]
        return dict(_head_env)


def _stop_ray_head(head: subprocess.Popen) -> None:
    if head.poll() is None:
        head.stdin.close()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()


TP2_LAYOUT = [
    "parallelism=manual",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
]
"""The layout the e2e tests assert on (weights resharded into vLLM TP=2, two actor ranks): the CPU
quickstart's before ``parallelism: auto``, which picks TP=1 x DP=2 for it now."""


ONE_PROCESS = {
    "trainer.n_gpus_per_node": 1,
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 1,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
}
"""One trainer process (and one critic's): for a run whose checks do not depend on the ranks (the
driver's reward handling, a NaN policy, validation only). A process costs ~15-20 s of CPU to start
(Ray's worker, torch, megatron-core, vLLM), a 2-step run's whole training ~2 s."""


def pinned_layout(config) -> list[str]:
    """``TP2_LAYOUT`` for a preset that leaves its layout to ``parallelism: auto`` (the test's own
    overrides come after it and win), else nothing."""
    if not config:
        return []
    from rlhf_megatron.config.presets import read_preset_layers

    layers = read_preset_layers(config)
    auto = [m.get("parallelism") for _, m in layers if "parallelism" in m]
    return TP2_LAYOUT if auto and auto[-1] == "auto" else []


def run_train(config, overrides, env=None, timeout=600, own_ray=False, module="rlhf_megatron.train"):
    """Run the real CLI in a fresh process; returns (CompletedProcess, metric records by step).

    The run joins this test process's shared Ray cluster through ``RAY_ADDRESS`` (start-up and
    shutdown of a Ray cost ~5 s a run), unless ``own_ray``: then the CLI starts its own, as a
    user's ``rlhf-megatron train`` on one machine does. A run given the fault-injection test hook
    (``RLHF_FAULT*``, ``RLHF_STOP_AFTER_STEP``) gets ``RLHF_FAULT_HOOKS=tests/fault_hooks.py``
    too (unless set), the file ``fault_point`` loads its handlers from; other runs do not.
    ``module``: the CLI (``rlhf_megatron.sft`` / ``.rm`` run the stages before RL)."""
    full_env = {**os.environ, "WANDB_MODE": "offline", **(env or {})}
    if any(v and (k.startswith("RLHF_FAULT") or k == "RLHF_STOP_AFTER_STEP") for k, v in full_env.items()):
        full_env.setdefault("RLHF_FAULT_HOOKS", str(ROOT / "tests" / "fault_hooks.py"))
    if own_ray:
        full_env.pop("RAY_ADDRESS", None)
    else:
        full_env.update(shared_ray_env())
    config_args = ["--config", config] if config else []
    overrides = [*pinned_layout(config), *overrides]
    proc = subprocess.run(
        [sys.executable, "-m", module, *config_args, *overrides],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    run_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("trainer.default_local_dir="))
    path = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return proc, records
