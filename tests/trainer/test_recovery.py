"""In-job recovery's decisions on their own: which failures a restart may cure, the backoff, what a
restart records, and the metrics of steps run again being forgotten (the e2e run is in
tests/reliability/test_faults_e2e.py)."""

import json

import pytest

from rlhf_megatron.scheduling.worker_group import WorkerError
from rlhf_megatron.trainer.loggers import Tracker
from rlhf_megatron.trainer.recovery import MAX_BACKOFF_S, Recovery, failure_cause


def _err(cause="raised", detail="boom"):
    return WorkerError("actor", 1, "node-a (10.0.0.1, pid 7)", detail, cause=cause)


@pytest.mark.parametrize(
    "err, cause",
    [
        (_err("died", "process died during update_actor (ActorDiedError)"), "died"),
        (_err("hung", "update_actor did not finish within 30 s on ranks [0, 1]"), "hung"),
        (_err(detail="update_actor raised:\nRuntimeError: [gloo] Connection reset by peer"), "collective"),
        (_err(detail="raised:\ntorch.distributed.DistBackendError: NCCL error in: ..."), "collective"),
        (_err(detail="raised:\nRuntimeError: Watchdog caught collective operation timeout"), "collective"),
        (_err(detail="update_actor raised:\nNonFiniteGradientError: [actor] rank 0 step 2"), None),
        (_err(detail="generate_sequences raised:\nValueError: bad row"), None),
        (ValueError("a driver-side error"), None),
    ],
)
def test_only_deaths_hangs_and_lost_peers_are_restarted(err, cause):
    assert failure_cause(err) == cause


def test_restarts_are_bounded_backed_off_and_recorded(tmp_path):
    recovery = Recovery(max_restarts=2, backoff_s=10.0, run_dir=tmp_path)
    died = _err("died", "process died during update_actor")
    assert recovery.cause_to_restart(_err()) is None  # the worker's own error ends the run
    assert recovery.cause_to_restart(died) == "died"
    assert recovery.record("died", died, failed_step=5, resumed_step=4) == 10.0
    assert recovery.take_metrics() == {
        "recovery/restarts": 1.0,
        "recovery/steps_lost": 1.0,
        "recovery/cause": "died",
    }
    assert recovery.take_metrics() == {}, "reported once, with the first step after the restart"
    assert recovery.record("hung", _err("hung"), failed_step=8, resumed_step=6) == 20.0  # doubled
    assert recovery.cause_to_restart(died) is None, "max_restarts=2 reached"
    events = [json.loads(line) for line in (tmp_path / "recovery.jsonl").read_text().splitlines()]
    assert [(e["restart"], e["cause"], e["steps_lost"]) for e in events] == [(1, "died", 1), (2, "hung", 2)]
    assert events[0]["message"].startswith("[actor] rank 1 on node node-a")
    recovery.restarts = 20
    assert recovery.delay_s() == MAX_BACKOFF_S


def test_rewind_forgets_the_steps_a_resumed_run_trains_again(tmp_path):
    tracker = Tracker(["jsonl"], tmp_path, total_steps=4, project="p", experiment="e")
    for step in (0, 1, 2, 3):
        tracker.log({"x": float(step)}, step)
    tracker.log_generations([("1+1=", "2", 1.0)], 3)
    tracker.rewind(1)
    tracker.log({"x": 20.0}, 2)
    tracker.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in records] == [(0, 0.0), (1, 1.0), (2, 20.0)]
    assert (tmp_path / "val_generations.jsonl").read_text() == ""
    assert not list(tmp_path.glob(".*.tmp"))
