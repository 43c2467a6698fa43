"""``platform.fused_adam``: torch's fused AdamW switched on under megatron's optimizer wrappers."""

import types

import torch

from rlhf_megatron.platform.fused_adam import fuse_torch_adam


def _adamw(*params, **kwargs):
    return torch.optim.AdamW(list(params), lr=1e-2, weight_decay=0.1, **kwargs)


def test_switches_adamw_inside_megatron_wrappers_and_chains_and_gives_the_same_step():
    ps = [torch.randn(50, requires_grad=True) for _ in range(2)]
    qs = [p.detach().clone().requires_grad_() for p in ps]
    wrapped = types.SimpleNamespace(optimizer=_adamw(*ps))  # megatron's wrapper keeps .optimizer
    chained = types.SimpleNamespace(chained_optimizers=[wrapped, types.SimpleNamespace(optimizer=object())])
    assert fuse_torch_adam(chained) == 1
    assert wrapped.optimizer.param_groups[0]["fused"] is True
    plain = _adamw(*qs, foreach=False)
    grads = [torch.randn(50) for _ in ps]
    for opt, params in ((wrapped.optimizer, ps), (plain, qs)):
        for _ in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_leaves_other_optimizers_and_unsupported_devices_alone():
    p = torch.randn(4, requires_grad=True)
    sgd = torch.optim.SGD([p], lr=0.1)
    assert fuse_torch_adam(sgd) == 0
    adam = _adamw(p)
    assert fuse_torch_adam(adam, devices=("cuda",)) == 0  # CPU parameters, CUDA only asked for
    assert not adam.param_groups[0].get("fused")
