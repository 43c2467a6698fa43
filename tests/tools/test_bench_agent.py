"""``tools/bench_agent.py --sandbox-only``: the code sandbox's cost per call, as JSON."""

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_agent.py"


def test_sandbox_only_prints_the_print1_cost_and_the_layers():
    out = subprocess.run(
        [sys.executable, str(TOOL), "--sandbox-only", "--sandbox-runs", "5"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    sandbox = json.loads(out.strip().splitlines()[-1])["sandbox"]
    assert sandbox["runs"] == 5
    assert 0 < sandbox["print1_ms_median"] <= sandbox["print1_ms_p90"]
    assert set(sandbox["layers"]) >= {"netns", "disk_quota", "landlock", "seccomp", "audit_hook"}
