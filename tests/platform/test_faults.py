"""Fault points: an empty registry without the test hook; with it, each phase acts at its point only.

The seam (``rlhf_megatron/platform/faults.py``) loads its handlers from the file ``RLHF_FAULT_HOOKS``
names; the repository's hooks, ``tests/fault_hooks.py``, are imported here directly too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fault_hooks
import pytest
import torch

from rlhf_megatron.data.batch import Batch
from rlhf_megatron.platform import faults
from rlhf_megatron.platform.faults import HOOKS_ENV, HOOKS_MODULE, StopTraining

HOOKS_FILE = str(Path(fault_hooks.__file__).resolve())


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RLHF_")}
    return subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def seam(monkeypatch):
    """``faults`` as a fresh process has it: no registry yet, no ``RLHF_*`` variable, the hooks
    file not loaded (and unloaded again afterwards)."""
    for key in [k for k in os.environ if k.startswith("RLHF_")]:
        monkeypatch.delenv(key)
    monkeypatch.setattr(faults, "_registry", None)
    sys.modules.pop(HOOKS_MODULE, None)
    yield monkeypatch
    sys.modules.pop(HOOKS_MODULE, None)


def test_without_the_hook_no_handler_is_registered_and_the_hooks_module_is_never_imported():
    code = (
        "import sys\n"
        "from rlhf_megatron.platform import faults\n"
        "faults.fault_point('actor.update', step=1, rank=0, batch=None)\n"
        "assert faults._registry == {}, faults._registry\n"
        "assert faults.fault_env() == {}\n"
        f"assert {HOOKS_MODULE!r} not in sys.modules and 'fault_hooks' not in sys.modules\n"
        "loaded = [m for m in list(sys.modules.values()) if getattr(m, '__file__', None) == "
        f"{HOOKS_FILE!r}]\n"
        "assert not loaded, loaded\n"
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
    out = _run(code, {"RLHF_FAULT": "update:2:1", HOOKS_ENV: HOOKS_FILE})
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


def test_without_the_hooks_variable_the_registry_is_empty_and_nothing_is_forwarded(seam):
    faults.fault_point("trainer.step_end", step=1)
    assert faults._registry == {} and faults.fault_env() == {}
    assert HOOKS_MODULE not in sys.modules


def test_the_hooks_file_is_loaded_once_and_its_handlers_act_through_fault_point(seam):
    seam.setenv(HOOKS_ENV, HOOKS_FILE)
    seam.setenv("RLHF_STOP_AFTER_STEP", "2")
    faults.fault_point("trainer.step_end", step=1)
    with pytest.raises(StopTraining, match=r"stopped after step 2 \(RLHF_STOP_AFTER_STEP=2\)"):
        faults.fault_point("trainer.step_end", step=2)
    module = sys.modules[HOOKS_MODULE]
    assert module.__file__ == HOOKS_FILE and module is not fault_hooks  # its own copy, by file
    faults.fault_env()
    assert sys.modules[HOOKS_MODULE] is module, "loaded once per process"


def test_fault_env_forwards_the_hooks_file_absolute_with_the_variables_it_acts_on(seam, tmp_path):
    seam.chdir(Path(HOOKS_FILE).parent)
    seam.setenv(HOOKS_ENV, "fault_hooks.py")  # relative: workers start elsewhere
    assert faults.fault_env() == {}, "the hooks file alone injects nothing: nothing to forward"
    seam.setenv("RLHF_FAULT", "update:2:1")
    seam.setenv("RLHF_STOP_AFTER_STEP", "3")  # the hooks file's FORWARD_ENV
    seam.setenv("RLHF_OTHER", "x")
    assert faults.fault_env() == {
        HOOKS_ENV: HOOKS_FILE,
        "RLHF_FAULT": "update:2:1",
        "RLHF_STOP_AFTER_STEP": "3",
    }


def test_a_bad_hooks_path_is_an_error_naming_the_variable_and_the_path(seam, tmp_path):
    missing = tmp_path / "no_such_hooks.py"
    seam.setenv(HOOKS_ENV, str(missing))
    seam.setenv("RLHF_FAULT", "update:1")
    for call in (lambda: faults.fault_point("actor.update", step=1, rank=0), faults.fault_env):
        with pytest.raises(RuntimeError, match=f"{HOOKS_ENV}=.*{missing.name}.*no such file"):
            call()
    empty = tmp_path / "empty_hooks.py"
    empty.write_text("X = 1\n")
    seam.setenv(HOOKS_ENV, str(empty))
    with pytest.raises(RuntimeError, match=f"{HOOKS_ENV}=.*empty_hooks.py.*defines no handlers_from_env"):
        faults.fault_point("actor.update", step=1, rank=0)
    assert HOOKS_MODULE not in sys.modules


def test_a_fault_variable_without_the_hooks_file_is_an_error_not_ignored(seam):
    seam.setenv("RLHF_FAULT", "update:1")
    with pytest.raises(RuntimeError, match=f"RLHF_FAULT set but {HOOKS_ENV} is not"):
        faults.fault_point("actor.update", step=1, rank=0)
    with pytest.raises(RuntimeError, match="tests/fault_hooks.py"):
        faults.fault_env()
