"""Peak memory of a weight sync: about one bucket, not the model (issue #7, "Memory").

Two fresh gloo ranks (TP=2 actor, vLLM at rollout TP=2, ``load_format=hf``)
sync a 152M-parameter Llama (580 MiB in float32: 12 layers, hidden 1024,
GQA 8/2 heads, FFN 2816, vocabulary 8192) with 128 MiB buckets, while a
thread samples each rank's RSS every millisecond
(``tools/bench_weight_sync.py`` does the measuring; its 500M-parameter run is
where the issue's numbers come from). TP=2 because that is where the syncer
allocates: at TP=1 the hf stream is views of the actor's own parameters.
Size: the largest that keeps this test under ~90 s and ~8 GB on 2 CPU
cores, the naive control below included (it holds a full extra model copy
on each rank).

The bound, per rank, above the RSS just before the sync:

    largest bucket + largest tensor + allowance
    allowance = 2 × largest tensor + 16 MiB

- largest bucket: the converted tensors the syncer holds while vLLM consumes
  them (the plan's byte count of its largest bucket).
- largest tensor: the one being gathered; gloo's all-gather writes into a
  buffer of its own before the output, so a gather briefly holds twice the
  tensor.
- allowance, vLLM's own buffers: its in-place reload re-materialises each
  layer and repacks it for oneDNN (≤ two copies of the layer's per-rank
  slice), and its ``WeightsMapper.apply`` keeps the last fused q/k/v or
  gate/up tensor it saw in a local variable until the next one arrives,
  which pins that tensor's gathered source into the next bucket. 16 MiB
  covers allocator and gloo noise.

Measured (2 CPU cores, vLLM 0.32, per rank): peak 163 MiB against a bound of
236 MiB (bucket 124 + largest tensor 32 + allowance 80); the naive control
~650 MiB; the model 580 MiB. Holding the previous bucket's gathered tensors
while gathering the next one (fixed in ``execute.py``) measured 265 MiB,
which this bound catches: its slack (~70 MiB) is under one bucket.

RSS is only meaningful for this with a fixed glibc mmap threshold (1 MiB):
by default glibc keeps freed blocks of up to 32 MiB resident for reuse, and
RSS then grows with dead tensors (by ~300 MB over one sync here).

The control: the same sync with one bucket holding the whole model, i.e. a
naive full materialisation, must exceed the bound, and the bound itself is
under half the model's bytes, so the check cannot pass by accident.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

from rlhf_megatron.platform.multiproc import run_on_ranks

HERE = str(Path(__file__).resolve().parent)
TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_weight_sync.py"
ENV = {"PYTHONPATH": HERE, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
MODEL = dict(layers=12, hidden=1024, heads=8, kv_heads=2, ffn=2816, vocab=8192)
MIB = 2**20
BUCKET_BYTES = 128 * MIB
pytestmark = pytest.mark.slow


def _bench():
    """tools/bench_weight_sync.py as a module (tools/ is not a package)."""
    if "bench_weight_sync" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_weight_sync", TOOL)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_weight_sync"]


def allowance(largest_tensor_bytes: int) -> int:
    """vLLM's reload buffers plus noise (see the module docstring)."""
    return 2 * largest_tensor_bytes + 16 * MIB


def _measure(rank, world_size, hf_dir, bucket_bytes, naive_bucket_bytes):
    import torch

    bench = _bench()
    bench.set_malloc_mmap_threshold(MIB)
    torch.set_num_threads(1)
    arch, chunks, info, groups, engine = bench.build_actor_and_engine(hf_dir, world_size, "float32", "hf")
    try:
        streaming, _ = bench.make_syncer(arch, chunks, info, groups, world_size, "hf", bucket_bytes)
        naive, _ = bench.make_syncer(arch, chunks, info, groups, world_size, "hf", naive_bucket_bytes)
        summary = streaming.plan.summary()
        return {
            "streaming": bench.measure_sync(engine, streaming, sample_s=0.001),
            "naive": bench.measure_sync(engine, naive, sample_s=0.001),
            "max_bucket_bytes": summary["max_bucket_bytes"],
            "buckets": summary["buckets"],
            "largest_tensor_bytes": max(t.nbytes(4) for t in streaming.plan.transfers),
        }
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync_memory") / "llama"
    return str(_bench().write_random_checkpoint(out, shard_bytes=256 * MIB, **MODEL))


def test_sync_peak_memory_is_one_bucket_not_the_model(model_dir):
    from rlhf_megatron.models.spec import expected_hf_shapes
    from rlhf_megatron.planning.model_arch import ModelArch

    arch = ModelArch.from_hf_dir(model_dir)
    model_bytes = 4 * sum(_bench().numel(s) for s in expected_hf_shapes(arch).values())
    results = run_on_ranks(_measure, 2, model_dir, BUCKET_BYTES, 2 * model_bytes, env=ENV, timeout_s=240)
    for rank, r in enumerate(results):
        stream, naive = r["streaming"], r["naive"]
        largest = r["largest_tensor_bytes"]
        bound = r["max_bucket_bytes"] + largest + allowance(largest)
        numbers = (
            f"rank {rank}: peak {stream['peak_extra_bytes'] / MIB:.0f} MiB (after {stream['peak_after_tensor']}), "
            f"bound {bound / MIB:.0f} MiB = bucket {r['max_bucket_bytes'] / MIB:.0f} + largest tensor "
            f"{largest / MIB:.0f} + allowance {allowance(largest) / MIB:.0f}; naive "
            f"{naive['peak_extra_bytes'] / MIB:.0f} MiB; model {model_bytes / MIB:.0f} MiB"
        )
        print(numbers)
        assert r["max_bucket_bytes"] <= model_bytes / 4, numbers  # buckets much smaller than the model
        assert bound < model_bytes / 2, numbers
        assert stream["peak_extra_bytes"] <= bound, numbers
        # The sampler does see a full materialisation: one bucket for the whole model blows the bound.
        assert naive["peak_extra_bytes"] >= 0.9 * model_bytes, numbers
        assert naive["peak_extra_bytes"] > bound, numbers
