"""torch's fused AdamW kernel under megatron-core's optimizer, on CPU and on CUDA.

Without transformer-engine or apex, megatron-core 0.16 builds ``torch.optim.AdamW`` with torch's
defaults: on CUDA the multi-tensor (``foreach``) path, a dozen kernels per parameter group and a
pass over the state for each; on CPU one elementwise op at a time. torch's fused kernel does the
whole update in one pass per parameter (on CPU ~5x faster; on CUDA measured by
``tools/gpu/mfu.py``). megatron has no switch for it, but the kernel reads the flag from each
parameter group at every step, so setting it after the optimizer is built is enough.

Boundaries: torch optimizers only; knows nothing of configs or roles.
"""

from __future__ import annotations

import torch

__all__ = ["fuse_torch_adam"]

FUSED_DEVICES = ("cpu", "cuda")
"""Device types with a fused AdamW kernel in torch."""


def fuse_torch_adam(optimizer, devices: tuple[str, ...] = FUSED_DEVICES) -> int:
    """Switch every ``torch.optim.AdamW`` under ``optimizer`` (a megatron optimizer, chained or not,
    or a torch one) whose parameters are floating point on one device type of ``devices`` to
    torch's fused kernel. Returns how many optimizers were switched."""
    switched = 0
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", opt)
        if not isinstance(inner, torch.optim.AdamW):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        kinds = {p.device.type for p in params}
        if not params or len(kinds) != 1 or kinds.pop() not in devices:
            continue
        if not all(p.is_floating_point() for p in params):
            continue
        for group in inner.param_groups:
            group["fused"], group["foreach"] = True, False
        inner.defaults["fused"], inner.defaults["foreach"] = True, False
        switched += 1
    return switched
