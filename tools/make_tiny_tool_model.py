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
early stopping. Built once (``tools/tiny_build.py``): a second run with the same arguments skips,
``--force`` rebuilds. Takes a few minutes on this CPU machine (a local Ray, one megatron-core
process).

Boundaries: the transcripts, the probe and the two-turn evaluation (with the real calculator);
training is the SFT trainer's, the stamp and the generation loop ``tiny_build.py``'s.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rlhf_megatron.agent.loop import render_turn_ids
from rlhf_megatron.agent.tools.calculator import CalculatorTool
from rlhf_megatron.models.tiny import build_tiny_hf_model
from rlhf_megatron.rewards.tool_mult import compute_score

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_build  # noqa: E402
from sft_probe import SEED_OFFSET, add_pretraining_flags, pretrain  # noqa: E402

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
tool_mult = tiny_build.load_script("tools_data_tool_mult", TOOLS / "data" / "tool_mult.py")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = tiny_build.builder_parser(
        __doc__,
        out="outputs/tiny_tool_model",
        data_dir="outputs/data/tool_mult",
        train_size=2048,
        test_size=200,
    )
    p.add_argument("--probe-size", type=int, default=128, help="non-test problems for the early-stop probe")
    p.add_argument("--tool-share", type=float, default=0.25, help="share of transcripts that call the tool")
    p.add_argument(
        "--max-rounds",
        type=int,
        default=1,
        help="questions per transcript, 1 to this many (a new user question after each answer)",
    )
    add_pretraining_flags(
        p,
        steps=1500,
        batch_size=64,
        lr=1e-3,
        target=(
            "--target-copy-accuracy",
            0.9,
            "stop SFT once sampled trajectories that call the tool are right this often",
        ),
        eval_every=50,
    )
    p.add_argument("--samples-per-prompt", type=int, default=8, help="n for the sampled statistics (as GRPO)")
    tiny_build.add_common_flags(p)
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
def _generate(model, tok, prompts: list[list[int]], max_new_tokens: int, sample: bool) -> list[list[int]]:
    """Each prompt's new tokens, up to and including the eos (the turn ends there)."""
    rows = []
    for seq in tiny_build.generate(
        model, tok, prompts, max_new_tokens=max_new_tokens, sample=sample
    ).tolist():
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
        ffn_hidden_size=512,
        **tiny_build.POLICY_SHAPE,
        seed=args.seed,
        extra_words=TOOL_WORDS,
    )
    transcripts = Transcripts(tokenizer)
    train, test = tool_mult.split(args.train_size, args.test_size, args.seed)
    held_out = set(test)
    outside = [p for p in tool_mult.problems(args.seed + SEED_OFFSET) if p not in held_out]
    probe, pool = outside[: args.probe_size], outside[args.probe_size :]
    scratch = out_dir / "_pretraining"  # removed before out_dir is published
    rows = functools.partial(write_sft_rows, transcripts, pool, args)
    multiturn = ["data.multiturn.enable=true", "data.multiturn.tools_key=tools"]
    probe_fn = probe_copying(transcripts, probe, args)
    steps, curve, export = pretrain(args, model, tokenizer, scratch, rows, probe_fn, extra=multiturn)
    model = AutoModelForCausalLM.from_pretrained(export)
    greedy = evaluate(model, transcripts, test, seed=args.seed)
    sampled = evaluate(model, transcripts, test, n=args.samples_per_prompt, sample=True, seed=args.seed)
    tiny_build.publish(model, tokenizer, out_dir, scratch)
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
    """train/test.parquet through tools/data/tool_mult.py, so the files are exactly what it writes."""
    return tiny_build.write_split(tool_mult, args.data_dir, args.train_size, args.test_size, args.seed)


def main(argv: Sequence[str] | None = None) -> int:
    return tiny_build.run_builder(
        "make_tiny_tool_model", parse_args(argv), RECIPE_VERSION, build, write_rl_data
    )


if __name__ == "__main__":
    sys.exit(main())
