"""The cross-pool weight stream on real gloo process groups of its own, beside each process's world."""

import io
import multiprocessing as mp
import socket

import pytest
import torch

from rlhf_megatron.weights.cross_pool import CrossPoolRoute, open_sync_group, receive_buckets, send_buckets


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _buckets():
    gen = torch.Generator().manual_seed(0)
    return [
        [("a.weight", torch.randn(4, 8, generator=gen)), ("a.bias", torch.randn(8, generator=gen))],
        [("b.weight", torch.randn(3, 5, generator=gen).to(torch.bfloat16)), ("b.index", torch.arange(6))],
        [("c.weight", torch.randn(16, 16, generator=gen))],
    ]


def _sender(port, size, version, fail_after, out):
    try:
        sync = open_sync_group("127.0.0.1", port, 0, size, timeout_s=30)

        def produce():
            for i, bucket in enumerate(_buckets()):
                if fail_after is not None and i == fail_after:
                    raise RuntimeError("gather failed")
                yield bucket

        out.put(("sent", send_buckets(sync, produce(), version)))
    except Exception as err:  # noqa: BLE001 (reported to the test)
        out.put(("error", repr(err)))


def _receiver(port, rank, size, out):
    try:
        sync = open_sync_group("127.0.0.1", port, rank, size, timeout_s=10)
        stats = {}
        got = [(name, t.clone()) for name, t in receive_buckets(sync, stats)]
        # As bytes: a tensor put on the queue is shared through this process's file descriptors,
        # which the test could no longer fetch once the process has exited.
        buf = io.BytesIO()
        torch.save(got, buf)
        out.put(("received", rank, buf.getvalue(), stats))
    except Exception as err:  # noqa: BLE001
        out.put(("error", rank, repr(err)))


def _run(receivers: int, version: int = 7, fail_after=None):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    size = 1 + receivers
    procs = [ctx.Process(target=_sender, args=(port, size, version, fail_after, out))]
    procs += [ctx.Process(target=_receiver, args=(port, r, size, out)) for r in range(1, size)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return results


@pytest.mark.parametrize("receivers", [1, 2])
def test_every_receiver_gets_every_tensor_in_order_with_its_version(receivers):
    results = _run(receivers)
    expected = [pair for bucket in _buckets() for pair in bucket]
    sent = next(r for r in results if r[0] == "sent")[1]
    assert sent["bytes"] == sum(t.numel() * t.element_size() for _, t in expected)
    received = [r for r in results if r[0] == "received"]
    assert len(received) == receivers, results
    for _, _, data, stats in received:
        got = torch.load(io.BytesIO(data))
        assert [n for n, _ in got] == [n for n, _ in expected]
        for (_, a), (_, b) in zip(got, expected):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert stats["version"] == 7 and stats["bytes"] == sent["bytes"]


def test_a_sender_that_fails_mid_stream_fails_its_receivers_instead_of_hanging():
    results = _run(1, fail_after=1)
    assert ("error", "RuntimeError('gather failed')") in results
    # The receiver never mistakes the cut stream for a whole one (its engine would hold half a model).
    receiver = next(r for r in results if r[0] != "sent" and r[1] == 1)
    assert receiver[0] == "error", receiver


def test_route_ranks_do_not_overlap():
    route = CrossPoolRoute.of(3)
    assert route.group_size == 4
    assert route.group_rank("trainer", 0) == 0 and route.group_rank("trainer", 1) is None
    assert [route.group_rank("rollout", r) for r in range(3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="distinct"):
        CrossPoolRoute((0,), (1, 1))
