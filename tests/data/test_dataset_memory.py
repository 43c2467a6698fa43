"""RLHFDataset keeps rows in Arrow: loading 1M short prompts costs about their Arrow size in RSS."""

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROWS = 1_000_000

# Run in a fresh interpreter so the RSS difference is the dataset's alone. A tiny parquet read
# first pays the one-off costs (lazy imports, thread pools) that do not grow with the data.
MEASURE = """
import gc, json, sys
import psutil, pyarrow as pa, pyarrow.parquet as pq
from rlhf_megatron.config.schema import DataConfig
from rlhf_megatron.data.dataset import RLHFDataset
from rlhf_megatron.data.tokenizer import build_tiny_tokenizer
tok = build_tiny_tokenizer()
warm = RLHFDataset(sys.argv[2], tok, DataConfig(max_prompt_length=16)); warm[0]
gc.collect()
proc = psutil.Process()
before = proc.memory_info().rss
ds = RLHFDataset(sys.argv[1], tok, DataConfig(max_prompt_length=16))
item = ds[len(ds) - 1]
gc.collect()
growth = proc.memory_info().rss - before
raw = sum(t.nbytes for t in ds._tables)
print(json.dumps({"rows": len(ds), "growth": growth, "raw": raw, "index": item["index"]}))
"""


def build_table(n: int) -> pa.Table:
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 100, n).tolist(), rng.integers(0, 100, n).tolist()
    messages = pa.StructArray.from_arrays(
        [pa.array(["user"] * n), pa.array([f"{x}+{y}=" for x, y in zip(a, b)])], names=["role", "content"]
    )
    prompt = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), messages)
    reward_model = pa.StructArray.from_arrays(
        [pa.array(["rule"] * n), pa.array([str(x + y) for x, y in zip(a, b)])],
        names=["style", "ground_truth"],
    )
    extra_info = pa.StructArray.from_arrays(
        [pa.array(["train"] * n), pa.array(np.arange(n))], names=["split", "index"]
    )
    return pa.table(
        {
            "data_source": pa.array(["arith"] * n),
            "prompt": prompt,
            "reward_model": reward_model,
            "extra_info": extra_info,
        }
    )


def test_loading_a_million_rows_costs_about_their_arrow_size(tmp_path):
    big, small = str(tmp_path / "big.parquet"), str(tmp_path / "small.parquet")
    table = build_table(ROWS)
    pq.write_table(table, big)
    pq.write_table(table.slice(0, 10), small)
    del table
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, big, small], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    ratio = stats["growth"] / stats["raw"]
    print(
        f"rows={stats['rows']} arrow={stats['raw'] / 1e6:.1f} MB rss_growth={stats['growth'] / 1e6:.1f} MB ratio={ratio:.2f}"
    )
    assert stats["rows"] == ROWS and stats["index"] == ROWS - 1
    assert ratio <= 2.0
