"""tools/gpu/measure.py on CPU (its --tiny smoke mode: real megatron-core over gloo), and the
storage release/restore that GPU offloading is built on."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from rlhf_megatron.workers.megatron_engine import release_storages, restore_storages

ROOT = Path(__file__).resolve().parents[2]


def test_release_and_restore_storages_keep_views_valid():
    buffer = torch.randn(64)
    view, other = buffer[8:24].view(4, 4), torch.randn(3, 5)
    before = (buffer.clone(), other.clone())
    saved = release_storages([view, buffer, other])  # the view and its base share one storage
    assert len(saved) == 2
    assert buffer.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    restore_storages(saved)
    assert torch.equal(buffer, before[0]) and torch.equal(other, before[1])
    assert torch.equal(view, before[0][8:24].view(4, 4))
    view.add_(1)  # still a view of the refilled storage
    assert torch.equal(buffer[8:24], before[0][8:24] + 1)


def test_measure_script_tiny_on_cpu(tmp_path):
    out = tmp_path / "m.json"
    proc = subprocess.run(
        [sys.executable, "tools/gpu/measure.py", "--tiny", "--skip-tests", "--steps", "1", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    errors = {k: v["error"] for k, v in result.items() if isinstance(v, dict) and "error" in v}
    errors.update({k: v["error"] for k, v in result["runs"].items() if "error" in v})
    assert not errors, errors
    assert result["export"]["mismatched"] == [] and result["export"]["missing"] == []
    for mode in ("none", "selective", "full"):
        run = result["runs"][mode]
        assert run["warmup_update_ok"] and run["update"]["update_ok"]
        assert run["update"]["tokens"] == 8 * 64 and run["update"]["tokens_per_s"] > 0
        assert result["planner"][mode]["update_planned_gib"] > 0
    assert "memory plan" in result["planner"]["plan_text"]
    # --replan: the planner section again, from the file alone
    result["planner"] = {}
    out.write_text(json.dumps(result))
    replan = subprocess.run(
        [sys.executable, "tools/gpu/measure.py", "--replan", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert replan.returncode == 0, replan.stderr[-3000:]
    planner = json.loads(out.read_text())["planner"]
    assert planner["recomputed"]["how"].startswith("tools/gpu/measure.py --replan")
    assert all(planner[mode]["update_planned_gib"] > 0 for mode in ("none", "selective", "full"))
