"""Shared pytest setup: the `gpu` marker skips without CUDA; quiet, single-threaded torch; artefacts
built once per session and shared by every pytest-xdist worker; the `exclusive` marker.

How to add an end-to-end test without adding a training run
-----------------------------------------------------------
A run through the real CLI costs 25-60 s here, most of it start-up (Ray, the worker processes,
vLLM). Before adding one, look for a run that already has what the test reads:

- ``reference_run`` (tests/trainer_helpers.py): the quickstart GRPO config, 3 steps, a
  checkpoint after every step, on the shared tiny model and arith data. The uninterrupted run the
  resume and fault tests compare against, and the plain GRPO run the trainer tests check.
- ``tiny_run_inputs``: the tiny Llama and the arith parquet every trainer run uses.
- ``tool_run_inputs``: the tool quickstart's policy, pre-trained briefly to call a calculator,
  and the tool_mult parquet, for multi-turn runs and the agent endpoint.

Such artefacts are built by ``shared_artifact`` once per ``pytest`` session, whichever xdist
worker asks first (the others wait on a file lock), and must be treated as read-only: a test that
changes a run directory copies it first (``shutil.copytree``). Prefer adding assertions to a test
that already trains the configuration you need; if the new test does need its own run, keep it to
the fewest steps that show the behaviour, and put checks that need no processes in a unit test.

Runs started with ``trainer_helpers.run_train`` join one Ray cluster per xdist worker (started on
first use) instead of starting their own, as a launcher's driver joins a cluster through
``RAY_ADDRESS``; pass ``own_ray=True`` for a run that must start Ray itself as a user's
``rlhf-megatron train`` does.

Parallel workers
----------------
``scripts/test.sh`` runs the suite on pytest-xdist workers, a whole file at a time, the longest
files first by ``tests/durations.json`` (a new test counts as 60, 20 or 0.05 s by kind until that
file is written again with ``RLHF_STORE_DURATIONS=1``). Each worker gets its own Ray temp
directory (``RAY_TMPDIR``), and tests that start process groups pick free ports. A test that
measures time, memory or machine-wide state (``/dev/shm``) while other tests would disturb it
carries ``@pytest.mark.exclusive``: it waits for the tests running on other workers to finish
and none start beside it (a shared/exclusive file lock; no effect without xdist).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from shared_artifacts import WORKER, machine_share
from trainer_helpers import reference_run, tiny_run_inputs, tool_run_inputs  # noqa: F401  (session fixtures)

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")

if WORKER:
    # Ray records the last cluster it started under its temp dir (`ray_current_cluster`); a
    # directory per worker keeps one worker's clusters out of another's `ray.init()`.
    os.environ["RAY_TMPDIR"] = f"/tmp/ray-{os.getpid()}-{WORKER}"
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)


DURATIONS = Path(__file__).with_name("durations.json")
"""Each test's seconds (setup + call + teardown) in a whole-suite run: the order under xdist.
``RLHF_STORE_DURATIONS=1 bash scripts/test.sh`` writes it again from that run."""
GUESS_S = {"e2e": 60.0, "integration": 20.0, "unit": 0.05}
"""The seconds assumed for a test the durations file does not know yet, by kind."""


def pytest_collection_modifyitems(config, items):
    import torch

    if WORKER:
        # Under xdist (`scripts/test.sh`: --dist loadfile, in this order) a worker that runs out of
        # work takes the next file, whole: the longest files go first and the short ones fill in
        # at the end, so neither worker waits long for the other's last run, and a module-scoped
        # fixture is built on one worker, not on both. Within a file the tests keep their order.
        known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        seconds: dict[Path, float] = {}
        for item in items:
            guess = GUESS_S[_kind(item.keywords)]
            seconds[item.path] = seconds.get(item.path, 0.0) + known.get(item.nodeid, guess)
        items.sort(key=lambda item: -seconds[item.path])  # stable: a file's own order within it
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (marked gpu); this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _machine_share(request, tmp_path_factory):
    """Shared for every test, exclusive for tests marked ``exclusive`` (``machine_share``). A
    module-scoped fixture that must run alone takes ``machine_share`` itself: it is set up before
    this fixture takes the machine for the module's first test, and gives it back before."""
    with machine_share(tmp_path_factory, request.node.get_closest_marker("exclusive") is not None):
        yield


_KIND_SECONDS: dict[str, list[float]] = {}
_SEEN: dict[str, str] = {}
_DURATIONS: dict[str, float] = {}


def _kind(keywords) -> str:
    if "e2e" in keywords:
        return "e2e"
    return "integration" if "slow" in keywords else "unit"


def pytest_runtest_logreport(report):
    """Sum each test's setup + call + teardown time by kind (reports of every xdist worker)."""
    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration
    kind = _SEEN.setdefault(report.nodeid, _kind(report.keywords))
    totals = _KIND_SECONDS.setdefault(kind, [0.0, 0])
    totals[0] += report.duration
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        totals[1] += 1


def pytest_terminal_summary(terminalreporter):
    """How the suite's time splits: unit (no `slow` marker), integration (`slow`: several processes,
    Ray, vLLM, Slurm) and end-to-end runs of the CLI (`e2e`). Under xdist the sums add up the
    workers' time, so together they exceed the wall time."""
    if not _KIND_SECONDS:
        return
    parts = [f"{kind} {sec:.0f} s ({n} tests)" for kind, (sec, n) in sorted(_KIND_SECONDS.items())]
    terminalreporter.write_sep("-", "time by kind (summed over workers): " + ", ".join(parts))


def pytest_sessionfinish(session, exitstatus):
    """With ``RLHF_STORE_DURATIONS=1``, this run's durations replace those of the tests it ran in
    ``tests/durations.json`` (by the process that saw every worker's reports; written whole)."""
    if WORKER or not os.environ.get("RLHF_STORE_DURATIONS") or not _DURATIONS:
        return
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    known.update({nodeid: round(seconds, 1) for nodeid, seconds in _DURATIONS.items()})
    tmp = DURATIONS.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(dict(sorted(known.items())), indent=0) + "\n")
    tmp.replace(DURATIONS)
