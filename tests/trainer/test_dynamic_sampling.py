"""DAPO's dynamic sampling on its own: which groups are kept, how rounds add up, what the step trains
on, and the scheduler's extra rounds in the sync and one-step-off schedules (the rollout is the
recorder of ``test_rollout_scheduler``; the e2e runs are in test_dapo_e2e)."""

import numpy as np
import pytest
import torch
from test_rollout_scheduler import _Rollout, _scheduler

from rlhf_megatron.data.batch import Batch
from rlhf_megatron.rewards.manager import OverlongBuffer, overlong_penalty
from rlhf_megatron.trainer.dynamic_sampling import (
    DynamicSampler,
    DynamicSamplingError,
    filter_values,
    groups_with_signal,
    merge_round_metrics,
)


def test_groups_whose_responses_all_score_alike_are_dropped():
    uids = ["a", "a", "b", "b", "c", "c", "d"]
    values = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    kept, dropped = groups_with_signal(uids, values)
    assert kept == ["a", "d"] and dropped == ["b", "c"]  # a lone response is kept, as verl does


def test_filter_values_read_the_named_extra_or_the_score():
    scores = torch.tensor([[0.0, 0.5], [0.0, 1.0]])
    assert filter_values("acc", scores, {"acc": [1, 0]}, 2).tolist() == [1.0, 0.0]
    # a scorer that returns a number has no "acc": its score is the accuracy (verl's dapo manager)
    assert filter_values("acc", scores, {}, 2).tolist() == [0.5, 1.0]
    assert filter_values("seq_reward", scores, {"acc": [1, 0]}, 2).tolist() == [0.5, 1.0]


def test_round_metrics_sum_counts_keep_extremes_and_weight_means():
    merged = merge_round_metrics(
        [
            (4, {"reward/errors": 1.0, "reward/x/mean": 1.0, "reward/x/max": 1.0, "reward/x/min": 0.5}),
            (12, {"reward/errors": 2.0, "reward/x/mean": 0.0, "reward/x/max": 0.2, "reward/x/min": 0.0}),
            (12, {"reward/judge_invalid": 5.0, "reward/judge_time_s": 1.5}),
            (4, {"reward/judge_invalid": 1.0, "reward/judge_time_s": 0.5}),
        ]
    )
    assert merged == {
        "reward/errors": 3.0,
        "reward/x/mean": 0.25,
        "reward/x/max": 1.0,
        "reward/x/min": 0.0,
        "reward/judge_invalid": 6.0,
        "reward/judge_time_s": 2.0,
    }


def _round(tag: str, accs: list[list[float]]) -> Batch:
    """A generated round: one group per entry of ``accs`` (its responses' accuracies)."""
    rows = [(f"{tag}-{g}", a) for g, group in enumerate(accs) for a in group]
    batch = Batch.from_dict({"responses": torch.arange(len(rows))[:, None].repeat(1, 2)})
    batch["uid"] = np.array([uid for uid, _ in rows], dtype=object)
    batch["acc"] = torch.tensor([float(a) for _, a in rows])
    return batch


def _score(batch):
    acc = batch["acc"]
    scores = torch.zeros(len(batch), 2)
    scores[:, -1] = acc
    return scores, {"reward/errors": 0.0, "reward/arith/mean": float(acc.mean())}, {}


def test_rounds_continue_until_enough_groups_and_the_surplus_is_cut():
    rounds = {
        1: _round("r1", [[1, 0], [0, 0], [1, 1], [0, 1]]),
        2: _round("r2", [[1, 0], [1, 0], [0, 0], [0, 1]]),
    }
    first = _round("r0", [[1, 1], [0, 1], [0, 0], [0, 0]])
    asked = []

    def more(r):
        asked.append(r)
        return rounds[r]

    batch, metrics = DynamicSampler("acc", 4, 0).collect(1, first, _score, more)
    assert asked == [1, 2]  # round 0 keeps 1 group, round 1 two more, round 2 the fourth
    assert list(dict.fromkeys(batch["uid"])) == ["r0-1", "r1-0", "r1-3", "r2-0"]
    assert len(batch) == 8 and torch.equal(batch["token_level_scores"][:, -1], batch["acc"])
    assert metrics["train/num_gen_batches"] == 3
    assert metrics["dynamic_sampling/kept_groups"] == 6 and metrics["dynamic_sampling/dropped_groups"] == 6
    assert metrics["dynamic_sampling/surplus_groups"] == 2
    assert metrics["dynamic_sampling/generated_samples"] == 24
    assert metrics["reward/arith/mean"] == pytest.approx(
        float(torch.cat([first["acc"], rounds[1]["acc"], rounds[2]["acc"]]).mean())
    )


def test_a_first_round_with_enough_signal_generates_nothing_more():
    first = _round("r0", [[1, 0], [0, 1], [1, 1]])
    batch, metrics = DynamicSampler("acc", 2, 0).collect(1, first, _score, lambda r: pytest.fail("no round"))
    assert list(dict.fromkeys(batch["uid"])) == ["r0-0", "r0-1"] and metrics["train/num_gen_batches"] == 1


def test_the_round_limit_stops_the_step_naming_what_to_change():
    same = _round("r", [[1, 1], [0, 0]])
    with pytest.raises(
        DynamicSamplingError, match=r"step 7: 2 generation rounds .*max_num_gen_batches=2.* kept 0"
    ):
        DynamicSampler("acc", 2, 2).collect(7, same, _score, lambda r: _round(f"r{r}", [[0, 0], [1, 1]]))


class _UidRollout(_Rollout):
    """The recorder, its batches carrying the prompts' uids as a real rollout's do."""

    def submit_generate(self, prompts, seed, *, interrupt_epoch=None, log_probs=()):
        done = super().submit_generate(prompts, seed, interrupt_epoch=interrupt_epoch, log_probs=log_probs)
        done.batch["uid"] = prompts["uid"]
        return done


@pytest.mark.parametrize("staleness", [0, 1])
def test_extra_rounds_draw_new_prompts_with_new_seeds_and_the_current_weights(staleness):
    """Sync (0) and one-step-off (1): a round for step 2 runs after whatever is queued, with the
    weights the rollout holds, a seed of its own and uids that cannot meet another round's."""
    rollout = _UidRollout()
    drawn = []

    def prompts():
        while True:
            drawn.append(len(drawn))
            yield Batch.from_dict({"input_ids": torch.zeros(2, 3, dtype=torch.long)})

    sched = _scheduler(rollout, prompts(), staleness, total=3)
    sched.take(1)
    rollout.events.append(("update", 1))
    sched.update_weights(1)()
    batch, _ = sched.take(2)
    queued = len(sched.queue)
    extra = sched.generate_round(2, 1)
    assert queued == staleness  # one-step-off: step 3's generation is already queued
    assert list(extra["uid"]) == ["2.1-0", "2.1-1"] and list(batch["uid"]) == ["2-0", "2-1"]
    gen_events = [e for e in rollout.events if e[0] == "gen"]
    assert len(set(seed for _, seed, _ in gen_events)) == len(gen_events), "every generation has its own seed"
    assert gen_events[-1][2] == 1 and int(extra["weight_version"].max()) == 1  # the newest weights
    assert drawn == list(range(3 + staleness))  # steps 1, 2 (and 3 ahead), then the round's own prompts
    batch3, metrics = sched.take(3)
    assert metrics["async/staleness_max"] <= staleness


def test_overlong_penalty_is_verls_linear_ramp():
    buffer = OverlongBuffer(length=4, penalty_factor=1.0, max_response_length=16)
    assert [overlong_penalty(n, buffer) for n in (0, 12, 13, 14, 16)] == [0.0, 0.0, -0.25, -0.5, -1.0]
