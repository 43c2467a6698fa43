"""Fixtures for the data tests: the tiny tokenizer, helpers that write verl-format parquet, and a
tiny Qwen2.5-VL checkpoint directory (processor + config.json) for the multimodal tests."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_megatron.data.preprocess import arith_row
from rlhf_megatron.data.tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def write_parquet(tmp_path):
    """write_parquet(rows_or_table, name) -> path of a parquet file under tmp_path."""

    def write(rows, name: str = "data.parquet") -> str:
        table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows)
        path = str(tmp_path / name)
        pq.write_table(table, path)
        return path

    return write


@pytest.fixture
def arith_rows():
    """Five arith rows in verl's layout: '0+0=' ... '4+4='."""
    return [arith_row(f"{i}+{i}=", str(2 * i), "train", index=100 + i) for i in range(5)]


@pytest.fixture(scope="session")
def vl_model_dir(tmp_path_factory):
    """A tiny Qwen2.5-VL checkpoint directory: processor files and config.json, no weights."""
    from vl_helpers import write_tiny_vl_model

    return write_tiny_vl_model(tmp_path_factory.mktemp("tiny_qwen2_5_vl"))


@pytest.fixture(scope="session")
def vision(vl_model_dir):
    """`load_vision_processor` of the tiny checkpoint."""
    from rlhf_megatron.data.multimodal import load_vision_processor

    return load_vision_processor(vl_model_dir)
