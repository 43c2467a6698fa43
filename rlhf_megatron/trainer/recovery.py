"""In-job recovery (``trainer.max_restarts``): a worker dies or hangs, the run goes on.

A failure a restart can cure ends the attempt: the driver stops every worker group and frees
their resource pools (a new placement group avoids a node that is gone), waits
``trainer.restart_backoff_s`` (doubled after each restart, at most ``MAX_BACKOFF_S``), builds the
groups again, loads the newest complete checkpoint and continues. What a restart can cure
(``failure_cause``):

- ``died``: a worker process, or its node, is gone (SIGKILL, the OOM killer, a lost Ray node);
- ``hung``: a call made no progress for ``trainer.step_timeout_s`` (a stuck collective, a peer
  that died without its process exiting); the group is stopped and the error names the role,
  ranks and call;
- ``collective``: a worker's collective failed (a gloo or NCCL error, a connection reset by a
  peer): one of its peers is gone even if Ray has not reported it yet.

Anything else (a worker's own exception: a NaN under ``nan_policy=stop``, bad data, a reward
function that raises, a config problem) would fail again: it ends the run, as before.

The steps since that checkpoint are lost and run again, at most ``trainer.save_freq`` of them
(the step that failed included). Each restart is recorded in ``<run dir>/recovery.jsonl`` (when,
cause, message, the step that failed and the step resumed from) and reported on the first step
after it: ``recovery/restarts`` (so far), ``recovery/steps_lost`` and ``recovery/cause``
(the failure's kind, a string: in ``metrics.jsonl`` and the console, not wandb).

Boundaries: decides and records; ``trainer.run`` tears down, rebuilds and resumes.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_megatron.scheduling.worker_group import WorkerError

__all__ = ["MAX_BACKOFF_S", "Recovery", "failure_cause"]

MAX_BACKOFF_S = 300.0

_COLLECTIVE = re.compile(
    r"Connection reset by peer|Connection closed by peer|Broken pipe|Gloo connectFullMesh|"
    r"\[gloo\].*(?:Timed out|timeout|failed)|Socket Timeout|NCCL error|ncclInternalError|"
    r"ncclSystemError|ncclRemoteError|Watchdog caught collective operation timeout|"
    r"NCCL communicator was aborted|DistBackendError|DistNetworkError",
    re.IGNORECASE,
)


def failure_cause(err: BaseException) -> str | None:
    """``died``, ``hung`` or ``collective`` for a failure a restart may cure; None otherwise."""
    if not isinstance(err, WorkerError):
        return None
    if err.cause in ("died", "hung"):
        return err.cause
    return "collective" if _COLLECTIVE.search(err.detail) else None


@dataclass
class Recovery:
    """The restarts of one run: whether to restart, how long to wait, what to report."""

    max_restarts: int
    backoff_s: float
    run_dir: Path
    restarts: int = 0
    pending: dict[str, Any] = field(default_factory=dict)
    """Metrics for the first step after the last restart (``take_metrics`` hands them over)."""

    def cause_to_restart(self, err: BaseException) -> str | None:
        """The failure's kind when the run should restart after it; None ends the run."""
        cause = failure_cause(err)
        return cause if cause is not None and self.restarts < self.max_restarts else None

    def delay_s(self) -> float:
        """The wait before restart number ``restarts`` (1 = the first)."""
        return min(self.backoff_s * 2 ** max(self.restarts - 1, 0), MAX_BACKOFF_S)

    def record(self, cause: str, err: BaseException, failed_step: int, resumed_step: int) -> float:
        """Count a restart; write it to ``recovery.jsonl`` and keep its metrics for the next step.
        Returns the seconds to wait before restarting."""
        self.restarts += 1
        lost = max(failed_step - resumed_step, 0)
        event = {
            "time": time.time(),
            "restart": self.restarts,
            "cause": cause,
            "message": str(err).splitlines()[0][:500],
            "failed_step": failed_step,
            "resumed_step": resumed_step,
            "steps_lost": lost,
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / "recovery.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")
        self.pending = {
            "recovery/restarts": float(self.restarts),
            "recovery/steps_lost": float(lost),
            "recovery/cause": cause,
        }
        return self.delay_s()

    def take_metrics(self) -> dict[str, Any]:
        """The last restart's metrics, once (the trainer logs them with its next step)."""
        out, self.pending = self.pending, {}
        return out
