"""Build the tool-use quickstart's starting policy: a tiny Llama-style model that has seen the
hermes tool-call format, and the ``tool_mult`` task (``"What is 37*48?"``).

    .venv/bin/python tools/make_tiny_tool_model.py [--out outputs/tiny_tool_model] [--data-dir outputs/data/tool_mult]

It writes the RL prompts first (``train.parquet`` and ``test.parquet`` in ``--data-dir``, through
``tools/data/tool_mult.py``), then pre-trains a random model with the project's SFT trainer
(``rlhf_megatron.stages``, multi-turn rows with the tool's schema, through ``tools/sft_probe.py``),
saves the chosen checkpoint's Hugging Face export (safetensors, tokenizer, ``stamp.json``) and
prints one JSON object with what the model does on held-out problems.

The recipe. Two-digit products are beyond a 2-layer model's head; the ``calculator`` tool
(``configs/tools/calculator.yaml``) knows them. Pre-training mixes two kinds of transcripts,
rendered through the tokenizer's chat template with the tool's schema, exactly as the
multi-turn rollout renders them (the SFT trainer's chat rendering gives the same ids and loss
mask as ``Transcripts.example``; ``tests/tools/test_make_tiny_tool_model.py`` checks it):

* with the tool (``--tool-share``, default 0.25): ``<tool_call>{"name": "calculator",
  "arguments": {"expression": "37*48"}}</tool_call>``, the tool turn
  ``<tool_response>1776</tool_response>`` (masked out of the loss, as RL masks it), then
  ``1776``;
* without: the answer at once (``1776``), which the model can only guess.

Each pre-training problem is one SFT row, with or without the tool (drawn per row), one epoch
every ``len(pool) / --batch-size`` steps. So the starting policy calls the tool about a quarter of the time and copies its answer when it
does, and answers from its head (almost always wrongly) otherwise: GRPO groups disagree (the
calling samples win), and RL has a behaviour to raise, the tool-call rate. Greedy decoding
starts by answering directly, so validation accuracy starts near 0 and jumps once calling
becomes the likelier first move. Pre-training stops once sampled copies from the tool are right
(``--target-copy-accuracy``) and the first-move share matches the mix.

Token in, token out: the tokenizer has single tokens for ``<tool_call>``, ``</tool_call>``,
``<tool_response>``, ``</tool_response>``, the JSON head of a calculator call and its tail, so a
whole trajectory (call, tool turn, answer) is about 25 tokens.

Data hygiene: the test split (RL validation) is never trained on, nor is the probe used for
early stopping. A second run with the same arguments finds the stamp and skips (``--force``
rebuilds); the output directory is written to a temporary sibling and renamed into place.
Takes a few minutes on this CPU machine (a local Ray, one megatron-core process).

Boundaries: the transcripts, the probe and the evaluation (transformers' ``generate``, the real
calculator); training is the SFT trainer's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import random
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

from rlhf_megatron.agent.loop import render_turn_ids
from rlhf_megatron.agent.tools.calculator import CalculatorTool
from rlhf_megatron.models.tiny import build_tiny_hf_model
from rlhf_megatron.rewards.tool_mult import compute_score

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sft_probe import SEED_OFFSET, pretrain, save_base  # noqa: E402
from stamped_build import build_once  # noqa: E402

RECIPE_VERSION = 2  # 2: pre-trained by the SFT trainer on megatron-core (was a PyTorch loop)
TOOLS = Path(__file__).resolve().parent
CALL_HEAD = '{"name": "calculator", "arguments": {"expression": "'
CALL_TAIL = '"}}'
# Single tokens: the hermes markers and the fixed parts of a calculator call (see the docstring).
TOOL_WORDS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    CALL_HEAD,
    CALL_TAIL,
    "What is ",
)


def _load_tool(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


tool_mult = _load_tool("tools_data_tool_mult", TOOLS / "data" / "tool_mult.py")
base = _load_tool("tools_make_tiny_model", TOOLS / "make_tiny_model.py")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="outputs/tiny_tool_model", help="model directory to write")
    p.add_argument("--data-dir", default="outputs/data/tool_mult", help="where train/test.parquet go")
    p.add_argument("--seed", type=int, default=0, help="seeds the split, the init, SFT order and sampling")
    p.add_argument("--train-size", type=int, default=2048, help="RL train prompts")
    p.add_argument("--test-size", type=int, default=200, help="held-out prompts (validation)")
    p.add_argument("--probe-size", type=int, default=128, help="non-test problems for the early-stop probe")
    p.add_argument("--tool-share", type=float, default=0.25, help="share of transcripts that call the tool")
    p.add_argument(
        "--max-rounds",
        type=int,
        default=1,
        help="questions per transcript, 1 to this many (a new user question after each answer)",
    )
    p.add_argument("--steps", type=int, default=1500, help="most SFT steps (fewer when the target is hit)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--target-copy-accuracy",
        type=float,
        default=0.9,
        help="stop SFT once sampled trajectories that call the tool are right this often",
    )
    p.add_argument("--eval-every", type=int, default=50, help="SFT steps between probe evaluations")
    p.add_argument("--samples-per-prompt", type=int, default=8, help="n for the sampled statistics (as GRPO)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--force", action="store_true", help="rebuild even if --out has a matching stamp")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------- transcripts
class Transcripts:
    """Token ids of prompts, calls, tool turns and answers, rendered as the rollout renders them."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.tools = [CalculatorTool({}).get_openai_tool_schema().model_dump(exclude_none=True)]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def prompt(self, a: int, b: int) -> list[int]:
        messages = [{"role": "user", "content": tool_mult.question(a, b)}]
        ids = self.tok.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def call(self, a: int, b: int) -> list[int]:
        return self.encode(f"<tool_call>{CALL_HEAD}{a}*{b}{CALL_TAIL}</tool_call>") + [self.tok.eos_token_id]

    def tool_turn(self, result: str) -> list[int]:
        return render_turn_ids(self.tok, [{"role": "tool", "content": result}])

    def answer(self, value: str) -> list[int]:
        return self.encode(value) + [self.tok.eos_token_id]

    def question_turn(self, a: int, b: int) -> list[int]:
        """A follow-up question after an answer, as an interaction's user turn is appended."""
        return render_turn_ids(self.tok, [{"role": "user", "content": tool_mult.question(a, b)}])

    def example(
        self, a: int, b: int, with_tool: bool, follow_ups: Sequence[tuple[int, int]] = ()
    ) -> tuple[list[int], list[int]]:
        """(ids, labels) of one transcript: labels -100 on the prompt, tool turns and follow-up
        questions (each answered the way the first one is)."""
        parts = [(self.prompt(a, b), False)]
        for index, (x, y) in enumerate([(a, b), *follow_ups]):
            if index:
                parts.append((self.question_turn(x, y), False))
            if with_tool:
                parts += [(self.call(x, y), True), (self.tool_turn(str(x * y)), False)]
            parts.append((self.answer(str(x * y)), True))
        ids = [i for part, _ in parts for i in part]
        labels = [i if trained else -100 for part, trained in parts for i in part]
        return ids, labels


def transcript_messages(
    a: int, b: int, with_tool: bool, follow_ups: Sequence[tuple[int, int]] = ()
) -> list[dict[str, str]]:
    """``Transcripts.example`` as chat messages (the SFT trainer's rows): the call is the
    assistant's text, as the policy samples it, then the tool's turn, then the answer."""
    messages = []
    for x, y in [(a, b), *follow_ups]:
        messages.append({"role": "user", "content": tool_mult.question(x, y)})
        if with_tool:
            messages.append(
                {"role": "assistant", "content": f"<tool_call>{CALL_HEAD}{x}*{y}{CALL_TAIL}</tool_call>"}
            )
            messages.append({"role": "tool", "content": str(x * y)})
        messages.append({"role": "assistant", "content": str(x * y)})
    return messages


def write_sft_rows(transcripts: Transcripts, pool, args: argparse.Namespace, path: Path) -> str:
    """One multi-turn SFT row per pre-training problem; with the tool at ``--tool-share``, and
    0 to ``--max-rounds - 1`` follow-up questions (drawn from the pool), each drawn per row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(args.seed + SEED_OFFSET)
    tools = json.dumps(transcripts.tools)
    rows = []
    for a, b in pool:
        with_tool = rng.random() < args.tool_share
        follow_ups = [rng.choice(pool) for _ in range(rng.randrange(args.max_rounds))]
        rows.append(
            {"messages": json.dumps(transcript_messages(a, b, with_tool, follow_ups)), "tools": tools}
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


# ---------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def _generate(model, tok, prompts: list[list[int]], max_new_tokens: int, sample: bool) -> list[list[int]]:
    pad = tok.pad_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # (B, P)
    attention_mask = (input_ids != pad).long()
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad,
        eos_token_id=tok.eos_token_id,
        **sampling,
    )
    rows = []
    for seq in out[:, width:].tolist():
        rows.append(seq[: seq.index(tok.eos_token_id) + 1] if tok.eos_token_id in seq else seq)
    return rows


@torch.no_grad()
def evaluate(
    model, transcripts: Transcripts, pairs, *, n: int = 1, sample: bool = False, seed: int = 0
) -> dict:
    """Play the two-turn episode with the real calculator: first move, then (after a call) the
    tool's answer appended and a second move. Returns accuracy (tool_mult scorer on the decoded
    trajectory), tool_rate (first moves that are a well-formed call), copy_accuracy (right among
    those) and group_signal (prompts whose n samples disagree)."""
    from rlhf_megatron.agent.calls import parse_hermes
    from rlhf_megatron.agent.tools.calculator import evaluate_expression, format_number

    tok = transcripts.tok
    model.eval()
    torch.manual_seed(seed)
    rows = [(a, b) for a, b in pairs for _ in range(n)]
    prompts = [transcripts.prompt(a, b) for a, b in rows]
    first = _generate(model, tok, prompts, 16, sample)
    texts, calls = [], []
    for ids in first:
        _, parsed, errors = parse_hermes(tok.decode(ids, skip_special_tokens=True))
        calls.append(parsed[0] if parsed and not errors else None)
    second_idx = [i for i, c in enumerate(calls) if c is not None]
    follow = []
    for i in second_idx:
        try:
            result = format_number(evaluate_expression(json.loads(calls[i].arguments).get("expression", "")))
        except Exception as exc:  # a bad expression: the loop would return an error message
            result = f"Error: {exc}"
        follow.append(prompts[i] + first[i] + transcripts.tool_turn(result))
    second = dict(zip(second_idx, _generate(model, tok, follow, 8, sample))) if follow else {}
    for i, ids in enumerate(first):
        tail = second.get(i, [])
        turn = transcripts.tool_turn("") if i in second else []  # only the markers matter to the scorer
        texts.append(tok.decode(ids + turn + tail, skip_special_tokens=True))
    scores = torch.tensor([compute_score(t, str(a * b)) for t, (a, b) in zip(texts, rows)]).view(
        len(pairs), n
    )
    model.train()
    called = torch.tensor([c is not None for c in calls]).float()
    copy = scores.flatten()[called.bool()]
    return {
        "accuracy": round(scores.mean().item(), 4),
        "tool_rate": round(called.mean().item(), 4),
        "copy_accuracy": round(copy.mean().item(), 4) if len(copy) else 0.0,
        "group_signal": round(
            (scores.max(dim=1).values != scores.min(dim=1).values).float().mean().item(), 4
        ),
    }


# ------------------------------------------------------------------------------------ training
def probe_copying(transcripts: Transcripts, probe, args):
    """The early stop: sampled trajectories that call the tool are right ``--target-copy-accuracy``
    of the time."""

    def probe_fn(step: int, hf_dir: Path) -> tuple[dict, bool]:
        model = AutoModelForCausalLM.from_pretrained(hf_dir)
        stats = evaluate(model, transcripts, probe, n=2, sample=True, seed=args.seed + step)
        return stats, stats["copy_accuracy"] >= args.target_copy_accuracy and stats["tool_rate"] > 0

    return probe_fn


def build(args: argparse.Namespace, out_dir: Path) -> dict:
    start = time.perf_counter()
    model, tokenizer = build_tiny_hf_model(
        arch="llama",
        num_layers=2,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        ffn_hidden_size=512,
        tie_word_embeddings=False,
        max_position_embeddings=128,
        seed=args.seed,
        extra_words=TOOL_WORDS,
    )
    transcripts = Transcripts(tokenizer)
    train, test = tool_mult.split(args.train_size, args.test_size, args.seed)
    held_out = set(test)
    outside = [p for p in tool_mult.problems(args.seed + SEED_OFFSET) if p not in held_out]
    probe, pool = outside[: args.probe_size], outside[args.probe_size :]
    # The random model is the SFT run's starting point; scratch goes before out_dir is published.
    scratch = out_dir / "_pretraining"
    steps, curve, export = pretrain(
        args,
        save_base(model, tokenizer, scratch),
        write_sft_rows(transcripts, pool, args, scratch / "sft" / "train.parquet"),
        probe_copying(transcripts, probe, args),
        scratch,
        extra=["data.multiturn.enable=true", "data.multiturn.tools_key=tools"],
    )
    model = AutoModelForCausalLM.from_pretrained(export)
    greedy = evaluate(model, transcripts, test, seed=args.seed)
    sampled = evaluate(model, transcripts, test, n=args.samples_per_prompt, sample=True, seed=args.seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    shutil.rmtree(scratch)
    return {
        "out": str(args.out),
        "data_dir": str(args.data_dir),
        "greedy": greedy,
        "sampled": sampled,
        "samples_per_prompt": args.samples_per_prompt,
        "test_prompts": len(test),
        "steps": steps,
        "probe_curve": curve,
        "params": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.perf_counter() - start, 1),
    }


def write_rl_data(args: argparse.Namespace) -> list[str]:
    argv = ["--output-dir", str(args.data_dir), "--train-size", str(args.train_size)]
    argv += ["--test-size", str(args.test_size), "--seed", str(args.seed)]
    with contextlib.redirect_stdout(sys.stderr):
        return tool_mult.main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    return build_once(
        "make_tiny_tool_model",
        args,
        RECIPE_VERSION,
        build,
        data_present=lambda: all((Path(args.data_dir) / f"{s}.parquet").is_file() for s in ("train", "test")),
        write_data=lambda: write_rl_data(args),
    )


if __name__ == "__main__":
    sys.exit(main())
