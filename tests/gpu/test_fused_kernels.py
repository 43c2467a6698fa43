"""torch's fused kernels under megatron's local layers on one CUDA device (issue #38).

Marked ``gpu``: skipped where CUDA is absent (CI); run on a GPU machine (``tools/gpu/run.sh``).
Covers what the CPU suite cannot: sdpa attention on contiguous rows really runs torch's flash
kernel and gives the masked pass's outputs; the compiled SwiGLU gives the eager one's; the fused
AdamW step equals the multi-tensor one.
"""

import pytest
import torch

from rlhf_megatron.models.forward import position_ids_from_mask

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl():
    from rlhf_megatron.platform import destroy_distributed, init_distributed, init_model_parallel
    from rlhf_megatron.platform.multiproc import find_free_port

    init_distributed(0, 1, "127.0.0.1", find_free_port())
    init_model_parallel(1, 1, seed=1)
    yield
    destroy_distributed()


def _model(causal_rows: int | None, fuse_swiglu: bool):
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model

    (chunk,) = build_gpt_model(
        _arch(),
        ParallelConfig(1),
        params_dtype=torch.bfloat16,
        use_te=False,
        attention_backend="sdpa",
        causal_rows=causal_rows,
        fuse_swiglu=fuse_swiglu,
    )
    return chunk


def _arch():
    """A tiny Llama with grouped KV heads (4 query / 2 KV), head dim 64."""
    from rlhf_megatron.models.tiny import build_tiny_hf_model
    from rlhf_megatron.planning.model_arch import ModelArch

    model, _ = build_tiny_hf_model(
        "llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, ffn_hidden_size=512
    )
    config = model.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    return ModelArch.from_hf_config(config)


def _rows(seed=0, rows=4, seq=64):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(rows, seq, dtype=torch.long)
    for i in range(rows):
        mask[i, : 5 * i] = 0  # left padding
        mask[i, seq - 3 * i :] = 0  # right padding
    ids = torch.randint(3, 100, (rows, seq), generator=g) * mask
    return ids.cuda(), mask.cuda(), position_ids_from_mask(mask).cuda()


def _kernels(fn) -> list[str]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name.lower() for e in prof.events() if e.device_type == DeviceType.CUDA]


def test_contiguous_rows_run_flash_attention_and_match_the_masked_pass(nccl):
    from rlhf_megatron.models.forward import model_forward

    ids, mask, pos = _rows()
    masked, mask_free = _model(None, False), _model(0, False)
    mask_free.load_state_dict(masked.state_dict())
    with torch.no_grad():
        ref = model_forward(masked, ids, mask, pos).float()
        out = model_forward(mask_free, ids, mask, pos).float()
        kernels = _kernels(lambda: model_forward(mask_free, ids, mask, pos))
    assert any("flash" in k for k in kernels), sorted(set(kernels))[:40]
    valid = mask.bool()
    err = (out - ref)[valid].norm() / ref[valid].norm()
    assert err < 2e-2, err  # bf16 operands, different kernels
    assert torch.equal(out.argmax(-1)[valid], ref.argmax(-1)[valid]) or err < 5e-3


def test_compiled_swiglu_matches_eager_forward_and_backward(nccl):
    ids, mask, pos = _rows(seed=1)
    eager, fused = _model(0, False), _model(0, True)
    fused.load_state_dict(eager.state_dict())
    from rlhf_megatron.models.forward import model_forward

    outs, grads = [], []
    for chunk in (eager, fused):
        out = model_forward(chunk, ids, mask, pos).float()
        (out[mask.bool()].logsumexp(-1).sum()).backward()
        outs.append(out.detach())
        grads.append(torch.cat([p.grad.float().flatten() for p in chunk.parameters()]))
    assert (outs[1] - outs[0]).norm() / outs[0].norm() < 1e-2
    assert (grads[1] - grads[0]).norm() / grads[0].norm() < 3e-2


def test_fused_adamw_step_equals_the_foreach_step():
    from rlhf_megatron.platform.fused_adam import fuse_torch_adam

    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(1000, device="cuda", generator=g) for _ in range(3)]
    grads = [torch.randn(1000, device="cuda", generator=g) for _ in range(3)]
    results = []
    for fused in (False, True):
        ps = [p.clone().requires_grad_() for p in params]
        opt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True)
        if fused:
            assert fuse_torch_adam(opt) == 1
        for _ in range(3):
            for p, grad in zip(ps, grads):
                p.grad = grad.clone()
            opt.step()
        assert bool(opt.param_groups[0]["fused"]) is fused
        results.append(torch.cat([p.detach() for p in ps]))
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)
