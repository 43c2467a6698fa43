"""tools/bench_weight_sync.py --moe: a tiny Qwen3-MoE synced at EP=1 and EP=2, next to a dense model
of the same bytes, reported in the dense run's JSON fields plus ``ratio_to_dense``.

Runs the tool as a script (its ranks are spawned processes, which need an importable entry point):
four launches of the actor and the in-process vLLM engine (MoE and dense, at 1 and 2 ranks), about
a minute and a half on 2 CPU cores.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_weight_sync.py"
TINY = [
    "--layers",
    "2",
    "--hidden",
    "256",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--vocab",
    "512",
    "--experts",
    "4",
    "--top-k",
    "2",
    "--expert-ffn",
    "64",
]
RUN_FIELDS = (
    "tp",
    "ep",
    "world_size",
    "load_format",
    "seconds",
    "floor_s",
    "total_over_floor",
    "copy_bandwidth_gb_per_s",
    "first_touch_gb_per_s",
    "peak_extra_bytes",
    "peak_bucket_bytes",
    "largest_tensor_bytes",
    "buckets",
    "warmup_total_s",
    "torch_threads_per_rank",
    "vllm_dtype",
    "ranks",
)
SECONDS = ("plan_s", "gather_s", "broadcast_s", "convert_s", "generator_s", "load_s", "total_s")


@pytest.mark.slow
def test_moe_reports_ep1_and_ep2_against_a_dense_model_of_the_same_bytes():
    # A short TMPDIR: vLLM binds ZeroMQ IPC sockets under it, and a socket path is at most 107
    # characters (pytest-xdist's per-worker tmp_path is too deep).
    with tempfile.TemporaryDirectory(prefix="bws-", dir="/tmp") as tmp:
        _check_moe_report(Path(tmp))


def _check_moe_report(tmp: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--moe", *TINY, "--timeout-s", "300"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)  # the only thing on stdout
    moe, dense = result["model"], result["dense_same_bytes"]["model"]
    assert moe["architecture"] == "Qwen3MoeForCausalLM" and moe["experts"] == 4 and moe["top_k"] == 2
    assert dense["architecture"] == "LlamaForCausalLM"
    assert moe["bytes"] == 4 * moe["params"] > 0
    assert abs(dense["bytes"] - moe["bytes"]) <= 0.05 * moe["bytes"], (dense, moe)
    assert 0 < moe["expert_params"] < moe["params"] and moe["active_params"] < moe["params"]

    runs, dense_runs = result["runs"], result["dense_same_bytes"]["runs"]
    assert [(r["ep"], r["world_size"], r["tp"]) for r in runs] == [(1, 1, 1), (2, 2, 1)]
    assert [(r["ep"], r["world_size"], r["tp"]) for r in dense_runs] == [(1, 1, 1), (1, 2, 1)]
    for run, base in zip(runs, dense_runs):
        for r in (run, base):
            assert set(RUN_FIELDS) <= set(r), sorted(set(RUN_FIELDS) - set(r))
            assert set(r["seconds"]) == set(SECONDS)
            assert r["seconds"]["total_s"] > 0 and r["floor_s"] > 0 and r["total_over_floor"] > 0
            assert r["peak_bucket_bytes"] > 0 and r["largest_tensor_bytes"] > 0 and r["buckets"] >= 1
            assert len(r["ranks"]) == r["world_size"] and r["vllm_dtype"] == "float32"
        assert run["load_format"] == base["load_format"] == "hf"
        assert run["dense_total_s"] == base["seconds"]["total_s"]
        assert run["ratio_to_dense"] == pytest.approx(
            run["seconds"]["total_s"] / run["dense_total_s"], rel=0.01
        )
        assert run["ratio_to_dense"] > 0
        # Every rank's vLLM received every tensor: the MoE streams one per expert projection.
        assert all(rank["tensors"] > 2 * 4 * 3 for rank in run["ranks"])
    # Both generated checkpoints went into a temporary directory, removed at the end.
    assert not list(tmp.glob("bench_weight_sync_*"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--moe", "--tp", "2"], "--tp is for the dense run"),
        (["--ep", "2"], "--ep needs --moe"),
        (["--moe", "--ep", "3", *TINY], "--ep 3 does not divide --experts 4"),
        (["--moe", "--ep", "2", *TINY[:-1], "63"], "does not divide --expert-ffn 63"),
        (["--moe", "--ep", "2", *TINY[:-1], "48"], "--expert-ffn / EP is a multiple of 32"),
    ],
)
def test_moe_flags_are_checked(argv, message):
    proc = subprocess.run([sys.executable, str(TOOL), *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
