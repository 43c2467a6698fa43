"""Transports: CUDA IPC hand-off between processes on one GPU (gpu), refused clearly without CUDA."""

import pytest
import torch
import torch.multiprocessing as mp

from rlhf_megatron.weights import CudaIpcTransport


def test_cuda_ipc_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="CudaIpcTransport needs CUDA"):
        CudaIpcTransport()


def _open_and_sum(handle, out):
    out.put(float(CudaIpcTransport.open(handle).sum()))


@pytest.mark.gpu
def test_cuda_ipc_round_trip_between_processes():
    CudaIpcTransport()
    tensor = torch.arange(1024, dtype=torch.float32, device="cuda")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_open_and_sum, args=(CudaIpcTransport.export(tensor), out))
    proc.start()
    assert out.get(timeout=120) == float(tensor.sum())
    proc.join(timeout=60)
