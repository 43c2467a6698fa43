"""Masks, positions, and vocab-parallel log-probs/entropy (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.models.forward import (
    build_attention_mask,
    position_ids_from_mask,
    vocab_parallel_entropy,
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_at,
)
from rlhf_megatron.platform.multiproc import run_on_ranks

VOCAB, PADDED = 300, 384


def test_mask_is_causal_padding_aware_and_never_empty():
    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    masked = build_attention_mask(pad)  # True = masked
    assert masked.shape == (2, 1, 5, 5) and masked.dtype == torch.bool
    allowed = ~masked[:, 0]
    # Row 0: tokens at 2..4 see tokens at 2..i only; padding queries see only themselves.
    assert allowed[0, 4].tolist() == [False, False, True, True, True]
    assert allowed[0, 2].tolist() == [False, False, True, False, False]
    assert allowed[0, 0].tolist() == [True, False, False, False, False]
    assert torch.equal(allowed[1], torch.tril(torch.ones(5, 5, dtype=torch.bool)))
    window = ~build_attention_mask(pad[1:], sliding_window=2)[0, 0]
    assert window[4].tolist() == [False, False, False, True, True]


def test_position_ids_count_from_first_token():
    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(pad).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


def _reference(logits, labels):
    z = logits[..., :VOCAB].double()
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, labels[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(2, 5, PADDED, generator=g, dtype=torch.float64)
    logits[..., VOCAB:] = 50.0  # padding columns with big logits must not count
    labels = torch.randint(0, VOCAB, (2, 5), generator=g)
    weights = torch.randn(2, 5, generator=g, dtype=torch.float64)
    return logits, labels, weights


# Logits per block: everything at once (the default here), whole rows (5 positions), pieces of rows.
CHUNKS = [None, 5 * PADDED, 2 * PADDED]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_single_shard_values_and_gradients(chunk):
    logits, labels, weights = _data()
    ref_lp, ref_ent = _reference(logits, labels)
    x = logits.clone().float().requires_grad_()
    kw = {"chunk_elements": chunk} if chunk else {}
    lp = vocab_parallel_log_probs(x, labels, VOCAB, **kw)
    ent = vocab_parallel_entropy(x, VOCAB, **kw)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    ((lp * weights).sum() + (ent * weights).sum()).backward()
    y = logits.clone().requires_grad_()
    rlp, rent = _reference(y, labels)
    ((rlp * weights).sum() + (rent * weights).sum()).backward()
    torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-5, rtol=1e-4)
    assert torch.all(x.grad[..., VOCAB:] == 0)


def test_blocks_keep_views_of_a_sliced_response_window():
    """The loss functions get ``logits[:, -w - 1 : -1]`` (a strided view); their blocks are views of it."""
    from rlhf_megatron.models.forward import _blocks

    full = torch.randn(3, 9, 16)
    window = full[:, 2:8]
    for chunk, expected in ((10_000, 1), (6 * 16, 3), (4 * 16, 6)):
        blocks = _blocks(window, chunk)
        assert len(blocks) == expected
        covered = torch.zeros(3, 6, dtype=torch.long)
        for rows, cols in blocks:
            assert window[rows, cols].data_ptr() >= full.data_ptr()  # a view, not a copy
            covered[rows, cols] += 1
        assert torch.all(covered == 1)


def test_a_bf16_response_window_is_not_copied_whole():
    """bf16 logits: the gradient is bf16 and equals the fp64 reference to bf16 precision."""
    logits, labels, weights = _data()
    full = torch.cat([logits, logits], dim=1).to(torch.bfloat16).requires_grad_()
    window = full[:, 3:8]
    lp = vocab_parallel_log_probs(window, labels, VOCAB, chunk_elements=2 * PADDED)
    (lp * weights.float()).sum().backward()
    y = window.detach().double().requires_grad_()
    rlp, _ = _reference(y, labels)
    (rlp * weights).sum().backward()
    assert full.grad.dtype == torch.bfloat16
    torch.testing.assert_close(full.grad[:, 3:8].double(), y.grad, atol=2e-2, rtol=2e-2)
    assert torch.all(full.grad[:, :3] == 0) and torch.all(full.grad[:, 8:] == 0)


def _two_shards(rank, world_size):
    import torch.distributed as dist

    # A bare gloo group (run_on_ranks set the rendezvous env): no megatron needed here.
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    logits, labels, weights = _data()
    shard = logits.float().chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    # pieces of rows: the collectives run per block, in the same order on both ranks
    lp = vocab_parallel_log_probs(
        shard, labels, VOCAB, tp_group=dist.group.WORLD, chunk_elements=3 * PADDED // 2
    )
    ent = vocab_parallel_entropy(shard, VOCAB, tp_group=dist.group.WORLD, chunk_elements=3 * PADDED // 2)
    ((lp * weights.float()).sum() + (ent * weights.float()).sum()).backward()
    dist.destroy_process_group()
    # numpy, not tensors: torch would share tensor memory through this (exiting) process.
    return lp.detach().numpy(), ent.detach().numpy(), shard.grad.numpy()


@pytest.mark.slow
def test_two_tp_shards_match_the_full_softmax_without_gathering():
    logits, labels, weights = _data()
    ref_lp, ref_ent = _reference(logits, labels)
    y = logits.clone().requires_grad_()
    rlp, rent = _reference(y, labels)
    ((rlp * weights).sum() + (rent * weights).sum()).backward()
    out = run_on_ranks(_two_shards, 2, timeout_s=300, init_process_group=False)
    for rank, arrays in enumerate(out):
        lp, ent, grad = (torch.from_numpy(a) for a in arrays)
        torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad.double(), y.grad.chunk(2, -1)[rank], atol=1e-5, rtol=1e-4)


def _topk_data(seed=1, k=4):
    logits, _, _ = _data(seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 5, k), generator=g)
    ids[0, 0] = ids[0, 0, 0]  # repeated ids (padded positions send id 0 K times)
    weights = torch.randn(2, 5, k, generator=g, dtype=torch.float64)
    return logits, ids, weights


@pytest.mark.parametrize("chunk", CHUNKS)
def test_log_probs_at_topk_ids_values_and_gradients(chunk):
    logits, ids, weights = _topk_data()
    x = logits.clone().float().requires_grad_()
    kw = {"chunk_elements": chunk} if chunk else {}
    lp = vocab_parallel_log_probs_at(x, ids, VOCAB, **kw)
    (lp * weights).sum().backward()
    y = logits.clone().requires_grad_()
    ref = torch.log_softmax(y[..., :VOCAB], -1).gather(-1, ids)
    (ref * weights).sum().backward()
    torch.testing.assert_close(lp.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-5, rtol=1e-4)
    assert torch.all(x.grad[..., VOCAB:] == 0)


def _two_shards_topk(rank, world_size):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    logits, ids, weights = _topk_data()
    shard = logits.float().chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    lp = vocab_parallel_log_probs_at(
        shard, ids, VOCAB, tp_group=dist.group.WORLD, chunk_elements=3 * PADDED // 2
    )
    (lp * weights.float()).sum().backward()
    dist.destroy_process_group()
    return lp.detach().numpy(), shard.grad.numpy()


@pytest.mark.slow
def test_log_probs_at_topk_ids_over_two_tp_shards():
    logits, ids, weights = _topk_data()
    y = logits.clone().requires_grad_()
    ref = torch.log_softmax(y[..., :VOCAB], -1).gather(-1, ids)
    (ref * weights).sum().backward()
    out = run_on_ranks(_two_shards_topk, 2, timeout_s=300, init_process_group=False)
    for rank, arrays in enumerate(out):
        lp, grad = (torch.from_numpy(a) for a in arrays)
        torch.testing.assert_close(lp.double(), ref.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad.double(), y.grad.chunk(2, -1)[rank], atol=1e-5, rtol=1e-4)
