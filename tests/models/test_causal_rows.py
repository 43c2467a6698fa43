"""Contiguous rows without a mask (``models.causal_rows``): the shifts, the roll, and a model chunk
built with ``causal_rows`` giving the masked pass's outputs and gradients on padded rows.

On CPU the builder leaves the mask-free path off (it is a CUDA default); these tests switch it on
explicitly, so the CPU suite checks the same arithmetic the GPU runs.
"""

import pytest
import torch

from rlhf_megatron.models.causal_rows import CAUSAL_ROWS_ATTR, causal_shifts, roll_rows
from rlhf_megatron.models.forward import _causal_shifts, position_ids_from_mask
from rlhf_megatron.platform.multiproc import run_on_ranks


def test_shifts_are_each_rows_leading_padding_when_every_row_is_one_run():
    mask = torch.tensor(
        [
            [0, 0, 1, 1, 1, 0],  # left and right padding
            [1, 1, 1, 1, 1, 1],  # full
            [0, 0, 0, 0, 0, 0],  # empty: contiguous, no shift
            [0, 0, 0, 0, 0, 1],
        ]
    )
    assert causal_shifts(mask) == [2, 0, 0, 5]


def test_a_row_with_a_hole_needs_the_mask():
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]])
    assert causal_shifts(mask) is None


def test_roll_rows_moves_each_row_and_back_with_its_gradient():
    x = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3).requires_grad_()
    rolled = roll_rows(x, [2, 0])
    assert torch.equal(rolled[0], torch.roll(x[0], -2, 0)) and torch.equal(rolled[1], x[1])
    assert torch.equal(roll_rows(rolled, [2, 0], back=True), x)
    weights = torch.randn(2, 5, 3)
    (rolled * weights).sum().backward()
    assert torch.equal(x.grad, roll_rows(weights, [2, 0], back=True))
    assert roll_rows(x, [0, 0]) is x  # nothing moves: no copy


class _Chunk(torch.nn.Module):
    def __init__(self, causal_rows_from: int | None):
        super().__init__()
        setattr(self, CAUSAL_ROWS_ATTR, causal_rows_from)


def test_packed_segments_short_windows_small_micro_batches_and_plain_chunks_keep_the_mask():
    mask = torch.tensor([[0, 1, 1, 1]])
    segments = torch.tensor([[-1, 0, 1, 1]])
    assert _causal_shifts(_Chunk(0), mask, None, None) == [1]
    assert _causal_shifts(_Chunk(4), mask, None, None) == [1]  # as many tokens as the threshold
    assert _causal_shifts(_Chunk(5), mask, None, None) is None  # smaller micro-batches keep the mask
    assert _causal_shifts(_Chunk(8), torch.ones(2, 4), None, None) == [0, 0]  # rows x columns
    assert _causal_shifts(_Chunk(0), mask, 4, None) == [1]  # the window spans the row
    assert _causal_shifts(_Chunk(0), mask, 3, None) is None
    assert _causal_shifts(_Chunk(0), mask, None, segments) is None
    assert _causal_shifts(_Chunk(None), mask, None, None) is None
    assert _causal_shifts(torch.nn.Linear(1, 1), mask, None, None) is None
    wrapped = torch.nn.Module()
    wrapped.module = _Chunk(0)  # megatron's DDP keeps the model as .module
    assert _causal_shifts(wrapped, mask, None, None) == [1]


def _arch():
    from rlhf_megatron.models.tiny import build_tiny_hf_model
    from rlhf_megatron.planning.model_arch import ModelArch

    model, _ = build_tiny_hf_model(
        "llama", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, ffn_hidden_size=256
    )
    config = model.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    return ModelArch.from_hf_config(config)


def _compare(rank, world):
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.forward import model_forward
    from rlhf_megatron.platform import init_model_parallel

    init_model_parallel(1, 1, seed=1)
    arch = _arch()
    chunks = {
        name: build_gpt_model(arch, ParallelConfig(1), attention_backend=backend, causal_rows=rows)[0]
        for name, backend, rows in (
            ("default", "sdpa", "auto"),
            ("masked", "sdpa", None),
            ("free", "sdpa", 0),
        )
    }
    (local,) = build_gpt_model(arch, ParallelConfig(1))
    for chunk in (*chunks.values(), local):
        chunk.load_state_dict(chunks["masked"].state_dict())
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(3, 24, dtype=torch.long)
    mask[0, :7] = 0  # left padding
    mask[1, 20:] = 0  # right padding
    mask[2, :3], mask[2, 17:] = 0, 0
    ids = torch.randint(3, 100, (3, 24), generator=g) * mask
    pos = position_ids_from_mask(mask)
    weights = torch.randn(3, 24, arch.padded_vocab_size(1), generator=g)
    out, grads = {}, {}
    for name, chunk in (("local", local), ("masked", chunks["masked"]), ("free", chunks["free"])):
        logits = model_forward(chunk, ids, mask, pos)
        (logits * weights * mask[..., None]).sum().backward()
        out[name] = logits.detach()
        grads[name] = torch.cat([p.grad.flatten() for p in chunk.parameters()])
    return {
        "out": out,
        "grads": grads,
        "valid": mask.bool(),
        "flags": {name: getattr(chunk, CAUSAL_ROWS_ATTR, None) for name, chunk in chunks.items()},
        "local_flag": getattr(local, CAUSAL_ROWS_ATTR, None),
        "swiglu_fused": chunks["default"].config.bias_activation_fusion,
    }


@pytest.mark.slow
def test_mask_free_rows_give_the_masked_outputs_and_gradients():
    (r,) = run_on_ranks(_compare, 1, timeout_s=300)
    valid = r["valid"]
    # CPU defaults: no mask-free rows (a CUDA default), no compiled SwiGLU.
    assert r["flags"] == {"default": None, "masked": None, "free": 0}
    assert r["local_flag"] is None and r["swiglu_fused"] is False
    torch.testing.assert_close(r["out"]["free"][valid], r["out"]["masked"][valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r["out"]["masked"][valid], r["out"]["local"][valid], rtol=1e-5, atol=1e-5)
    # Only valid positions carry loss, so the gradients are the masked pass's.
    torch.testing.assert_close(r["grads"]["free"], r["grads"]["masked"], rtol=1e-4, atol=1e-5)
