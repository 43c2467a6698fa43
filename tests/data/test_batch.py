"""Batch: construction checks, indexing, column selection, split/join, padding, pickling."""

import pickle

import numpy as np
import pytest
import torch

from rlhf_megatron.data.batch import Batch


def make_batch(n: int = 4) -> Batch:
    return Batch.from_dict(
        {"input_ids": torch.arange(n * 3).view(n, 3), "values": torch.arange(n, dtype=torch.float32)},
        {
            "data_source": [f"s{i}" for i in range(n)],
            "reward_model": [{"ground_truth": str(i)} for i in range(n)],
        },
        {"temperature": 1.0},
    )


def test_from_dict_lengths_and_keys():
    b = make_batch()
    assert len(b) == 4
    assert b.tensor_keys == ["input_ids", "values"]
    assert b.non_tensor_keys == ["data_source", "reward_model"]
    assert "values" in b and "reward_model" in b and "nope" not in b
    assert b["reward_model"][2] == {"ground_truth": "2"}
    assert b.meta_info == {"temperature": 1.0}


def test_length_mismatch_names_keys_and_lengths():
    with pytest.raises(ValueError, match=r"input_ids=3.*responses=2.*data_source=3"):
        Batch.from_dict(
            {"input_ids": torch.zeros(3, 2), "responses": torch.zeros(2, 2)}, {"data_source": ["a", "b", "c"]}
        )


def test_setitem_checks_length():
    b = make_batch()
    b["advantages"] = torch.ones(4, 2)
    b["uid"] = ["a", "b", "c", "d"]
    assert b.tensor_keys[-1] == "advantages" and b["uid"].dtype == object
    with pytest.raises(ValueError, match=r"'returns' has length 3.*4 rows"):
        b["returns"] = torch.ones(3, 2)


def test_list_of_lists_stays_one_object_per_row():
    b = Batch.from_dict({"x": torch.zeros(2)}, {"raw_prompt_ids": [[1, 2], [3, 4]]})
    assert b["raw_prompt_ids"].shape == (2,)
    assert b["raw_prompt_ids"][1] == [3, 4]


@pytest.mark.parametrize(
    "index",
    [
        [2, 0],
        np.array([2, 0]),
        torch.tensor([2, 0]),
        np.array([False, False, True, False]) | np.eye(4, dtype=bool)[0],
    ],
)
def test_getitem_index_and_reorder(index):
    b = make_batch()
    sub = b[index]
    expected = [0, 2] if isinstance(index, np.ndarray) and index.dtype == bool else [2, 0]
    assert torch.equal(sub["values"], torch.tensor(expected, dtype=torch.float32))
    assert list(sub["data_source"]) == [f"s{i}" for i in expected]
    assert sub.meta_info == b.meta_info


def test_getitem_int_and_slice():
    b = make_batch()
    row = b[-1]
    assert len(row) == 1 and row["input_ids"].shape == (1, 3) and row["data_source"][0] == "s3"
    assert len(b[1:3]) == 2 and b[1:3]["data_source"].tolist() == ["s1", "s2"]
    assert b[torch.tensor(2)]["data_source"].tolist() == ["s2"] and len(b[np.array([], dtype=int)]) == 0
    with pytest.raises(IndexError, match="out of range"):
        b[4]
    with pytest.raises(KeyError, match="no column 'nope'"):
        b["nope"]


def test_reorder_in_place():
    b = make_batch()
    b.reorder(torch.tensor([3, 2, 1, 0]))
    assert b["data_source"].tolist() == ["s3", "s2", "s1", "s0"]
    assert torch.equal(b["values"], torch.tensor([3.0, 2.0, 1.0, 0.0]))


def test_select_and_pop():
    b = make_batch()
    s = b.select(["values"], ["data_source"], [])
    assert s.keys() == ["values", "data_source"] and s.meta_info == {} and len(s) == 4
    popped = b.pop(keys=["values"], non_tensor_keys=["reward_model"])
    assert popped.keys() == ["values", "reward_model"]
    assert b.keys() == ["input_ids", "data_source"]
    with pytest.raises(KeyError, match="no tensor 'values'"):
        b.select(["values"])


def test_union_merges_and_detects_conflicts():
    b = make_batch()
    other = Batch.from_dict(
        {"values": b["values"].clone(), "advantages": torch.ones(4)}, meta_info={"step": 3}
    )
    u = b.union(other)
    assert set(u.keys()) == {"input_ids", "values", "advantages", "data_source", "reward_model"}
    assert u.meta_info == {"temperature": 1.0, "step": 3}
    with pytest.raises(ValueError, match="tensor 'values' differs"):
        b.union(Batch.from_dict({"values": torch.zeros(4)}))
    with pytest.raises(ValueError, match="non-tensor column 'data_source' differs"):
        b.union(Batch.from_dict(non_tensors={"data_source": ["x"] * 4}))
    with pytest.raises(ValueError, match=r"meta_info\['temperature'\] differs"):
        b.union(Batch(meta_info={"temperature": 0.5}))


def test_chunk_split_concat_roundtrip():
    b = make_batch(6)
    parts = b.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    joined = Batch.concat(parts)
    assert torch.equal(joined["input_ids"], b["input_ids"])
    assert joined["data_source"].tolist() == b["data_source"].tolist()
    uneven = b.split([1, 0, 5])
    assert [len(p) for p in uneven] == [1, 0, 5]
    assert all(p.meta_info == b.meta_info for p in uneven)


def test_chunk_and_split_errors_name_sizes():
    b = make_batch(5)
    with pytest.raises(ValueError, match=r"5 rows cannot be split into 2 equal chunks"):
        b.chunk(2)
    with pytest.raises(ValueError, match=r"sum 4.*batch size 5"):
        b.split([2, 2])


def test_concat_errors():
    b = make_batch(2)
    with pytest.raises(ValueError, match="empty list"):
        Batch.concat([])
    with pytest.raises(ValueError, match="batch 1 has columns"):
        Batch.concat([b, b.select(["values"], [])])
    wide = Batch.from_dict(
        {"input_ids": torch.zeros(2, 5, dtype=torch.long), "values": torch.zeros(2)}, b.non_tensors
    )
    with pytest.raises(
        ValueError, match=r"tensor 'input_ids' has incompatible shapes \[\(2, 3\), \(2, 5\)\]"
    ):
        Batch.concat([b, wide])


def test_repeat_interleave_and_tile():
    b = make_batch(2)
    assert b.repeat(3)["data_source"].tolist() == ["s0", "s0", "s0", "s1", "s1", "s1"]
    assert b.repeat(2, interleave=False)["data_source"].tolist() == ["s0", "s1", "s0", "s1"]
    assert torch.equal(b.repeat(2)["values"], torch.tensor([0.0, 0.0, 1.0, 1.0]))


def test_pad_to_divisor_and_unpad():
    b = make_batch(5)
    padded, pad = b.pad_to_divisor(4)
    assert pad == 3 and len(padded) == 8
    assert padded["data_source"].tolist()[5:] == ["s0", "s1", "s2"]
    restored = padded.unpad(pad)
    assert torch.equal(restored["input_ids"], b["input_ids"])
    same, zero = b.pad_to_divisor(5)
    assert zero == 0 and same is b
    tiny, pad = make_batch(1).pad_to_divisor(4)  # fewer rows than the padding: copies cycle
    assert pad == 3 and tiny["data_source"].tolist() == ["s0"] * 4


def test_pickle_roundtrip_and_to():
    b = make_batch()
    restored = pickle.loads(pickle.dumps(b))
    assert torch.equal(restored["input_ids"], b["input_ids"])
    assert restored["reward_model"].tolist() == b["reward_model"].tolist()
    assert restored.meta_info == b.meta_info and len(restored) == len(b)
    moved = b.to("cpu")
    assert moved["values"].device.type == "cpu" and moved["data_source"] is b["data_source"]


def test_pickle_sends_cpu_tensors_as_numpy_buffers_and_restores_them_exactly():
    import ray.cloudpickle

    b = make_batch()
    b["bf16"] = torch.randn(len(b), 3).bfloat16()  # numpy has no bfloat16: torch pickles it
    b["flags"] = torch.rand(len(b), 2) > 0.5
    part = b[2:4]  # a view: only its rows travel
    for data in (pickle.dumps(part, protocol=5), ray.cloudpickle.dumps(part, protocol=5)):
        restored = pickle.loads(data)
        assert restored.tensor_keys == part.tensor_keys and len(restored) == len(part) == 2
        for key in part.tensor_keys:
            assert restored[key].dtype == part[key].dtype and torch.equal(restored[key], part[key]), key
        assert restored.non_tensor_keys == part.non_tensor_keys and restored.meta_info == part.meta_info
    assert len(pickle.dumps(part, protocol=5)) < len(pickle.dumps(b, protocol=5))


def test_unpickled_tensors_are_writable_even_from_read_only_buffers():
    b = make_batch()
    buffers = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    # Ray hands out-of-band buffers back read-only (its shared-memory object store)
    restored = pickle.loads(data, buffers=[memoryview(bytes(buf.raw())) for buf in buffers])
    restored["input_ids"][0, 0] = -7
    assert int(restored["input_ids"][0, 0]) == -7 and int(b["input_ids"][0, 0]) != -7


def test_columnless_batch_keeps_length_through_ops():
    b = make_batch().select([], [], ["temperature"])
    assert len(b) == 4 and b.keys() == []
    assert len(b[1:3]) == 2 and len(Batch.concat([b, b])) == 8


def test_not_iterable():
    with pytest.raises(TypeError, match="not iterable"):
        list(make_batch())
