"""Build the CPU quickstart's starting policy: the tiny tokenizer and a small Llama-style model,
briefly pre-trained (supervised) on the arithmetic task so that it starts weak but not random.

    .venv/bin/python tools/make_tiny_model.py [--out outputs/tiny_model] [--data-dir outputs/data/arith]
    .venv/bin/python tools/make_tiny_model.py --arch qwen3_moe --out outputs/tiny_moe_model   # MoE quickstart
    .venv/bin/python tools/make_tiny_model.py --arch deepseek_v3 --out outputs/tiny_mla_model  # MLA quickstart

It writes the RL prompts first (``train.parquet`` and ``test.parquet`` in ``--data-dir``, through
``tools/data/arith.py``), then pre-trains a random model with the project's SFT trainer
(``rlhf_megatron.stages``, on one CPU process, through ``tools/sft_probe.py``), saves the chosen
checkpoint's Hugging Face export (safetensors, tokenizer, ``stamp.json``) and prints one JSON
object with the held-out accuracies.

Why "weak but not random": GRPO learns only from groups whose samples disagree. A random model
never answers correctly, so every group scores 0; a converged one always does. The recipe stops
pre-training once greedy accuracy on a probe set reaches ``--target-accuracy``. There the format
is learnt (greedy answers are all integers, most wrong ones off by a little: "near misses") and
sampling at temperature 1 finds the right answer for about half the prompts within 8 tries.
Accuracy climbs steeply around that point (about +0.1 per 5 steps), hence the frequent probe:
a checkpoint every ``--eval-every`` steps, exported and decoded greedily on the probe set.

Data hygiene: the three problem sets are disjoint. The test split (RL validation) is never
trained on. The probe is held out of pre-training too, so early stopping judges generalization.
Pre-training uses the rest, in its own RNG order. RL's train prompts are every non-test problem
(probe ones included), since ``(max_operand + 1) ** 2`` problems are all there are.

Takes about a minute on this CPU machine (a local Ray, one megatron-core process) and is
deterministic for a given seed and thread count. Built once (``tools/tiny_build.py``): a second
run with the same arguments finds the stamp and skips, ``--force`` rebuilds.

Boundaries: the arithmetic problems, their probe and their scoring; training is the SFT
trainer's, the stamp and the generation loop ``tiny_build.py``'s.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rlhf_megatron.data.synthetic import make_arith_rows, make_arith_split
from rlhf_megatron.models.tiny import VLLM_CPU_MLA, build_tiny_hf_model, build_tiny_moe_model
from rlhf_megatron.rewards.arith import compute_score

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_build  # noqa: E402
from sft_probe import SEED_OFFSET, add_pretraining_flags, pretrain  # noqa: E402

# Bump when the recipe changes in a way the arguments do not show, so old stamps stop matching.
RECIPE_VERSION = 2  # 2: pre-trained by the SFT trainer on megatron-core (was a PyTorch loop)
ARITH_TOOL = Path(__file__).resolve().parent / "data" / "arith.py"


@dataclass(frozen=True)
class Example:
    """One chat-templated problem for the probe and the evaluation: ``prompt_ids`` as RLHFDataset
    renders it (the SFT trainer renders the pre-training rows itself)."""

    question: str
    answer: str
    prompt_ids: list[int]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = tiny_build.builder_parser(
        __doc__,
        out="outputs/tiny_model",
        data_dir="outputs/data/arith",
        train_size=2048,
        test_size=200,
        train_help="RL train prompts (repeats the pool)",
    )
    p.add_argument("--max-operand", type=int, default=30, help="operands are drawn from 0..max-operand")
    p.add_argument(
        "--arch",
        choices=("llama", "qwen3_moe", "deepseek_v3"),
        default="llama",
        help="qwen3_moe: the mixture-of-experts quickstart's policy (--experts experts, top-2); "
        "deepseek_v3: the MLA quickstart's (the same experts plus a shared one, sigmoid routing with "
        "a correction bias, multi-latent attention at the sizes vLLM's CPU backend takes)",
    )
    p.add_argument("--experts", type=int, default=4, help="qwen3_moe, deepseek_v3: experts per sparse layer")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--ffn-hidden-size", type=int, default=512)
    add_pretraining_flags(
        p,
        steps=300,
        batch_size=64,
        lr=5e-4,
        target=(
            "--target-accuracy",
            0.2,
            "stop SFT at the first probe whose greedy accuracy reaches this; >1 disables early stop",
        ),
        eval_every=5,
    )
    p.add_argument("--probe-size", type=int, default=200, help="non-test problems for the early-stop probe")
    p.add_argument("--samples-per-prompt", type=int, default=8, help="n for the sampled accuracy (as GRPO)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="generation budget (match the RL config)")
    tiny_build.add_common_flags(p)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------- data
def write_rl_data(args: argparse.Namespace) -> list[str]:
    """train/test.parquet through tools/data/arith.py, so the files are exactly what it writes."""
    arith = tiny_build.load_script("tools_data_arith", ARITH_TOOL)
    split = (args.data_dir, args.train_size, args.test_size, args.seed)
    return tiny_build.write_split(arith, *split, "--max-operand", str(args.max_operand))


def split_problems(args: argparse.Namespace) -> tuple[list[dict], list[dict], list[dict]]:
    """(sft_pool, probe, test): test is the parquet's test split; the three are disjoint."""
    _, test = make_arith_split(args.train_size, args.test_size, args.seed, args.max_operand)
    held_out = {row["question"] for row in test}
    every = make_arith_rows((args.max_operand + 1) ** 2, args.seed + SEED_OFFSET, args.max_operand)
    outside = [row for row in every if row["question"] not in held_out]
    if args.probe_size >= len(outside):
        raise ValueError(
            f"make_tiny_model: --probe-size {args.probe_size} leaves no pre-training problems out of "
            f"{len(outside)} non-test ones; lower --probe-size or --test-size, or raise --max-operand."
        )
    # SFT never sees the probe, so early stopping judges generalization without touching test.
    return outside[args.probe_size :], outside[: args.probe_size], test


def encode(tokenizer, rows: list[dict]) -> list[Example]:
    """Template each question exactly as RLHFDataset does (chat template, no extra specials)."""
    out = []
    for row in rows:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["question"]}], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer.encode(text, add_special_tokens=False)
        out.append(Example(row["question"], row["answer"], prompt))
    return out


def write_sft_rows(rows: list[dict], path: Path) -> str:
    """The pre-training problems as single-turn SFT rows (``question`` -> ``answer``): the SFT
    trainer renders the question as RLHFDataset does and trains on the answer and its eos."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.Table.from_pylist([{"question": r["question"], "answer": r["answer"]} for r in rows]), path
    )
    return str(path)


# ---------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    examples: list[Example],
    *,
    n: int = 1,
    sample: bool = False,
    seed: int = 0,
    max_new_tokens: int = 8,
) -> dict[str, float]:
    """Score ``n`` generations per prompt with the arith scorer, decoded as the RL side decodes.

    Returns accuracy (mean reward), format_rate (responses that are an integer), pass_at_n
    (prompts with a correct sample) and group_signal (prompts whose n samples disagree, i.e. a
    nonzero GRPO advantage).
    """
    model.eval()
    rows = [e for e in examples for _ in range(n)]
    torch.manual_seed(seed)
    new = tiny_build.generate(
        model, tokenizer, [e.prompt_ids for e in rows], max_new_tokens=max_new_tokens, sample=sample
    )
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    scores = torch.tensor([compute_score(t, e.answer) for t, e in zip(texts, rows)]).view(len(examples), n)
    integers = sum(t.strip().lstrip("-").isdigit() for t in texts)
    model.train()
    return {
        "accuracy": scores.mean().item(),
        "format_rate": integers / len(texts),
        "pass_at_n": (scores.max(dim=1).values > 0).float().mean().item(),
        "group_signal": (scores.max(dim=1).values != scores.min(dim=1).values).float().mean().item(),
    }


# ------------------------------------------------------------------------------------ training
def probe_accuracy(tokenizer, probe: list[Example], args):
    """The early stop: greedy accuracy on the probe set reaches ``--target-accuracy``."""

    def probe_fn(step: int, hf_dir: Path) -> tuple[dict, bool]:
        model = AutoModelForCausalLM.from_pretrained(hf_dir)
        acc = evaluate(model, tokenizer, probe, max_new_tokens=args.max_new_tokens)["accuracy"]
        return {"accuracy": round(acc, 4)}, acc >= args.target_accuracy

    return probe_fn


def build(args: argparse.Namespace, out_dir: Path) -> dict:
    """Train the policy, save it to ``out_dir`` and return the result record."""
    start = time.perf_counter()
    shape = dict(num_layers=args.num_layers, **tiny_build.POLICY_SHAPE, seed=args.seed)
    if args.arch in ("qwen3_moe", "deepseek_v3"):
        # Every layer sparse: experts of half the dense width, two per token (the same active size).
        # DeepSeek-V3 adds a shared expert of that width and its latent attention (vLLM on CPU runs
        # MLA only with DeepSeek's latent sizes, VLLM_CPU_MLA).
        mla = dict(mla=VLLM_CPU_MLA) if args.arch == "deepseek_v3" else {}
        model, tokenizer = build_tiny_moe_model(
            family=args.arch,
            num_experts=args.experts,
            top_k=2,
            expert_ffn_hidden_size=args.ffn_hidden_size // 2,
            **mla,
            **shape,
        )
    else:
        model, tokenizer = build_tiny_hf_model(arch="llama", ffn_hidden_size=args.ffn_hidden_size, **shape)
    pool_rows, probe_rows, test_rows = split_problems(args)
    probe, test = encode(tokenizer, probe_rows), encode(tokenizer, test_rows)
    scratch = out_dir / "_pretraining"  # removed before out_dir is published
    rows, probe_fn = functools.partial(write_sft_rows, pool_rows), probe_accuracy(tokenizer, probe, args)
    steps, curve, export = pretrain(args, model, tokenizer, scratch, rows, probe_fn)
    model = AutoModelForCausalLM.from_pretrained(export)

    greedy = evaluate(model, tokenizer, test, seed=args.seed, max_new_tokens=args.max_new_tokens)
    sampled = evaluate(
        model,
        tokenizer,
        test,
        n=args.samples_per_prompt,
        sample=True,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
    )
    tiny_build.publish(model, tokenizer, out_dir, scratch)
    return {
        "out": str(args.out),
        "data_dir": str(args.data_dir),
        "greedy_accuracy": round(greedy["accuracy"], 4),
        "sampled_accuracy": round(sampled["accuracy"], 4),
        "greedy_format_rate": round(greedy["format_rate"], 4),
        "sampled_format_rate": round(sampled["format_rate"], 4),
        "sampled_pass_at_n": round(sampled["pass_at_n"], 4),
        "sampled_group_signal": round(sampled["group_signal"], 4),
        "samples_per_prompt": args.samples_per_prompt,
        "test_prompts": len(test),
        "steps": steps,
        "probe_curve": curve,
        "params": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    return tiny_build.run_builder("make_tiny_model", parse_args(argv), RECIPE_VERSION, build, write_rl_data)


if __name__ == "__main__":
    sys.exit(main())
