"""Where metrics go: console progress, a JSON-lines file (always), wandb, tensorboard.

``Tracker(backends, run_dir, ...)`` fans ``log(metrics, step)`` out to every
backend named in ``trainer.logger``. ``metrics.jsonl`` in the run directory is
written whatever the list says, one flushed line per step, so a run can be
plotted (``tools/plot_metrics.py``) or compared after a crash.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

BACKENDS = ("console", "jsonl", "wandb", "tensorboard")
CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("val/reward_mean", "val"),
    ("actor/pg_loss", "pg"),
    ("actor/ppo_kl", "kl"),
    ("response_length/mean", "len"),
    ("timing_s/step", "s/step"),
    # the stages before RL (SFT, reward-model training)
    ("train/loss", "loss"),
    ("val/loss", "val_loss"),
    ("train/accuracy", "acc"),
    ("val/accuracy", "val_acc"),
)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item"):
        return _jsonable(value.item())
    return value


class Tracker:
    def __init__(
        self,
        backends,
        run_dir: str | Path,
        total_steps: int,
        project: str,
        experiment: str,
        config: dict | None = None,
    ):
        unknown = sorted(set(backends) - set(BACKENDS))
        if unknown:
            raise ValueError(f"trainer.logger: unknown logger(s) {unknown}; choose from {list(BACKENDS)}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 (lives as long as the tracker)
        self.bar = None
        if "console" in backends:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, desc=experiment, unit="step", dynamic_ncols=True)
        self.wandb = None
        if "wandb" in backends:
            import wandb

            self.wandb = wandb.init(project=project, name=experiment, config=config, dir=str(self.run_dir))
        self.tb = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.bar is not None:
            shown = {short: f"{metrics[k]:.3g}" for k, short in CONSOLE_KEYS if k in metrics}
            self.bar.set_postfix(shown, refresh=False)
            self.bar.n = step
            self.bar.refresh()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def rewind(self, step: int) -> None:
        """Forget the records of steps after ``step`` (a resumed run trains them again) in
        ``metrics.jsonl`` and ``val_generations.jsonl``, each rewritten to a temporary file and
        renamed over the old one. wandb and TensorBoard keep what they were sent."""
        self.jsonl.close()
        for name in ("metrics.jsonl", "val_generations.jsonl"):
            path = self.run_dir / name
            if not path.is_file():
                continue
            lines = path.read_text().splitlines()
            kept = [line for line in lines if not line.strip() or json.loads(line).get("step", 0) <= step]
            if len(kept) != len(lines):
                tmp = path.with_name(f".{name}.tmp")
                tmp.write_text("".join(f"{line}\n" for line in kept))
                tmp.replace(path)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 (lives as long as the tracker)
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def log_generations(self, rows: list[tuple[str, str, float]], step: int) -> None:
        """Validation samples (input, output, score): a wandb table, and a JSON-lines file."""
        if not rows:
            return
        with open(self.run_dir / "val_generations.jsonl", "a") as f:
            for prompt, output, score in rows:
                f.write(json.dumps({"step": step, "input": prompt, "output": output, "score": score}) + "\n")
        if self.wandb is not None:
            import wandb

            table = wandb.Table(columns=["step", "input", "output", "score"])
            for prompt, output, score in rows:
                table.add_data(step, prompt, output, score)
            self.wandb.log({"val/generations": table}, step=step)

    def close(self) -> None:
        self.jsonl.close()
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tb is not None:
            self.tb.close()
