"""Worker groups on a real local Ray cluster (CPU bundles) and a real 2-node Ray cluster."""

import os
import time
from pathlib import Path

import pytest
import torch

from rlhf_megatron.data.batch import Batch
from rlhf_megatron.scheduling import ResourcePool, WorkerError, WorkerGroup
from rlhf_megatron.trainer.recovery import failure_cause

ray = pytest.importorskip("ray")
HERE = str(Path(__file__).resolve().parent)
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False, runtime_env=RUNTIME_ENV, log_to_driver=False)
    yield
    ray.shutdown()


def _group(n, tp, name):
    from sched_workers import EchoWorker

    pool = ResourcePool(name, [n])
    group = WorkerGroup("actor", pool, EchoWorker, call_timeout_s=120)
    group.call.init_model(tp)
    return group, pool


@pytest.mark.parametrize("n, tp", [(2, 2), (4, 2)])
def test_dp_compute_splits_by_dp_rank_and_collects_owners(local_ray, n, tp):
    group, pool = _group(n, tp, f"echo{n}")
    try:
        x = torch.arange(8, dtype=torch.float32)
        out = group.call.tag_rows(Batch.from_dict({"x": x}))
        dp = n // tp
        assert torch.equal(out["x"], x), "rows come back in order"
        assert torch.equal(out["dp_rank"], torch.arange(dp).repeat_interleave(8 // dp))
        # tp_sum: the all-reduce over the whole world sums every rank's chunk: TP ranks share a chunk.
        assert torch.allclose(out["tp_sum"], torch.full((8,), float(x.sum()) * tp))
        if dp > 1:
            with pytest.raises(ValueError, match="does not split into data-parallel size"):
                group.call.tag_rows(Batch.from_dict({"x": torch.arange(3.0)}))
    finally:
        group.shutdown()
        pool.remove()


def test_exception_on_one_rank_names_role_rank_and_traceback(local_ray):
    group, pool = _group(2, 1, "fail")
    start = time.monotonic()
    with pytest.raises(WorkerError) as err:
        group.call.fail(1)
    assert time.monotonic() - start < 30
    msg = str(err.value)
    assert "[actor] rank 1 on node" in msg and "ValueError: deliberate failure in rank 1" in msg
    assert "sched_workers.py" in msg and ", in fail" in msg, "the remote traceback is included"
    assert "\x1b[" not in msg
    assert err.value.rank == 1
    assert err.value.cause == "raised" and failure_cause(err.value) is None  # a restart would not help
    pool.remove()


def test_killed_worker_is_reported_within_timeout(local_ray):
    group, pool = _group(2, 1, "die")
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"\[actor\] rank 0 on node .*process died during die") as err:
        group.call_within(60).die(0)
    assert time.monotonic() - start < 30
    assert err.value.cause == "died" and failure_cause(err.value) == "died"  # a restart may cure it
    pool.remove()


def test_dead_rank_is_named_even_when_a_peer_error_arrives_first(local_ray):
    group, pool = _group(2, 1, "die_late")
    start = time.monotonic()
    with pytest.raises(WorkerError) as err:
        group.call_within(60).die_then_peer_fails(1)
    assert time.monotonic() - start < 30
    msg = str(err.value)
    assert msg.startswith("[actor] rank 1 on node") and "process died during die_then_peer_fails" in msg, msg
    assert "rank 0 then failed too: RuntimeError: Connection reset by peer" in msg, msg
    assert err.value.rank == 1 and err.value.cause == "died"
    pool.remove()


def test_death_names_the_calls_queued_behind_the_one_it_surfaced_on(local_ray):
    # A process killed as a queued call starts can lose the previous call's reply, so the death
    # surfaces on that call: the error names what was queued behind it, in submission order.
    group, pool = _group(2, 1, "die_queued")
    assert group.call.nap(0.0) == [0, 1]  # collected: not in flight any more
    assert group.dp_size() == 2  # tag_rows splits by DP rank: the layout is known before a rank dies
    first = group.submit_within(60).die(1)
    behind = [group.submit.nap(0.1), group.submit.tag_rows(Batch.from_dict({"x": torch.zeros(2)}))]
    with pytest.raises(WorkerError) as err:
        first.result()
    msg = str(err.value)
    assert msg.startswith("[actor] rank 1 on node"), msg
    assert "process died during die (or in a call queued behind it: nap, tag_rows) (ActorDiedError)" in msg, (
        msg
    )
    del behind
    pool.remove()


def test_hang_hits_the_deadline_and_names_where_each_rank_was(local_ray):
    """Rank 0 stops; rank 1 waits for it in an all-reduce. The deadline stops the group with a
    ``hung`` error that reads each late rank's stack (faulthandler on SIGUSR1, from its Ray log)
    and tells the rank holding the other up from the one waiting."""
    group, pool = _group(2, 1, "hang")
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"hang_one did not finish within 3 s on ranks \[0, 1\]") as err:
        group.call_within(3).hang_one(0)
    assert time.monotonic() - start < 20
    assert err.value.cause == "hung" and failure_cause(err.value) == "hung"  # handled like a death
    msg = str(err.value)
    assert "rank 0 (not in a collective) at " in msg and "sched_workers.py:" in msg, msg
    assert "in hang_one" in msg.split("rank 0 (")[1].split("; rank 1")[0], msg
    assert "rank 1 (waiting in a collective) at " in msg, msg
    pool.remove()


def test_pool_rejects_bad_shapes():
    with pytest.raises(ValueError, match="at least one process per node"):
        ResourcePool("bad", [2, 0])
    with pytest.raises(ValueError, match="strategy 'CLUSTER'"):
        ResourcePool("bad", [2], strategy="CLUSTER")
