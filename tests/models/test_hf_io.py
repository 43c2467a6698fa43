"""HF safetensors directories: validation, sliced reads, streaming shard writer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from rlhf_megatron.models.hf_io import INDEX_FILE, HFCheckpoint, HFCheckpointError, SafetensorsShardWriter

from . import tiny_hf


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    model = tiny_hf.make_hf_model("llama")
    out = tiny_hf.save_hf_model(model, tmp_path_factory.mktemp("hf") / "llama", max_shard_size="200KB")
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_index_shapes_and_sliced_reads(sharded):
    hf_dir, state = sharded
    ckpt = HFCheckpoint(hf_dir)
    assert len(list(hf_dir.glob("*.safetensors"))) > 3  # really sharded
    assert set(ckpt.names()) == set(state)
    name = "model.layers.1.mlp.down_proj.weight"
    assert ckpt.shape(name) == tuple(state[name].shape) and ckpt.dtype(name) == torch.float32
    assert torch.equal(ckpt.read(name), state[name])
    assert torch.equal(ckpt.read(name, 1, 64, 128), state[name][:, 64:128])
    assert torch.equal(ckpt.read(name, 0, 10, 20), state[name][10:20])
    assert "model-000" in ckpt.where(name)


def _copy(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_missing_shard_is_named(sharded, tmp_path):
    hf_dir = _copy(sharded[0], tmp_path / "broken")
    victim = sorted(hf_dir.glob("model-*.safetensors"))[2]
    victim.unlink()
    with pytest.raises(HFCheckpointError, match=f"{INDEX_FILE} references 1 missing shard.*{victim.name}"):
        HFCheckpoint(hf_dir)


def test_index_pointing_at_the_wrong_shard_and_truncation_are_named(sharded, tmp_path):
    hf_dir = _copy(sharded[0], tmp_path / "wrong-index")
    index = json.loads((hf_dir / INDEX_FILE).read_text())
    name, file = next(iter(index["weight_map"].items()))
    other = next(f for f in index["weight_map"].values() if f != file)
    index["weight_map"][name] = other
    (hf_dir / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError, match=f"maps tensor {name} to {other}"):
        HFCheckpoint(hf_dir)

    hf_dir = _copy(sharded[0], tmp_path / "truncated")
    shard = sorted(hf_dir.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(HFCheckpointError, match=f"{shard.name} is truncated"):
        HFCheckpoint(hf_dir)


def test_no_weights_is_an_error(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(HFCheckpointError, match=r"convert PyTorch \.bin weights"):
        HFCheckpoint(tmp_path)


def test_streaming_writer_shards_and_round_trips(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(8, 16 + i, generator=g) for i in range(5)}
    tensors["b"] = torch.randn(3, generator=g)
    plan = [(n, t.shape, torch.bfloat16) for n, t in tensors.items()]
    writer = SafetensorsShardWriter(tmp_path, plan, max_shard_bytes=700)
    for n, t in tensors.items():
        writer.write(n, t)
    files = writer.close()
    assert len(files) > 1 and all((tmp_path / f).is_file() for f in files)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(tensors)
    for n, t in tensors.items():
        with safe_open(str(tmp_path / index["weight_map"][n]), "pt") as f:
            assert torch.equal(f.get_tensor(n), t.to(torch.bfloat16))
    assert torch.equal(HFCheckpoint(tmp_path).read("t3"), tensors["t3"].to(torch.bfloat16))


def test_streaming_writer_checks_order_and_completeness(tmp_path):
    plan = [("a", (2,), torch.float32), ("b", (3,), torch.float32)]
    writer = SafetensorsShardWriter(tmp_path, plan)
    with pytest.raises(RuntimeError, match="expected a \\[2\\] next, got b"):
        writer.write("b", torch.zeros(3))
    writer.write("a", torch.zeros(2))
    with pytest.raises(RuntimeError, match="never arrived: \\['b'\\]"):
        writer.close()
