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

Takes a few minutes on this CPU machine. Deterministic for a given seed and thread count; built
once (``tools/tiny_build.py``): a second run with the same arguments skips, ``--force`` rebuilds.

Boundaries: the image data, its probe and its scoring; training is the SFT trainer's, the stamp
and the generation loop ``tiny_build.py``'s.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from rlhf_megatron.config.schema import DataConfig
from rlhf_megatron.data.dataset import RLHFDataset
from rlhf_megatron.data.multimodal import concat_vision_inputs, load_vision_processor
from rlhf_megatron.models.tiny import build_tiny_qwen2_5_vl
from rlhf_megatron.rewards.easyr1 import math_compute_score

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_build  # noqa: E402
from sft_probe import SEED_OFFSET, add_pretraining_flags, pretrain  # noqa: E402

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
    p = tiny_build.builder_parser(
        __doc__,
        out="outputs/tiny_vl_model",
        data_dir="outputs/data/shapes_vl",
        train_size=1024,
        test_size=100,
        data_help="dataset directory (data/*.parquet)",
        seed_help=None,
    )
    p.add_argument("--pool-size", type=int, default=1024, help="pre-training images (a separate draw)")
    p.add_argument("--probe-size", type=int, default=100, help="images for the early-stop probe")
    p.add_argument("--size", type=int, default=56, help="image side in pixels (4 x 4 patches of 14)")
    p.add_argument("--max-count", type=int, default=4, help="most squares in one image")
    p.add_argument("--prompt-length", type=int, default=64, help="data.max_prompt_length of the RL config")
    add_pretraining_flags(
        p,
        steps=400,
        batch_size=32,
        lr=1e-3,
        target=("--target-accuracy", 0.45, "stop at the first probe reaching this"),
        eval_every=10,
    )
    p.add_argument("--max-new-tokens", type=int, default=12, help="generation budget (match the RL config)")
    tiny_build.add_common_flags(p)
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
def write_datasets(args: argparse.Namespace, scratch: Path) -> tuple[Path, Path]:
    """The RL dataset (``--data-dir``) and, in ``scratch``, the pre-training pool and probe.
    Separate seeds give separate images; the probe is the pool tool's test split."""
    shapes = tiny_build.load_script("tools_data_shapes_vl", SHAPES_TOOL)
    common = ["--size", str(args.size), "--max-count", str(args.max_count)]
    tiny_build.write_split(shapes, args.data_dir, args.train_size, args.test_size, args.seed, *common)
    pool_dir = scratch / "sft_data"
    tiny_build.write_split(
        shapes, pool_dir, args.pool_size, args.probe_size, args.seed + SEED_OFFSET, *common
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
    prompts, vision = [e.prompt_ids for e in examples], concat_vision_inputs([e.vision for e in examples])
    new = tiny_build.generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, **vision)
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
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
    scratch = out_dir / "_pretraining"  # removed before out_dir is published
    pixels = args.size * args.size
    keys = [*SFT_DATA_KEYS, f"data.min_pixels={pixels}", f"data.max_pixels={pixels}"]
    sft_rows, probe_fn = functools.partial(write_sft_rows, pool_dir), probe_accuracy(tokenizer, probe, args)
    steps, curve, export = pretrain(args, model, processor, scratch, sft_rows, probe_fn, extra=keys)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(export)
    after = evaluate(model, tokenizer, test, max_new_tokens=args.max_new_tokens)
    tiny_build.publish(model, None, out_dir, scratch)  # the processor went in before pre-training
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


def rl_data_present(args: argparse.Namespace) -> bool:
    """Both splits in ``--data-dir``, in EasyR1's layout: ``data/train-*.parquet``, ``data/test-*.parquet``."""
    return all(any((Path(args.data_dir) / "data").glob(f"{s}-*.parquet")) for s in ("train", "test"))


def main(argv: Sequence[str] | None = None) -> int:
    # No write_data: build writes the RL data too, beside the pre-training pool it draws the same way.
    args = parse_args(argv)
    return tiny_build.run_builder(
        "make_tiny_vl_model", args, RECIPE_VERSION, build, data_present=rl_data_present
    )


if __name__ == "__main__":
    sys.exit(main())
