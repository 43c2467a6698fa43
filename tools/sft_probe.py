"""Supervised pre-training for the tiny-model builders, on the project's SFT trainer.

``pretrain`` runs ``rlhf_megatron.stages.driver.run_stage("sft", ...)`` (the engine, data path
and checkpoints ``python -m rlhf_megatron.sft`` uses) on one CPU process, saving every
``--eval-every`` steps of the builder's arguments (``sft_overrides``; ``add_pretraining_flags``
declares them).
After each save it exports the checkpoint to Hugging Face (``convert_mcore_to_hf``, as
``rlhf-megatron convert mcore-to-hf`` does) and asks the builder's probe about it; the first probe
that says "done" ends the run. The builders then evaluate and publish that export.

Why a probe and not a fixed step count: the quickstarts need a starting policy that is weak but
not random (GRPO learns only from groups whose samples disagree), and the step where a tiny model
gets there moves with the seed and the recipe (see ``make_tiny_model.py``).

Boundaries: the stage run, its flags, its scratch directory and the export; what a probe measures
and what the rows hold is each builder's.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Probe = Callable[[int, Path], tuple[dict[str, Any], bool]]
"""(step, the step's exported model directory) -> (what it scored, whether pre-training can stop here)."""


SEED_OFFSET = 1_000_003
"""Separates pre-training's data order from the RL split's (both derive from ``--seed``)."""


def sft_overrides(
    args: argparse.Namespace, base: Path, train_files: str, run_dir: Path, extra: Sequence[str] = ()
) -> list[str]:
    """The stage config of a builder's pre-training as ``key=value`` overrides, from the builder's
    ``--steps``, ``--eval-every``, ``--batch-size``, ``--lr`` and ``--seed``: one CPU process,
    float32, AdamW (betas 0.9/0.98, no weight decay), 10 warmup steps then a constant rate, a
    checkpoint every ``--eval-every`` steps (only the newest kept); ``extra`` adds the data keys."""
    return [
        f"model.partial_pretrain={base}",
        f"data.train_files={train_files}",
        "data.val_files=null",
        "data.max_length=128",
        f"data.train_batch_size={args.batch_size}",
        f"data.micro_batch_size_per_gpu={args.batch_size}",
        f"optim.lr={args.lr}",
        "optim.betas=[0.9,0.98]",
        "optim.weight_decay=0.0",
        "optim.clip_grad=1.0",
        "optim.lr_warmup_steps=10",
        "optim.warmup_style=constant",
        "megatron.params_dtype=float32",
        "megatron.use_distributed_optimizer=false",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.save_freq={args.eval_every}",
        "trainer.test_freq=-1",
        "trainer.max_ckpt_to_keep=1",
        "trainer.resume_mode=disable",
        "trainer.logger=[jsonl]",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "trainer.device=cpu",
        f"trainer.seed={args.seed + SEED_OFFSET}",
        *extra,
    ]


def add_pretraining_flags(
    parser: argparse.ArgumentParser,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    target: tuple[str, float, str],
    eval_every: int,
) -> None:
    """The builder's flags that ``sft_overrides`` reads, with the builder's defaults; ``target`` is
    its early-stop flag (name, default, help), which only its probe reads."""
    parser.add_argument(
        "--steps", type=int, default=steps, help="most SFT steps (fewer when the target is hit)"
    )
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--lr", type=float, default=lr)
    flag, default, help_text = target
    parser.add_argument(flag, type=float, default=default, help=help_text)
    parser.add_argument(
        "--eval-every", type=int, default=eval_every, help="SFT steps between probe evaluations"
    )


def pretrain(
    args: argparse.Namespace,
    model,
    processor,
    scratch: Path,
    write_rows: Callable[[Path], str],
    probe: Probe,
    extra: Sequence[str] = (),
) -> tuple[int, list[dict], Path]:
    """SFT of the random ``model``, probed after every save (``sft_until`` with ``sft_overrides``).
    Everything goes under ``scratch``: the starting point (``save_base``), the rows that
    ``write_rows(path)`` writes to ``sft/train.parquet`` (it returns the ``data.train_files``
    value), the run's directory and the exports."""
    base = save_base(model, processor, scratch)
    train_files = write_rows(scratch / "sft" / "train.parquet")
    return sft_until(sft_overrides(args, base, train_files, scratch / "run", extra), probe, scratch)


def save_base(model, processor, scratch: Path) -> Path:
    """The random model (and its tokenizer or processor) where the SFT run starts from."""
    base = scratch / "base"
    model.save_pretrained(base, safe_serialization=True)
    processor.save_pretrained(base)
    return base


def sft_until(overrides: Sequence[str], probe: Probe, scratch: Path) -> tuple[int, list[dict], Path]:
    """SFT per ``overrides`` (stage config ``key=value`` strings), probing each checkpoint's
    export; stops at the first probe that says done, else after the last step. Returns (the step
    stopped at, one record per probe: step, train loss and the probe's scores, the chosen
    export's directory)."""
    from rlhf_megatron.config.loader import load_stage_config
    from rlhf_megatron.config.schema_stages import SFTConfig
    from rlhf_megatron.convert import convert_mcore_to_hf
    from rlhf_megatron.stages.driver import run_stage

    cfg = load_stage_config(SFTConfig, None, list(overrides))
    curve: list[dict] = []
    chosen: list[Path] = []

    def after_save(step: int, ckpt: Path) -> bool:
        out = scratch / f"hf_step_{step}"
        convert_mcore_to_hf(ckpt, out, verify=False, progress=False)
        for older in chosen:  # only the newest export is kept
            shutil.rmtree(older, ignore_errors=True)
        chosen[:] = [out]
        scores, done = probe(step, out)
        curve.append({"step": step, **scores})
        return done

    # stdout carries the builder's one JSON object; the stage's report goes to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        history = run_stage("sft", cfg, after_save)
    losses = {r["step"]: r["train/loss"] for r in history}
    for point in curve:
        point["loss"] = round(losses[point["step"]], 4)
    return curve[-1]["step"], curve, chosen[0]
