"""Fault points: an empty registry without the test hook; with it, each phase acts at its point only."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlhf_megatron.data.batch import Batch
from rlhf_megatron.platform import fault_hooks
from rlhf_megatron.platform.faults import StopTraining


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in __import__("os").environ.items() if not k.startswith("RLHF_")}
    return subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=120
    )


def test_without_the_hook_no_handler_is_registered_and_the_hooks_module_is_never_imported():
    code = (
        "import sys\n"
        "from rlhf_megatron.platform import faults\n"
        "faults.fault_point('actor.update', step=1, rank=0, batch=None)\n"
        "assert faults._registry == {}, faults._registry\n"
        "assert 'rlhf_megatron.platform.fault_hooks' not in sys.modules\n"
        "print('ok')"
    )
    out = _run(code, {})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_kill_phase_kills_only_at_its_point_step_and_rank():
    code = (
        "from rlhf_megatron.platform.faults import fault_point\n"
        "fault_point('actor.generate', step=2, rank=1)\n"  # wrong point
        "fault_point('actor.update', step=1, rank=1)\n"  # wrong step
        "fault_point('actor.update', step=2, rank=0)\n"  # wrong rank
        "print('alive', flush=True)\n"
        "fault_point('actor.update', step=2, rank=1)\n"
        "print('survived')"
    )
    out = _run(code, {"RLHF_FAULT": "update:2:1"})
    assert out.returncode == -9 and out.stdout.split() == ["alive"]


def test_poison_leak_drift_and_stop_handlers():
    registry = fault_hooks.handlers_from_env(
        {"RLHF_FAULT": "nan:2,critic_nan:1,leak:1,sync_drift:5", "RLHF_STOP_AFTER_STEP": "3"}
    )
    assert sorted(registry) == ["actor.sync", "actor.update", "critic.update", "trainer.step_end"]
    batch = Batch.from_dict({"advantages": torch.ones(2, 3), "returns": torch.ones(2, 3)})
    for handler in registry["actor.update"]:
        handler(step=1, rank=0, batch=batch)
    assert torch.isfinite(batch["advantages"]).all() and len(fault_hooks._leaked) >= 1
    for handler in registry["actor.update"]:
        handler(step=2, rank=0, batch=batch)
    assert torch.isnan(batch["advantages"]).all()
    registry["critic.update"][0](step=1, rank=3, batch=batch)
    assert torch.isinf(batch["returns"]).all()
    registry["trainer.step_end"][0](step=2)
    with pytest.raises(StopTraining, match="stopped after step 3"):
        registry["trainer.step_end"][0](step=3)
    with pytest.raises(ValueError, match="unknown phase 'boom'"):
        fault_hooks.handlers_from_env({"RLHF_FAULT": "boom:1"})
