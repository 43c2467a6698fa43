"""Build the image quickstart's starting policy: a tiny Qwen2.5-VL briefly pre-trained (supervised)
on a synthetic image task, so that it starts weak but not random.

    .venv/bin/python tools/make_tiny_vl_model.py [--out outputs/tiny_vl_model] [--data-dir outputs/data/shapes_vl]

The task (``tools/data/shapes_vl.py``, EasyR1's layout): a small image with 1 to
``--max-count`` coloured squares and the question "How many squares are in the image?"; the
answer is the count. The policy answers as EasyR1's ``math`` reward wants,
``<think>N</think>\\boxed{N}``. The tool writes the RL data first (``<data-dir>/data/train-*``
and ``test-*`` parquet files: ``data.train_files=<data-dir>@train``), then builds the model
(``rlhf_megatron.models.tiny.build_tiny_qwen2_5_vl``: vision tower of depth 2 and width 128,
language model of width 256), trains it on a separate pool of images and saves it with its
processor and ``stamp.json``. It prints one JSON object with the held-out accuracies.

Prompts are rendered by ``RLHFDataset`` itself with the same ``data`` settings the quickstart
config uses (``--prompt-length``, ``--size`` as both pixel bounds), so pre-training sees exactly
the token ids and pixel values RL will.

Why "weak but not random": GRPO learns only from groups whose samples disagree (see
``tools/make_tiny_model.py``). Pre-training stops once greedy accuracy on a probe set (held
out of pre-training, disjoint from the RL test split) reaches ``--target-accuracy``; by then the
answer format is learnt and the count is right somewhat more often than a guess.

Deterministic for a given seed and thread count; a second run with the same arguments finds the
stamp and skips (``--force`` rebuilds); the output directory is written to a temporary sibling
and renamed into place.

Boundaries: plain PyTorch and transformers on CPU; no Megatron, vLLM or Ray.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import random
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from rlhf_megatron.config.schema import DataConfig
from rlhf_megatron.data.dataset import RLHFDataset
from rlhf_megatron.data.multimodal import concat_vision_inputs, load_vision_processor
from rlhf_megatron.models.tiny import build_tiny_qwen2_5_vl
from rlhf_megatron.rewards.easyr1 import math_compute_score

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stamped_build import build_once  # noqa: E402

RECIPE_VERSION = 1
SHAPES_TOOL = Path(__file__).resolve().parent / "data" / "shapes_vl.py"
_SFT_SEED_OFFSET = 1_000_003
_WARMUP_STEPS = 10


@dataclass(frozen=True)
class Example:
    """One rendered problem: the prompt as RL sees it, its images, and the target response."""

    answer: str
    prompt_ids: list[int]  # unpadded, image pads expanded
    vision: dict  # this row's pixel_values [patches, D] and image_grid_thw [images, 3]
    target_ids: list[int]  # "<think>N</think>\boxed{N}" + eos


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="outputs/tiny_vl_model", help="model directory to write")
    p.add_argument("--data-dir", default="outputs/data/shapes_vl", help="dataset directory (data/*.parquet)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-size", type=int, default=1024, help="RL train prompts")
    p.add_argument("--test-size", type=int, default=100, help="held-out prompts (validation)")
    p.add_argument("--pool-size", type=int, default=1024, help="pre-training images (a separate draw)")
    p.add_argument("--probe-size", type=int, default=100, help="images for the early-stop probe")
    p.add_argument("--size", type=int, default=56, help="image side in pixels (4 x 4 patches of 14)")
    p.add_argument("--max-count", type=int, default=4, help="most squares in one image")
    p.add_argument("--prompt-length", type=int, default=64, help="data.max_prompt_length of the RL config")
    p.add_argument("--steps", type=int, default=400, help="most SFT steps (fewer when the target is hit)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--target-accuracy", type=float, default=0.45, help="stop at the first probe reaching this"
    )
    p.add_argument("--eval-every", type=int, default=10, help="SFT steps between probe evaluations")
    p.add_argument("--max-new-tokens", type=int, default=12, help="generation budget (match the RL config)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--force", action="store_true", help="rebuild even if --out has a matching stamp")
    return p.parse_args(argv)


def data_config(args: argparse.Namespace) -> DataConfig:
    """The ``data`` section the quickstart config uses (configs/quickstart_vl_cpu.yaml)."""
    pixels = args.size * args.size
    return DataConfig(
        prompt_key="problem",
        answer_key="answer",
        image_key="images",
        max_prompt_length=args.prompt_length,
        max_response_length=args.max_new_tokens,
        min_pixels=pixels,
        max_pixels=pixels,
    )


# ---------------------------------------------------------------------------------------- data
def _shapes(argv: list[str]) -> list[str]:
    spec = importlib.util.spec_from_file_location("tools_data_shapes_vl", SHAPES_TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON result
        return module.main(argv)


def write_datasets(args: argparse.Namespace, scratch: Path) -> tuple[Path, Path]:
    """The RL dataset (``--data-dir``) and, in ``scratch``, the pre-training pool and probe.
    Separate seeds give separate images; the probe is the pool tool's test split."""
    common = ["--size", str(args.size), "--max-count", str(args.max_count)]
    _shapes(
        [
            "--output-dir",
            str(args.data_dir),
            "--train-size",
            str(args.train_size),
            "--test-size",
            str(args.test_size),
            "--seed",
            str(args.seed),
            *common,
        ]
    )
    pool_dir = scratch / "sft_data"
    _shapes(
        [
            "--output-dir",
            str(pool_dir),
            "--train-size",
            str(args.pool_size),
            "--test-size",
            str(args.probe_size),
            "--seed",
            str(args.seed + _SFT_SEED_OFFSET),
            *common,
        ]
    )
    return Path(args.data_dir), pool_dir


def encode(dataset: RLHFDataset, tokenizer) -> list[Example]:
    """Every row as RL renders it, with its target response."""
    out = []
    for i in range(len(dataset)):
        item = dataset[i]
        answer = str(item["reward_model"]["ground_truth"])
        prompt = item["input_ids"][item["attention_mask"].bool()].tolist()
        target = tokenizer.encode(f"<think>{answer}</think>\\boxed{{{answer}}}", add_special_tokens=False)
        out.append(Example(answer, prompt, item["multi_modal_inputs"], target + [tokenizer.eos_token_id]))
    return out


def collate_sft(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded prompt + target, labels on the target only, the rows' images in row order."""
    length = max(len(e.prompt_ids) + len(e.target_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)  # (B, T)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)  # (B, T)
    for i, e in enumerate(examples):
        ids = e.prompt_ids + e.target_ids
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, len(e.prompt_ids) : len(ids)] = torch.tensor(e.target_ids)
        attention_mask[i, : len(ids)] = 1
    vision = concat_vision_inputs([e.vision for e in examples])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, **vision}


# ---------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model, tokenizer, examples: list[Example], *, max_new_tokens: int) -> dict[str, float]:
    """Greedy answers scored with EasyR1's ``math`` reward: mean accuracy and format rate."""
    model.eval()
    pad_id = tokenizer.pad_token_id
    width = max(len(e.prompt_ids) for e in examples)
    input_ids = torch.tensor([[pad_id] * (width - len(e.prompt_ids)) + e.prompt_ids for e in examples])
    attention_mask = (input_ids != pad_id).long()
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
        eos_token_id=tokenizer.eos_token_id,
        **concat_vision_inputs([e.vision for e in examples]),
    )  # (B, P + new)
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    scores = [math_compute_score(t, e.answer) for t, e in zip(texts, examples)]
    model.train()
    n = len(scores)
    return {
        "accuracy": sum(s["accuracy"] for s in scores) / n,
        "format": sum(s["format"] for s in scores) / n,
    }


# ------------------------------------------------------------------------------------ training
def pretrain(model, tokenizer, pool: list[Example], probe: list[Example], args) -> tuple[int, list]:
    """SFT on shuffled passes over ``pool`` until ``--steps`` or the probe reaches the target."""
    rng = random.Random(args.seed + _SFT_SEED_OFFSET)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / _WARMUP_STEPS))
    order: list[Example] = []
    curve = []
    model.train()
    for step in range(1, args.steps + 1):
        if len(order) < args.batch_size:
            order += rng.sample(pool, len(pool))
        batch, order = order[: args.batch_size], order[args.batch_size :]
        loss = model(**collate_sft(batch, tokenizer.pad_token_id)).loss  # mean over target tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.eval_every == 0 or step == args.steps:
            probe_scores = evaluate(model, tokenizer, probe, max_new_tokens=args.max_new_tokens)
            curve.append((step, round(probe_scores["accuracy"], 4), round(loss.item(), 4)))
            print(f"step {step}: loss {loss.item():.4f}, probe {probe_scores}", file=sys.stderr, flush=True)
            if probe_scores["accuracy"] >= args.target_accuracy:
                return step, curve
    return args.steps, curve


def build(args: argparse.Namespace, out_dir: Path) -> dict:
    """Write the data, train the policy, save it (with its processor) to ``out_dir``."""
    start = time.perf_counter()
    data_dir, pool_dir = write_datasets(args, out_dir)
    model, processor = build_tiny_qwen2_5_vl(seed=args.seed)
    # Save first: the dataset renders prompts through the processor loaded from the model directory.
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    vision, tokenizer, cfg = load_vision_processor(out_dir), processor.tokenizer, data_config(args)

    def rows(path: str) -> list[Example]:
        return encode(RLHFDataset(path, tokenizer, cfg, vision, limit_images=1), tokenizer)

    pool, probe, test = rows(f"{pool_dir}@train"), rows(f"{pool_dir}@test"), rows(f"{data_dir}@test")
    shutil.rmtree(pool_dir)
    before = evaluate(model, tokenizer, test, max_new_tokens=args.max_new_tokens)
    steps, curve = pretrain(model, tokenizer, pool, probe, args)
    after = evaluate(model, tokenizer, test, max_new_tokens=args.max_new_tokens)
    model.save_pretrained(out_dir, safe_serialization=True)
    return {
        "out": str(args.out),
        "data": f"{args.data_dir}@train / @test",
        "test_accuracy_random_init": round(before["accuracy"], 4),
        "test_accuracy": round(after["accuracy"], 4),
        "test_format_rate": round(after["format"], 4),
        "chance": round(1 / args.max_count, 4),
        "steps": steps,
        "probe_curve": curve,
        "params": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    return build_once(
        "make_tiny_vl_model",
        args,
        RECIPE_VERSION,
        build,  # writes the data too
        data_present=lambda: all(
            any((Path(args.data_dir) / "data").glob(f"{s}-*.parquet")) for s in ("train", "test")
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
