"""megatron-core 0.16 on CPU over gloo, without touching site-packages.

megatron-core assumes CUDA in a handful of places that have nothing to do with
the maths. This module redirects exactly those places to the CPU, so the real
megatron-core (GPTModel, tensor/pipeline parallel layers, DDP, the optimizers,
the forward-backward schedules) runs unchanged on a CPU-only machine. It is
switched on by ``rlhf_megatron.platform.setup_platform()`` only when CUDA is
absent; on a GPU machine none of it is applied.

Patches, one by one, with the reason for each:

1. ``torch.cuda.current_device`` returns 0 and ``torch.cuda.device_count``
   returns 1.
   Megatron reads the current device to build tensors
   (``device=torch.cuda.current_device()``) and to size process groups. 0 is
   the only sensible answer for "one device per process"; patch 3 turns the
   resulting ``cuda:0`` into ``cpu``.
2. ``torch.cuda.synchronize``, ``empty_cache`` and ``set_device`` are no-ops.
   CPU kernels are synchronous and there is no device cache or device to pick.
3. Tensor factories (``torch.empty``/``zeros``/``ones``/``full``/``tensor``/``arange``/...,
   their ``*_like`` forms and ``Tensor.new_*``) and ``Tensor.to``/``Module.to`` rewrite a
   ``device`` that names CUDA (``"cuda"``, ``"cuda:1"``, an int, ``torch.device("cuda")``)
   to ``cpu``; ``Tensor.cuda()`` and ``Module.cuda()`` return the object itself. Megatron
   allocates parameters, buffers, pipeline receive buffers and RoPE frequencies directly on
   ``cuda``; there are too many call sites to patch one by one, but every one of them goes
   through a factory or ``to``. Only those calls pay the wrapper's Python (under a
   microsecond); a ``TorchFunctionMode`` catching every torch call (what this layer used
   first) added ~3.4 us to *every* op, about a sixth of a small model's training step.
   The wrapped tensor methods are registered with ``torch.compiler.allow_in_graph``: vLLM
   compiles its model with ``fullgraph=True`` when ``enforce_eager`` is off, and Dynamo cannot
   trace a Python wrapper that forwards to a C method.
4. ``torch.cuda.get_rng_state``, ``set_rng_state`` and ``manual_seed`` act
   on the CPU generator, and megatron's own
   ``tensor_parallel.random._get_cuda_rng_state``/``_set_cuda_rng_state`` do
   the same.
   Megatron's ``CudaRNGStatesTracker`` forks the "CUDA" RNG so that dropout and
   initialisation differ across TP ranks but agree across DP ranks. On CPU the
   CPU generator plays that role, and the tracker's fork/restore logic stays
   exactly as written.
5. ``Tensor.type()`` called with no argument reports the CUDA type name for CPU
   tensors (``torch.cuda.FloatTensor`` for a CPU float32 tensor).
   ``clip_grad_by_total_norm_fp32``, ``Float16OptimizerWithFloat16Params`` and
   ``DistributedOptimizer`` assert ``param.type() == 'torch.cuda.FloatTensor'``
   to decide how to treat a parameter; the answer is the same on CPU once the
   device is set aside. ``Tensor.type(dtype)`` (conversion) is untouched.
6. ``torch.cuda.Stream``/``Event``/``current_stream``/``stream`` become inert
   CPU stand-ins.
   Megatron DDP creates a communication stream and records events around
   gradient all-reduce; on CPU every op is already ordered in program order, so
   "waiting" is always satisfied.
7. ``torch.cuda.nvtx.range_push``/``range_pop`` are no-ops (profiling markers).

What this layer does *not* fix and callers must do themselves:

- Pass an explicit attention mask to ``GPTModel.forward``:
  ``megatron.core.transformer.utils.get_default_causal_mask`` hard-codes
  ``device="cuda"`` inside an ``lru_cache``d helper; ``rlhf_megatron.models`` always builds
  the mask itself.
- Fused kernels (transformer-engine, apex) are GPU-only; on CPU models use
  megatron's local layer spec.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

_lock = threading.Lock()
_enabled = False

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.int8: "torch.cuda.CharTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _to_cpu_device(device):
    """Map any CUDA device spec to ``cpu``; leave everything else unchanged."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str):
        return "cpu" if device.startswith("cuda") else device
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    return device


# Tensor factories that take ``device=`` (patch 3): every megatron allocation goes through one.
_FACTORIES = (
    "empty",
    "empty_like",
    "empty_strided",
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "full",
    "full_like",
    "tensor",
    "as_tensor",
    "asarray",
    "scalar_tensor",
    "arange",
    "range",
    "linspace",
    "logspace",
    "eye",
    "rand",
    "rand_like",
    "randn",
    "randn_like",
    "randint",
    "randint_like",
    "randperm",
    "tril_indices",
    "triu_indices",
    "sparse_coo_tensor",
)
_TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def _on_cpu(fn):
    """``fn`` with a CUDA ``device=`` keyword turned into ``cpu`` (factories take it by keyword only)."""

    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return factory


def _wrap_factories() -> None:
    """Replace ``torch.<factory>`` by ``_on_cpu`` wrappers. torch keeps two registries of these
    functions, filled lazily from ``torch.<name>`` and looked up by identity: the device context
    manager's constructors (``with torch.device("meta")``, which transformers loads models under)
    and TorchScript's builtin table. Fill both with the originals first (a wrapper in the first
    would switch the context manager off for that factory), then teach TorchScript the wrappers."""
    from torch.jit import _builtins
    from torch.utils._device import _device_constructors

    _device_constructors()
    table = _builtins._get_builtin_table()
    for name in _FACTORIES:
        original = getattr(torch, name)
        wrapper = _on_cpu(original)
        if id(original) in table:
            _builtins._register_builtin(wrapper, table[id(original)])
        setattr(torch, name, wrapper)


def _tensor_to(self, *args, **kwargs):
    if args:
        args = tuple(_to_cpu_device(a) for a in args)
    if "device" in kwargs:
        kwargs["device"] = _to_cpu_device(kwargs["device"])
    return _ORIGINALS["Tensor.to"](self, *args, **kwargs)


class _InertStream:
    """CPU stand-in for ``torch.cuda.Stream``: every wait is already satisfied (patch 6)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _InertEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _InertEvent:
    """CPU stand-in for ``torch.cuda.Event`` (patch 6)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _tensor_type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
        return _CUDA_TYPE_NAMES[self.dtype]
    if dtype is None and not kwargs:
        return _ORIGINALS["Tensor.type"](self)
    return _ORIGINALS["Tensor.type"](self, dtype, non_blocking, **kwargs)


def _module_to(self, *args, **kwargs):
    args = tuple(_to_cpu_device(a) for a in args)
    if "device" in kwargs:
        kwargs["device"] = _to_cpu_device(kwargs["device"])
    return _ORIGINALS["Module.to"](self, *args, **kwargs)


_ORIGINALS: dict[str, object] = {}


def _cpu_get_rng_state(device="cuda", *args, **kwargs):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, *args, **kwargs):
    torch.set_rng_state(new_state.cpu() if hasattr(new_state, "cpu") else new_state)


def _cpu_manual_seed(seed):
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, which would recurse.
    torch.default_generator.manual_seed(int(seed))


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state


def _keep_compilable() -> None:
    """Let torch.compile put the wrapped tensor methods in its graph as calls (vLLM compiles its
    model with fullgraph=True on CPU too): Dynamo would otherwise trace into the wrapper and stop
    at the C method it forwards to. AOT tracing still runs the wrapper, so the device rewrite
    holds inside compiled code."""
    for method in (
        torch.Tensor.to,
        torch.Tensor.type,
        *(getattr(torch.Tensor, n) for n in _TENSOR_FACTORIES),
    ):
        torch.compiler.allow_in_graph(method)


def enable_cpu_compat() -> None:
    """Apply every patch listed in the module docstring. Idempotent, process-wide."""
    global _enabled
    with _lock:
        if _enabled:
            return
        if torch.cuda.is_available():
            raise RuntimeError(
                "enable_cpu_compat() is for CPU-only machines, but CUDA is available. "
                "Use rlhf_megatron.platform.setup_platform(), which picks the right mode."
            )
        cuda = torch.cuda
        _ORIGINALS["Tensor.type"] = torch.Tensor.type
        _ORIGINALS["Module.to"] = torch.nn.Module.to
        _ORIGINALS["Tensor.to"] = torch.Tensor.to
        # 1, 2
        cuda.current_device = lambda: 0
        cuda.device_count = lambda: 1
        cuda.synchronize = lambda *a, **k: None
        cuda.empty_cache = lambda *a, **k: None
        cuda.set_device = lambda *a, **k: None
        # 3
        _wrap_factories()
        for name in _TENSOR_FACTORIES:
            setattr(torch.Tensor, name, _on_cpu(getattr(torch.Tensor, name)))
        torch.Tensor.to = _tensor_to
        torch.Tensor.cuda = lambda self, *a, **k: self
        torch.nn.Module.cuda = lambda self, *a, **k: self
        torch.nn.Module.to = _module_to
        # 4
        cuda.get_rng_state = _cpu_get_rng_state
        cuda.set_rng_state = _cpu_set_rng_state
        cuda.manual_seed = _cpu_manual_seed
        cuda.random.get_rng_state = _cpu_get_rng_state
        cuda.random.set_rng_state = _cpu_set_rng_state
        _patch_megatron_rng()
        # 5
        torch.Tensor.type = _tensor_type
        _keep_compilable()
        # 6
        cuda.Stream = _InertStream
        cuda.Event = _InertEvent
        cuda.current_stream = lambda *a, **k: _InertStream()
        cuda.default_stream = lambda *a, **k: _InertStream()
        cuda.stream = lambda *a, **k: contextlib.nullcontext()
        # 7
        cuda.nvtx.range_push = lambda *a, **k: None
        cuda.nvtx.range_pop = lambda *a, **k: None
        _enabled = True


def cpu_compat_enabled() -> bool:
    return _enabled
