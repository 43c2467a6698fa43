"""The rollout scheduler's rule on its own: which weight version generates each step's batch, when the
rollout syncs, and what is dropped. The rollout is a recorder of the scheduler's narrow interface
(``rollout_scheduler.Rollout``; the e2e runs are in test_async_e2e)."""

import pytest
import torch

from rlhf_megatron.data.batch import Batch
from rlhf_megatron.rollout.base import UNFINISHED_KEY
from rlhf_megatron.trainer.rollout_scheduler import VERSION_KEY, RolloutScheduler, actor_version, can_start


class _Done:
    def __init__(self, batch):
        self.batch = batch

    def done(self):
        return True

    def result(self):
        return self.batch


class _Rollout:
    """Generation is instant; ``version`` is what the rollout holds when a generation runs."""

    def __init__(self):
        self.events = []
        self.rollout_holds = 0  # the rollout's version in call order (a rollout runs calls in order)

    def submit_generate(self, prompts, seed, *, interrupt_epoch=None, log_probs=()):
        self.events.append(("gen", seed, self.rollout_holds))
        return _Done(Batch.from_dict({VERSION_KEY: torch.full((len(prompts),), self.rollout_holds)}))

    def finish_generate(self, pending, version):
        return pending.result()

    def update_weights(self, version):
        self.events.append(("sync", version))
        self.rollout_holds = version
        return lambda: {}


def _scheduler(rollout, prompts, staleness, total, critic_warmup=0, partial=False):
    return RolloutScheduler(
        rollout, prompts, staleness, total_steps=total, critic_warmup=critic_warmup, partial=partial
    )


def _prompts():
    while True:
        yield Batch.from_dict({"input_ids": torch.zeros(2, 3, dtype=torch.long)})


def _simulate(staleness, total=5, critic_warmup=0, prefetch=False):
    rollout = _Rollout()
    sched = _scheduler(rollout, _prompts(), staleness, total, critic_warmup)
    lags = []
    for step in range(1, total + 1):
        _, metrics = sched.take(step)
        lags.append(metrics["async/staleness_max"])
        rollout.events.append(("update", step))
        if prefetch:
            sched.draw_ahead(step + 1)
        sched.update_weights(step, prefetch=prefetch)()
    return rollout.events, lags


def test_staleness_zero_is_the_sync_schedule():
    events, lags = _simulate(0, total=3)
    assert events == [
        ("gen", 1, 0),
        ("update", 1),
        ("sync", 1),
        ("gen", 2, 1),
        ("update", 2),
        ("sync", 2),
        ("gen", 3, 2),
        ("update", 3),
        ("sync", 3),
    ]
    assert lags == [0, 0, 0]


def test_prefetch_submits_the_next_generation_behind_the_sync_with_the_same_weights():
    events, lags = _simulate(0, total=3, prefetch=True)
    assert events == _simulate(0, total=3)[0]  # the same calls in the same order, with the same weights
    assert lags == [0, 0, 0]
    rollout = _Rollout()
    sched = _scheduler(rollout, _prompts(), 0, 3)
    sched.take(1)
    sched.update_weights(1, prefetch=True)()
    assert rollout.events[-2:] == [("sync", 1), ("gen", 2, 1)]  # before the driver's next take
    assert [g.step for g in sched.queue] == [2]
    rollout = _Rollout()
    sched = _scheduler(rollout, _prompts(), 0, 1)
    sched.take(1)
    sched.update_weights(1, prefetch=True)()  # the last step: nothing left to generate
    assert rollout.events[-1] == ("sync", 1) and not sched.queue


def _numbered_prompts(drawn):
    n = 0
    while True:
        n += 1
        drawn.append(n)
        yield Batch.from_dict({"input_ids": torch.full((2, 3), n, dtype=torch.long)})


def test_prompts_drawn_ahead_feed_the_next_generation_once_and_a_sync_point_sends_them_out():
    drawn = []
    rollout = _Rollout()
    sched = _scheduler(rollout, _numbered_prompts(drawn), 0, 4)
    sched.take(1)
    sched.draw_ahead(2)
    sched.draw_ahead(2)  # already drawn: the loader is not read twice
    assert drawn == [1, 2] and not sched.queue
    sched.update_weights(1, prefetch=True)()
    assert sched.drawn is None and [int(g.prompts["input_ids"][0, 0]) for g in sched.queue] == [2]
    batch, _ = sched.take(2)
    sched.draw_ahead(3)
    sched.drain(2)  # a sync point came after all (e.g. the run is saved): step 3's batch goes out
    assert sched.drawn is None and [(g.step, g.batch is not None) for g in sched.queue] == [(3, True)]
    assert rollout.events[-2:] == [("sync", 2), ("gen", 3, 2)] and drawn == [1, 2, 3]
    for staleness in (1, 2):  # the async schedules draw when they submit
        sched = _scheduler(_Rollout(), _prompts(), staleness, 4)
        sched.take(1)
        sched.draw_ahead(sched.next_step)
        assert sched.drawn is None


def test_prefetch_leaves_the_async_schedules_alone():
    for staleness in (1, 2):
        assert _simulate(staleness, total=4, prefetch=True) == _simulate(staleness, total=4)


def test_one_step_off_generates_the_next_batch_with_the_previous_weights():
    events, lags = _simulate(1, total=4)
    gens = [e for e in events if e[0] == "gen"]
    assert gens == [("gen", 1, 0), ("gen", 2, 0), ("gen", 3, 1), ("gen", 4, 2)]
    assert lags == [0, 1, 1, 1]


def test_async_runs_ahead_up_to_max_staleness_and_syncs_when_the_queue_is_short():
    events, lags = _simulate(2, total=6)
    assert max(lags) == 2 and all(lag <= 2 for lag in lags)
    gens = {e[1]: e[2] for e in events if e[0] == "gen"}
    assert gens[3] == 0  # batch 3 from the initial weights, trained by version 2
    syncs = [e[1] for e in events if e[0] == "sync"]
    assert len(syncs) < 6, "with work queued the rollout skips some syncs"


def test_critic_warmup_steps_change_no_version():
    assert [actor_version(s, 2) for s in range(5)] == [0, 0, 0, 1, 2]
    events, lags = _simulate(1, total=4, critic_warmup=2)
    assert [e for e in events if e[0] == "sync"] == [("sync", 1), ("sync", 2)]
    assert lags == [0, 0, 0, 1]


def test_can_start_bounds_both_lag_and_lead():
    assert can_start(3, 1, rollout_version=0, staleness=2, critic_warmup=0)
    assert not can_start(4, 1, rollout_version=0, staleness=2, critic_warmup=0)  # too far ahead
    assert not can_start(4, 2, rollout_version=0, staleness=2, critic_warmup=0)  # too stale: lag 3


def test_a_batch_older_than_the_bound_is_dropped_counted_and_regenerated():
    rollout = _Rollout()
    sched = _scheduler(rollout, _prompts(), 1, 3)
    sched.take(1)
    sched.update_weights(1)()
    # A batch from version 0 queued for step 3 (e.g. restored from an older schedule): lag 2 > 1.
    sched.take(2)
    stale = Batch.from_dict({VERSION_KEY: torch.zeros(2, dtype=torch.long)})
    sched.queue.clear()
    sched.restore([(3, stale, stale)])
    sched.update_weights(2)()
    batch, metrics = sched.take(3)
    assert metrics["async/dropped_samples"] == 2
    assert metrics["async/staleness_max"] <= 1 and int(batch[VERSION_KEY][0]) == 2


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_drain_leaves_the_rollout_at_the_newest_version(staleness):
    rollout = _Rollout()
    sched = _scheduler(rollout, _prompts(), staleness, 4)
    sched.take(1)
    if staleness:
        sched.take(2)
    sched.drain(2)
    assert rollout.rollout_holds == 2 and sched.rollout_version == 2
    assert all(g.batch is not None for g in sched.queue)


class _Running:
    """A generation that runs until its result is asked for, unless interrupted first."""

    def __init__(self, rollout, rows, version, epoch):
        self.rollout, self.rows, self.version, self.epoch = rollout, rows, version, epoch

    def result(self):
        cut = self.rollout.epoch > self.epoch
        return Batch.from_dict(
            {
                VERSION_KEY: torch.full((self.rows,), self.version),
                UNFINISHED_KEY: torch.full((self.rows,), cut),
            }
        )


class _PartialRollout(_Rollout):
    """The recorder with partial rollout: generations are cut short by ``interrupt``."""

    def __init__(self):
        super().__init__()
        self.epoch = 0

    def submit_generate(self, prompts, seed, *, interrupt_epoch=None, log_probs=()):
        assert interrupt_epoch == self.epoch, "a generation must be submitted under the current epoch"
        self.events.append(("gen", seed, self.rollout_holds))
        return _Running(self, len(prompts), self.rollout_holds, interrupt_epoch)

    def interrupt(self):
        self.epoch += 1
        self.events.append(("interrupt",))
        return self.epoch

    def submit_continue(self, batch, seed, interrupt_epoch):
        assert bool(batch[UNFINISHED_KEY].all()) and interrupt_epoch == self.epoch
        self.events.append(("continue", self.rollout_holds))
        return _Running(self, len(batch), int(batch[VERSION_KEY][0]), interrupt_epoch)


def test_partial_rollout_interrupts_at_every_sync_and_continues_under_the_new_weights():
    rollout = _PartialRollout()
    sched = _scheduler(rollout, _prompts(), staleness=2, total=5, partial=True)
    records = []
    for step in range(1, 6):
        batch, metrics = sched.take(step)
        assert UNFINISHED_KEY not in batch.tensor_keys, "the trainer never sees the partial-rollout column"
        records.append(metrics)
        sched.update_weights(step)()
    # The same rule decides when to sync as without partial rollout ...
    plain, _ = _simulate(2, total=5)
    assert [e for e in rollout.events if e[0] == "sync"] == [e for e in plain if e[0] == "sync"]
    # ... but a sync with generations in flight interrupts them first and continues them after.
    for i, event in enumerate(rollout.events):
        if event[0] == "interrupt":
            assert rollout.events[i + 1][0] == "sync" and rollout.events[i + 2][0] == "continue"
            assert rollout.events[i + 2][1] == rollout.events[i + 1][1], "continued under the new weights"
    assert sum(r["async/partial_samples"] for r in records) > 0
    assert all(r["async/staleness_max"] <= 2 and r["async/dropped_samples"] == 0 for r in records)
    assert records[-1]["async/interrupts"] == sum(e[0] == "interrupt" for e in rollout.events) > 0


class _DyingRollout(_Rollout):
    """The recorder, whose engines die during one chosen generation and can be built again."""

    def __init__(self, dies_at: int):
        super().__init__()
        self.dies_at, self.calls, self.engine_restarts = dies_at, 0, 0

    def submit_generate(self, prompts, seed, *, interrupt_epoch=None, log_probs=()):
        self.calls += 1
        if self.calls == self.dies_at:
            self.events.append(("gen dies", seed, self.rollout_holds))
            return _Dies()
        return super().submit_generate(prompts, seed, interrupt_epoch=interrupt_epoch, log_probs=log_probs)

    def restart_engines(self, err):
        self.engine_restarts += 1
        self.events.append(("restart",))
        self.rollout_holds = None  # fresh engines hold no trained weights
        return True


class _Dies:
    def result(self):
        raise RuntimeError("[rollout] rank 0: process died during generate_sequences")


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_dead_rollout_is_rebuilt_given_the_newest_weights_and_its_lost_generation_rerun(staleness):
    """Sync and one-step-off: the generation of step 2 dies; the engines are built again, get the
    actor's newest weights, and the same prompts and seed run again: no step is lost and no
    sample lags more than the bound."""
    rollout = _DyingRollout(dies_at=2)
    sched = _scheduler(rollout, _prompts(), staleness, total=3)
    lags = []
    for step in (1, 2, 3):
        _, metrics = sched.take(step)
        lags.append(metrics["async/staleness_max"])
        rollout.events.append(("update", step))
        sched.update_weights(step)()
    lost = ("gen dies", 2, 1) if staleness == 0 else ("gen dies", 2, 0)  # one-step-off: on version 0
    rerun = [("restart",), ("sync", 1), ("gen", 2, 1)]  # the newest weights, then the same seed
    start = rollout.events.index(lost)
    assert rollout.events[start + 1 : start + 5] == (
        [*rerun, ("update", 2)] if staleness == 0 else [("update", 1), *rerun]
    )
    assert rollout.events.count(("sync", 1)) == 1 + (staleness == 0), "no second sync of the same weights"
    assert rollout.engine_restarts == 1
    assert max(lags) <= staleness
