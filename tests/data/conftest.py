"""Fixtures for the data tests: the tiny tokenizer and helpers that write verl-format parquet."""

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
