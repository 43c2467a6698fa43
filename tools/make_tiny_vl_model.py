"""Build the image quickstart's starting policy: a tiny Qwen2.5-VL briefly pre-trained (supervised)
on a synthetic image task, so that it starts weak but not random.

    .venv/bin/python tools/make_tiny_vl_model.py [--out outputs/tiny_vl_model] [--data-dir outputs/data/shapes_vl]

The task (``tools/data/shapes_vl.py``, EasyR1's layout): a small image with 1 to
``--max-count`` coloured squares and the question "How many squares are in the image?"; the
answer is the count. The policy answers as EasyR1's ``math`` reward wants,
``<think>N</think>\\boxed{N}``. The tool writes the RL data first (``<data-dir>/data/train-*``
and ``test-*`` parquet files: ``data.train_files=<data-dir>@train``), then builds the model
(``rlhf_megatron.models.tiny.build_tiny_qwen2_5_vl``: vision tower of depth 2 and width 128,
language model of width 256), pre-trains it with the project's SFT trainer (``rlhf_megatron.stages``,
image rows on megatron-core, through ``tools/sft_probe.py``) on a separate pool of images and
saves the chosen checkpoint's Hugging Face export with its processor and ``stamp.json``. It
prints one JSON object with the held-out accuracies.

The SFT rows are the pool's RL rows plus a ``response`` column: the SFT trainer renders
``problem`` and its image through the model's processor with the same pixel bounds as the
quickstart config (``--size``), so pre-training sees the token ids and pixel values RL will
(``tests/tools/test_make_tiny_vl_model.py`` checks it against ``RLHFDataset``).

Why "weak but not random": GRPO learns only from groups whose samples disagree (see
``tools/make_tiny_model.py``). Pre-training stops once greedy accuracy on a probe set (held
out of pre-training, disjoint from the RL test split) reaches ``--target-accuracy``; by then the
answer format is learnt and the count is right somewhat more often than a guess.

Takes a few minutes on this CPU machine. Deterministic for a given seed and thread count; a second run with the same arguments finds the
stamp and skips (``--force`` rebuilds); the output directory is written to a temporary sibling
and renamed into place.

Boundaries: the data, the probe and the evaluation (transformers' ``generate``); training is the
SFT trainer's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import Qwen2_5_VLForConditionalGeneration

from rlhf_megatron.config.schema import DataConfig
from rlhf_megatron.data.dataset import RLHFDataset
from rlhf_megatron.data.multimodal import concat_vision_inputs, load_vision_processor
from rlhf_megatron.models.tiny import build_tiny_qwen2_5_vl
from rlhf_megatron.rewards.easyr1 import math_compute_score

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_probe import SEED_OFFSET, pretrain, save_base  # noqa: E402
from stamped_build import build_once  # noqa: E402

RECIPE_VERSION = 2  # 2: pre-trained by the SFT trainer on megatron-core (was a PyTorch loop)
SHAPES_TOOL = Path(__file__).resolve().parent / "data" / "shapes_vl.py"
SFT_DATA_KEYS = ("data.prompt_key=problem", "data.response_key=response", "data.image_key=images")
"""The SFT trainer's keys for ``write_sft_rows``' columns."""


@dataclass(frozen=True)
class Example:
    """One rendered problem: the prompt as RL sees it and its images."""

    answer: str
    prompt_ids: list[int]  # unpadded, image pads expanded
    vision: dict  # this row's pixel_values [patches, D] and image_grid_thw [images, 3]


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
            str(args.seed + SEED_OFFSET),
            *common,
        ]
    )
    return Path(args.data_dir), pool_dir


def encode(dataset: RLHFDataset) -> list[Example]:
    """Every row as RL renders it."""
    out = []
    for i in range(len(dataset)):
        item = dataset[i]
        prompt = item["input_ids"][item["attention_mask"].bool()].tolist()
        out.append(Example(str(item["reward_model"]["ground_truth"]), prompt, item["multi_modal_inputs"]))
    return out


def target(answer: str) -> str:
    """The response the policy is pre-trained to write (EasyR1's ``math`` format)."""
    return f"<think>{answer}</think>\\boxed{{{answer}}}"


def write_sft_rows(pool_dir: Path, path: Path) -> str:
    """The pool's RL rows (``problem``, ``images``) with their ``response``: single-turn SFT rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.concat_tables(pq.read_table(f) for f in sorted((pool_dir / "data").glob("train-*.parquet")))
    responses = [target(a) for a in table.column("answer").to_pylist()]
    table = table.append_column("response", pa.array(responses, pa.string()))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return str(path)


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
def probe_accuracy(tokenizer, probe: list[Example], args):
    """The early stop: greedy accuracy on the probe images reaches ``--target-accuracy``."""

    def probe_fn(step: int, hf_dir: Path) -> tuple[dict, bool]:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir)
        scores = evaluate(model, tokenizer, probe, max_new_tokens=args.max_new_tokens)
        print(f"step {step}: probe {scores}", file=sys.stderr, flush=True)
        return {k: round(v, 4) for k, v in scores.items()}, scores["accuracy"] >= args.target_accuracy

    return probe_fn


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
        return encode(RLHFDataset(path, tokenizer, cfg, vision, limit_images=1))

    probe, test = rows(f"{pool_dir}@test"), rows(f"{data_dir}@test")
    before = evaluate(model, tokenizer, test, max_new_tokens=args.max_new_tokens)
    # The random model is the SFT run's starting point; scratch goes before out_dir is published.
    scratch = out_dir / "_pretraining"
    pixels = args.size * args.size
    steps, curve, export = pretrain(
        args,
        save_base(model, processor, scratch),
        write_sft_rows(pool_dir, scratch / "sft" / "train.parquet"),
        probe_accuracy(tokenizer, probe, args),
        scratch,
        extra=[*SFT_DATA_KEYS, f"data.min_pixels={pixels}", f"data.max_pixels={pixels}"],
    )
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(export)
    after = evaluate(model, tokenizer, test, max_new_tokens=args.max_new_tokens)
    model.save_pretrained(out_dir, safe_serialization=True)
    shutil.rmtree(scratch)
    shutil.rmtree(pool_dir)
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
