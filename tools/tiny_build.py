"""What the tiny-model builders (``make_tiny_model.py``, ``make_tiny_tool_model.py``,
``make_tiny_vl_model.py``) share, apart from pre-training (``sft_probe.py``): building ``--out``
once, their common flags, running a ``tools/data`` script, the text policies' shape and the
generation their evaluations share.

    import tiny_build   # tools/ on sys.path; tiny_build.run_builder(...), tiny_build.generate(...)

Build once. ``run_builder`` (a builder's ``main`` after parsing) skips the build when ``--out``
holds a ``stamp.json`` with the same arguments hash (and the data the build writes is there),
refuses an ``--out`` the tool did not write unless ``--force``, and otherwise builds into a
temporary sibling that replaces ``--out`` only when complete. It prints the build's JSON result
(``skipped`` says which way it went); stdout carries nothing else.

Boundaries: files, flags and transformers' ``generate``; what a builder trains, probes and scores
is its own, pre-training is ``sft_probe.py``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch

STAMP_FILE = "stamp.json"
POLICY_SHAPE = dict(
    hidden_size=256,
    num_heads=4,
    num_kv_heads=2,  # TP=2 gives each rank 2 query heads and 1 KV head
    head_dim=64,
    tie_word_embeddings=False,
    max_position_embeddings=128,
)
"""The text policies' width and attention (``build_tiny_hf_model`` keywords); the quickstart configs'
``model_arch`` repeats these numbers."""
SAMPLING = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
"""Plain sampling at temperature 1 (no top-k/top-p cut), as the RL rollout samples."""


# ---------------------------------------------------------------------------------------- flags
def builder_parser(
    doc: str,
    *,
    out: str,
    data_dir: str,
    train_size: int,
    test_size: int,
    data_help: str = "where train/test.parquet go",
    seed_help: str | None = "seeds the split, the init, SFT order and sampling",
    train_help: str = "RL train prompts",
) -> argparse.ArgumentParser:
    """A builder's parser (described by its docstring's first line), opening with the flags every
    builder has: where to write (``--out``, ``--data-dir``), ``--seed`` and the RL split's sizes,
    what ``write_split`` takes."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=out, help="model directory to write")
    parser.add_argument("--data-dir", default=data_dir, help=data_help)
    parser.add_argument("--seed", type=int, default=0, help=seed_help)
    parser.add_argument("--train-size", type=int, default=train_size, help=train_help)
    parser.add_argument("--test-size", type=int, default=test_size, help="held-out prompts (validation)")
    return parser


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    """``--threads`` and ``--force``, the last flags of every builder."""
    # One thread: these matmuls are too small to gain from two, and on a shared 2-core box two
    # threads spin-wait on each other (measured: 4-10x the CPU time and wall time of one).
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--force", action="store_true", help="rebuild even if --out has a matching stamp")


# ----------------------------------------------------------------------------------------- data
def load_script(name: str, path: Path) -> ModuleType:
    """The tools script at ``path`` as module ``name`` (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def write_split(
    data_tool: ModuleType, output_dir: str | Path, train_size: int, test_size: int, seed: int, *extra: str
) -> list[str]:
    """A train/test split written by a ``tools/data`` script's ``main`` (``extra``: its own flags)."""
    argv = ["--output-dir", str(output_dir), "--train-size", str(train_size)]
    argv += ["--test-size", str(test_size), "--seed", str(seed), *extra]
    # The data tool reports on stdout; the builder's must carry only its JSON result.
    with contextlib.redirect_stdout(sys.stderr):
        return data_tool.main(argv)


def parquet_splits_present(data_dir: str | Path) -> bool:
    """``train.parquet`` and ``test.parquet`` are both in ``data_dir``."""
    return all((Path(data_dir) / f"{split}.parquet").is_file() for split in ("train", "test"))


# ----------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def generate(
    model, tokenizer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, sample: bool = False, **inputs
) -> torch.Tensor:
    """The new tokens ``(B, new)`` that ``model.generate`` writes after each prompt (token ids):
    greedy, or ``SAMPLING`` with ``sample``; ``inputs`` go to the model too (pixel values)."""
    pad_id = tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    # Left padding puts every prompt's last token at the same column, as generate expects.
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])  # (B, P)
    # Masking by id equals masking by length: no templated text encodes to the pad token.
    out = model.generate(
        input_ids=input_ids,
        attention_mask=(input_ids != pad_id).long(),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=tokenizer.eos_token_id,
        **(SAMPLING if sample else dict(do_sample=False)),
        **inputs,
    )  # (B, P + new)
    return out[:, width:]


# ----------------------------------------------------------------------------------- build once
def publish(model, processor, out_dir: Path, scratch: Path) -> None:
    """The chosen ``model`` (safetensors) and its tokenizer or processor (``None``: already saved)
    into ``out_dir``; the pre-training ``scratch`` inside it goes, so only the model is published."""
    model.save_pretrained(out_dir, safe_serialization=True)
    if processor is not None:
        processor.save_pretrained(out_dir)
    shutil.rmtree(scratch)


def args_hash(args: argparse.Namespace, recipe_version: int) -> str:
    """Hash of everything that changes the outputs: every argument but ``--out`` and ``--force``
    (threads change rounding), and the recipe's version (bumped when the recipe changes in a way the
    arguments do not show)."""
    keys = {k: v for k, v in sorted(vars(args).items()) if k not in ("out", "force")}
    keys["recipe_version"] = recipe_version
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def read_stamp(out: Path) -> dict | None:
    path = out / STAMP_FILE
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f)


def replace_dir(tmp: Path, out: Path) -> None:
    """Move ``tmp`` to ``out``; an old ``out`` is moved aside first, since rename won't overwrite a dir."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def run_builder(
    tool: str,
    args: argparse.Namespace,
    recipe_version: int,
    build: Callable[[argparse.Namespace, Path], dict],
    write_data: Callable[[argparse.Namespace], object] | None = None,
    data_present: Callable[[argparse.Namespace], bool] | None = None,
) -> int:
    """A builder's ``main`` after parsing: ``--threads`` torch threads, no progress bars (they would
    be the only other output), then ``build_once`` with ``write_data(args)`` and
    ``data_present(args)`` (by default: ``parquet_splits_present(args.data_dir)``)."""
    import transformers

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    if data_present is None:
        present = functools.partial(parquet_splits_present, args.data_dir)
    else:
        present = functools.partial(data_present, args)
    write = None if write_data is None else functools.partial(write_data, args)
    return build_once(tool, args, recipe_version, build, present, write)


def build_once(
    tool: str,
    args: argparse.Namespace,
    recipe_version: int,
    build: Callable[[argparse.Namespace, Path], dict],
    data_present: Callable[[], bool],
    write_data: Callable[[], object] | None = None,
) -> int:
    """Build ``args.out`` with ``build(args, tmp_dir)`` unless its stamp matches (see the module doc).

    ``write_data`` writes the data files beside the model first (deterministic, so a matching stamp
    with the data gone rewrites only the data); without it ``build`` writes them, and a matching
    stamp with the data gone rebuilds."""
    out, digest = Path(args.out), args_hash(args, recipe_version)
    stamp = read_stamp(out)
    if out.exists() and stamp is None and not args.force:
        raise SystemExit(
            f"{tool}: {out} exists but has no {STAMP_FILE}, so this tool did not write it; "
            "pass --force to replace it or choose another --out."
        )
    if stamp is not None and stamp.get("args_hash") == digest and not args.force:
        if not data_present():
            if write_data is None:
                stamp = None  # the build writes the data: rebuild
            else:
                write_data()
        if stamp is not None:
            print(json.dumps({**stamp["result"], "skipped": True}))
            return 0
    if write_data is not None:
        write_data()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        result = build(args, tmp)
        with open(tmp / STAMP_FILE, "w") as f:
            json.dump({"args_hash": digest, "args": vars(args), "result": result}, f, indent=2)
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({**result, "skipped": False}))
    return 0
