"""The worker groups' typed proxies, without Ray: a method name resolves against the worker class
(or fails there, naming the class), and a call goes to the group's one way in with its deadline."""

from __future__ import annotations

import pytest

from rlhf_megatron.scheduling.worker_group import WorkerGroup
from rlhf_megatron.workers.critic import CriticWorker


class _Recorded:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _group(calls: list) -> WorkerGroup:
    group = WorkerGroup.__new__(WorkerGroup)  # no Ray actors: only the proxies are under test
    group.role, group.worker_cls = "critic", CriticWorker

    def submit(method, args, kwargs, timeout_s):
        calls.append((method, args, kwargs, timeout_s))
        return _Recorded(f"{method} done")

    group._submit = submit
    return group


def test_a_method_the_worker_lacks_fails_at_the_attribute():
    group = _group([])
    with pytest.raises(AttributeError, match=r"\[critic\] CriticWorker has no method 'update_critc'"):
        group.call.update_critc  # noqa: B018 - the attribute itself must fail
    with pytest.raises(AttributeError, match="has no method '_private'"):
        group.submit._private  # noqa: B018


def test_call_waits_submit_returns_the_pending_call_and_within_sets_the_deadline():
    calls: list = []
    group = _group(calls)
    assert group.call.update_critic("batch", 3) == "update_critic done"
    pending = group.submit.compute_values("batch")
    assert isinstance(pending, _Recorded) and pending.result() == "compute_values done"
    group.call_within(7.5).save_checkpoint("dir")
    assert calls == [
        ("update_critic", ("batch", 3), {}, None),
        ("compute_values", ("batch",), {}, None),
        ("save_checkpoint", ("dir",), {}, 7.5),
    ]
