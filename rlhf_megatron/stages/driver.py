"""The driver loop of a stage before RL (SFT or reward-model training), on Ray worker groups.

Reads like the RL driver, shorter: load and tokenize the rows, place one ``StageWorker`` per
process (``trainer.nnodes`` x ``n_gpus_per_node``), then per optimizer step hand the workers
``train_batch_size`` samples (each data-parallel rank its share), log what comes back, validate
every ``test_freq`` steps and save every ``save_freq`` (always after the last). Checkpoints,
loggers, the progress bar and the run directory are the RL trainer's: ``<step>/actor`` (SFT) or
``<step>/reward_model`` (RM) is a role checkpoint that exports with ``convert mcore-to-hf`` and
loads as an RL run's starting model; ``metrics.jsonl`` and ``metrics.png`` land in
``trainer.default_local_dir``. A run resumes from its newest checkpoint (``resume_mode=auto``).

``after_save`` lets a caller stop early on its own measure: it gets each committed checkpoint's
model directory and ends the run there by returning True (the tiny-model builders in ``tools/``
export it and stop once a probe set is answered well enough).

Metrics use verl's SFT names: ``train/loss``, ``train/lr``, ``val/loss``; the reward model adds
``train/accuracy``, ``train/margin``, ``val/accuracy``, ``val/margin``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf_megatron.config.context import RunContext, Seeds
from rlhf_megatron.platform.faults import StopTraining, fault_point
from rlhf_megatron.stages.data import epoch_order, pair_batch, pair_samples, sft_batch, sft_samples
from rlhf_megatron.stages.worker import StageWorker

__all__ = ["run_stage"]

logger = logging.getLogger(__name__)


def _combine(kind: str, parts: list[dict[str, float] | None], prefix: str) -> dict[str, float]:
    """Per-rank sums -> the step's means (SFT: per loss token; RM: per pair)."""
    parts = [p for p in parts if p]
    total = {k: sum(p[k] for p in parts) for k in parts[0]}
    out = {}
    if kind == "sft":
        out[f"{prefix}/loss"] = total["nll_sum"] / max(total["tokens"], 1.0)
        out[f"{prefix}/tokens"] = total["tokens"]
    else:
        pairs = max(total["pairs"], 1.0)
        out[f"{prefix}/loss"] = total["loss_sum"] / pairs
        out[f"{prefix}/accuracy"] = total["correct"] / pairs
        out[f"{prefix}/margin"] = total["margin_sum"] / pairs
    if "grad_norm" in parts[0]:
        out[f"{prefix}/grad_norm"] = parts[0]["grad_norm"]
        out[f"{prefix}/lr"] = parts[0]["lr"]
    return out


class _Stage:
    """What differs between SFT and reward-model training on the driver: samples and batches.
    ``vision``: a vision-language model's processor (SFT only; None for a text-only model)."""

    def __init__(self, kind: str, cfg, tokenizer, dp: int, width_multiple: int, vision=None):
        self.kind, self.cfg, self.dp, self.width_multiple = kind, cfg, dp, width_multiple
        self.vision = vision
        data = cfg.data
        self.train = self._read(tokenizer, data.train_files, "data.train_files")
        self.val = self._read(tokenizer, data.val_files, "data.val_files") if data.val_files else []

    def _read(self, tokenizer, files, files_key: str) -> list:
        if self.kind == "sft":
            return sft_samples(self.cfg.data, tokenizer, files, files_key, self.vision)
        return pair_samples(self.cfg.data, tokenizer, files, files_key)

    def batch(self, samples):
        import torch

        if self.kind == "sft":
            batch = sft_batch(samples, self.cfg.data, self.dp, self.width_multiple, self.vision)
            # tokens the loss trains (a packed segment's first token is not predicted across the boundary)
            count = float(sum(sum(s.loss_mask[1:]) for s in samples))
            batch["loss_tokens"] = torch.full((len(batch),), count)
        else:
            batch = pair_batch(samples, self.dp, self.width_multiple)
            batch["loss_pairs"] = torch.full((len(batch),), float(len(samples)))
        return batch


AfterSave = Callable[[int, Path], bool]
"""(step, the checkpoint's model directory) -> whether to stop the run there."""


def run_stage(kind: str, cfg: DictConfig, after_save: AfterSave | None = None) -> list[dict[str, Any]]:
    """Train stage ``kind`` (``sft`` or ``rm``) per ``cfg``; returns the metric records.
    ``after_save``: called after every committed checkpoint; True ends the run there."""
    import ray
    from transformers import AutoTokenizer

    from rlhf_megatron.config.loader import save_resolved_config
    from rlhf_megatron.data.multimodal import load_vision_processor
    from rlhf_megatron.platform import is_cuda
    from rlhf_megatron.scheduling import ResourcePool, WorkerGroup
    from rlhf_megatron.trainer.checkpoint import CheckpointManager
    from rlhf_megatron.trainer.loggers import Tracker
    from rlhf_megatron.trainer.run import init_ray

    typed = OmegaConf.to_object(cfg)
    trainer, data = typed.trainer, typed.data
    model = typed.model
    tokenizer = AutoTokenizer.from_pretrained(
        os.path.expanduser(model.tokenizer_path or model.partial_pretrain),
        trust_remote_code=model.trust_remote_code,
    )
    world = trainer.nnodes * trainer.n_gpus_per_node
    m = typed.megatron
    dp = world // (m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size)
    width = m.tensor_model_parallel_size if m.sequence_parallel else 1
    # Images go through the model's own processor, as in RL (None for a text-only model).
    vision = load_vision_processor(os.path.expanduser(model.partial_pretrain)) if kind == "sft" else None
    stage = _Stage(kind, typed, tokenizer, dp, width, vision)
    steps_per_epoch = max(1, len(stage.train) // data.train_batch_size)
    total = trainer.total_training_steps or steps_per_epoch * trainer.total_epochs
    run_dir = Path(trainer.default_local_dir)
    save_resolved_config(cfg, run_dir)
    checkpoints = CheckpointManager(run_dir, trainer.max_ckpt_to_keep)
    resume_from = checkpoints.resolve(trainer.resume_mode, None)
    owns_ray = init_ray(world)
    context = RunContext(seeds=Seeds(trainer.seed), nan_policy="stop", rollout_n=1, total_steps=total)
    tracker = Tracker(
        trainer.logger,
        run_dir,
        total,
        trainer.project_name,
        trainer.experiment_name,
        OmegaConf.to_container(cfg, resolve=True),
    )
    pool = ResourcePool(
        f"{kind}_pool",
        [trainer.n_gpus_per_node] * trainer.nnodes,
        use_gpu=is_cuda() and trainer.device != "cpu",
    )
    pool.create()
    group = None
    history: list[dict[str, Any]] = []
    try:
        group = WorkerGroup(kind, pool, StageWorker, {"section": typed, "context": context, "kind": kind})
        group.call.init_model()
        step = 0
        if resume_from is not None:
            group.call.load_checkpoint(str(resume_from))
            step = checkpoints.read_state(resume_from)["global_step"]
        try:
            history = _loop(stage, group, checkpoints, tracker, step, total, history, after_save)
        except StopTraining as stop:
            logger.warning("%s", stop)
            return history
        _report(run_dir, kind, history)
        return history
    finally:
        tracker.close()
        if group is not None:
            group.shutdown()
        pool.remove()
        if owns_ray:
            ray.shutdown()


def _loop(
    stage: _Stage,
    group,
    checkpoints,
    tracker,
    step: int,
    total: int,
    history: list,
    after_save: AfterSave | None = None,
) -> list[dict[str, Any]]:
    from rlhf_megatron.stages.worker import ENGINE_NAMES

    cfg = stage.cfg
    data, trainer = cfg.data, cfg.trainer
    per_epoch = max(1, len(stage.train) // data.train_batch_size)
    while step < total:
        epoch, index = divmod(step, per_epoch)
        order = epoch_order(len(stage.train), epoch, trainer.seed, data.shuffle)
        chosen = order[index * data.train_batch_size : (index + 1) * data.train_batch_size]
        record = _combine(
            stage.kind, group.call.train_batch(stage.batch([stage.train[i] for i in chosen])), "train"
        )
        step += 1
        record["train/epoch"] = epoch
        last = step == total
        if stage.val and (last or (trainer.test_freq > 0 and step % trainer.test_freq == 0)):
            record.update(_validate(stage, group))
        tracker.log(record, step)
        history.append({"step": step, **record})
        if last or (trainer.save_freq > 0 and step % trainer.save_freq == 0):
            _save(group, checkpoints, step)
            if after_save is not None and after_save(
                step, checkpoints.step_dir(step) / ENGINE_NAMES[stage.kind]
            ):
                break
        fault_point("trainer.step_end", step=step)  # tests pre-empt a run here (RLHF_STOP_AFTER_STEP)
    return history


def _validate(stage: _Stage, group) -> dict[str, float]:
    size = max(stage.cfg.data.train_batch_size, 1)
    parts = []
    for start in range(0, len(stage.val), size):
        parts += group.call.eval_batch(stage.batch(stage.val[start : start + size]))
    return _combine(stage.kind, parts, "val")


def _save(group, checkpoints, step: int) -> None:
    tmp = checkpoints.begin(step)
    try:
        group.call.save_checkpoint(str(tmp))
        checkpoints.commit(step, tmp, {"global_step": step})
    except BaseException:
        checkpoints.abort(tmp)
        raise


def _report(run_dir: Path, kind: str, history: list[dict[str, Any]]) -> None:
    """Where the metrics, the plot and the last checkpoint are, and how to use it next."""
    from rlhf_megatron.stages.worker import ENGINE_NAMES

    lines = [f"metrics:       {run_dir / 'metrics.jsonl'}"]
    try:
        from rlhf_megatron.trainer.plot import load_records, plot

        lines.append(f"plot:          {plot(load_records(run_dir), run_dir / 'metrics.png')}")
    except ImportError as e:  # matplotlib is a dev extra
        lines.append(f"plot:          skipped ({e})")
    if history:
        ckpt = run_dir / f"global_step_{history[-1]['step']}" / ENGINE_NAMES[kind]
        lines.append(f"checkpoint:    {ckpt}")
        lines.append(f"export to HF:  rlhf-megatron convert mcore-to-hf --ckpt {ckpt} --out {run_dir / 'hf'}")
        last = history[-1]
        shown = {k: round(v, 4) for k, v in last.items() if k.startswith("val/")}
        if shown:
            lines.append(f"validation:    {shown}")
    print("\n".join(lines))
