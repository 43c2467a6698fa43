"""`rlhf-megatron launch local` against a real Ray head: the driver finds it through
RAY_ADDRESS, its exit status is the launcher's, and the head is gone afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .procs import assert_gone

ROOT = Path(__file__).resolve().parents[2]


def _launch_local(run_config: str, driver_cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # A process of its own, as a user runs it: the launcher owns a Ray head while it lives.
    argv = [
        sys.executable,
        "-m",
        "rlhf_megatron.launch",
        "local",
        "--config",
        run_config,
        "--num-cpus",
        "1",
        "--num-gpus",
        "0",
        "--driver-cmd",
        driver_cmd,
        "--",
        "trainer.total_epochs=1",
    ]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # 10-25 s on 2 busy cores: a Ray head and a driver that connects to it
def test_local_runs_the_driver_on_its_own_ray_and_stops_it(run_config, tmp_path):
    probe, env_dump = tmp_path / "probe.json", tmp_path / "driver_env"
    proc = _launch_local(
        run_config, f"python -m rlhf_megatron.launch.probe --nodes 1 --out {probe} && env > {env_dump}"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(probe.read_text())
    assert result["nodes"] == 1 and len(result["tasks"]) == 1
    env = dict(line.split("=", 1) for line in env_dump.read_text().splitlines() if "=" in line)
    assert env["RLHF_MEGATRON_NNODES"] == "1" and env["RLHF_MEGATRON_GPUS_PER_NODE"] == "0"
    port = env["RAY_ADDRESS"].rsplit(":", 1)[1]
    assert_gone(f"--gcs_server_port={port}", "the launcher's Ray head")


@pytest.mark.slow  # ~15-20 s on 2 busy cores: a Ray head plus a 3 s wait that must time out
def test_driver_failure_is_the_exit_status_and_wait_names_the_missing_nodes(run_config):
    """The driver here waits for 2 nodes on a 1-node cluster: the wait helper's bounded
    error, and its exit status through the launcher."""
    proc = _launch_local(
        run_config, 'python -m rlhf_megatron.launch.wait --address "$RAY_ADDRESS" --nodes 2 --timeout 3'
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "only 1 of 2 Ray nodes joined" in proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["local", "--help"]])
def test_help(argv):
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_megatron.launch", *argv], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "usage" in proc.stdout.lower()
