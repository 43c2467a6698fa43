"""The CPU compatibility layer redirects CUDA-only calls and nothing else."""

import pytest
import torch

from rlhf_megatron.platform import get_backend, get_device, set_seed, setup_platform
from rlhf_megatron.platform.multiproc import RankFailedError, run_on_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compatibility layer is CPU-only")


def test_device_and_backend_on_cpu():
    assert setup_platform() == torch.device("cpu")
    assert get_device() == torch.device("cpu")
    assert get_backend() == "gloo"


def test_cuda_device_arguments_land_on_cpu():
    setup_platform()
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(1, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda:0").device.type == "cpu"
    assert torch.nn.Linear(2, 2).cuda().weight.device.type == "cpu"
    # dtype conversions and sizes are untouched
    assert torch.ones(2).to(torch.float16).dtype == torch.float16
    assert torch.ones(2).new_zeros(5).shape == (5,)


def test_every_factory_and_autograd_backward_allocate_on_cpu():
    setup_platform()
    x = torch.ones(2, 3)
    made = [
        torch.arange(3, device="cuda"),
        torch.full((2,), 1.0, device=0),
        torch.tensor([1], device="cuda:1"),
        torch.empty_like(x, device="cuda"),
        torch.zeros_like(x, device=torch.device("cuda")),
        torch.randn(2, device="cuda"),
        torch.eye(2, device="cuda"),
        torch.linspace(0, 1, 3, device="cuda"),
        x.new_empty(2, device="cuda"),
        x.new_tensor([1.0], device="cuda"),
        x.to(device="cuda"),
        x.to("cuda", torch.float64),
    ]
    assert all(t.device.type == "cpu" for t in made)
    assert made[-1].dtype == torch.float64

    class AllocatesInBackward(torch.autograd.Function):  # as megatron's collectives do
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, grad):
            return torch.ones(grad.shape, device=torch.cuda.current_device()) * grad

    y = torch.ones(3, requires_grad=True)
    AllocatesInBackward.apply(y).sum().backward()
    assert torch.equal(y.grad, torch.ones(3))


def test_the_layer_leaves_other_ops_alone():
    """No function mode intercepts every op (it cost ~3.4 us per op); device contexts and
    TorchScript still see the factories they know."""
    from torch.overrides import _get_current_function_mode_stack

    setup_platform()
    assert _get_current_function_mode_stack() == []
    with torch.device("meta"):  # transformers builds models under this
        assert torch.empty(2).device.type == "meta" and torch.arange(3).device.type == "meta"
        assert torch.tensor([1.0]).device.type == "meta"

    @torch.jit.script
    def scripted(n: int) -> torch.Tensor:
        return torch.zeros(n) + torch.arange(n)

    assert scripted(3).tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_wrapped_methods_compile_in_a_full_graph(backend):
    """vLLM compiles its model with fullgraph=True on CPU (enforce_eager off, EasyR1's default):
    a wrapped tensor method must not break the graph, and the device rewrite still holds."""
    setup_platform()

    def f(x):
        a = x.to(torch.float32) * 2 + x.to("cuda", dtype=torch.float32)
        b = x.new_zeros(4, device="cuda") + torch.zeros(4, device="cuda") + x.type(torch.float64)
        return a.sum() + b.sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    out = compiled(torch.ones(4, dtype=torch.bfloat16))
    assert out.device.type == "cpu" and out.item() == 16.0


def test_tensor_type_reports_cuda_names_only_without_arguments():
    setup_platform()
    x = torch.ones(2)
    assert x.type() == "torch.cuda.FloatTensor"
    assert x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
    assert x.type(torch.float64).dtype == torch.float64


def test_cuda_rng_redirects_to_cpu_generator():
    setup_platform()
    torch.cuda.manual_seed(5)
    state = torch.cuda.get_rng_state()
    a = torch.rand(3)
    torch.cuda.set_rng_state(state)
    torch.testing.assert_close(torch.rand(3), a)
    from megatron.core.tensor_parallel import random as mcore_random

    tracker = mcore_random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("test-stream", 11)
    with tracker.fork("test-stream"):
        b = torch.rand(3)
    tracker.reset()
    tracker.add("test-stream", 11)
    with tracker.fork("test-stream"):
        torch.testing.assert_close(torch.rand(3), b)


def test_set_seed_is_deterministic():
    set_seed(3)
    a = torch.randn(4)
    set_seed(3)
    torch.testing.assert_close(torch.randn(4), a)


def _fails_on_rank_one(rank, world_size):
    t = torch.tensor([float(rank)])
    torch.distributed.all_reduce(t)
    if rank == 1:
        raise ValueError("deliberate failure on rank one")
    return t.item()


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    torch.distributed.all_reduce(t)
    return t.item()


def test_run_on_ranks_returns_in_rank_order():
    assert run_on_ranks(_sum_ranks, 2, timeout_s=120) == [1.0, 1.0]


def test_run_on_ranks_names_the_failing_rank_with_traceback():
    with pytest.raises(RankFailedError, match="rank 1 of 2 failed") as err:
        run_on_ranks(_fails_on_rank_one, 2, timeout_s=120)
    assert err.value.rank == 1
    assert "deliberate failure on rank one" in str(err.value)
    assert "_fails_on_rank_one" in str(err.value)
