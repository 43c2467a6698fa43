"""``convert``: Hugging Face ⇄ megatron-core checkpoints (``tools/convert_ckpt.py``, ``rlhf-megatron convert``).

Subcommands:

- ``hf-to-mcore --hf DIR --out DIR --tp N --pp N [--vpp N] [--ep N [--etp N]]``:
  build the model at that layout on ``lcm(tp, etp × ep) × pp`` gloo ranks (spawned
  here, or the current ranks when started under torchrun), let each rank read only
  its slices of the HF safetensors (a mixture-of-experts rank: only its experts),
  and save megatron's distributed checkpoint plus our metadata
  (``models/checkpoint.py`` describes the layout). Loadable at any layout, EP
  included. Next-token-prediction (MTP) layers past ``num_hidden_layers``
  (DeepSeek-V3, GLM-4.5) are not trained: they are copied as stored into the
  checkpoint's ``mtp_layers/``, with a message on stderr (``models/mtp.py``).
- ``mcore-to-hf --ckpt DIR --out DIR``: stream a model checkpoint (converted,
  or a trainer's ``<ckpt>/model``) to HF safetensors one tensor at a time, in
  one process, with megatron's loader reading one tensor per call. Memory is
  bounded by the largest tensor, whatever the model size (Qwen3-VL-MoE: by one
  layer's experts, which its HF checkpoint stacks into one tensor per
  projection). A checkpoint's ``mtp_layers/`` tensors are written back unchanged.
- ``lora-to-peft --ckpt DIR --out DIR [--base HF_DIR]``: a LoRA training
  checkpoint's adapter (``<step>/actor/adapter``; ``--ckpt`` may name it, the
  actor or the step) as a PEFT adapter directory (``PeftModel.from_pretrained``,
  vLLM's ``LoRARequest``), checked against the base model's ``config.json``.
- ``lora-to-hf --ckpt DIR --out DIR [--base HF_DIR]``: the base model with the
  adapter merged in (``W + alpha/r * B A``), streamed tensor by tensor from the
  base's safetensors like ``mcore-to-hf``, with its config and tokenizer.
  The base is ``--base`` or the adapter's ``base_model_name_or_path``.

All validate everything they can before writing, write into a temporary
directory next to ``--out`` and rename it at the end (an interrupted run leaves
no partial output), and refuse to replace ``--out`` without ``--force``.
A full fine-tuning checkpoint given to ``lora-to-*``, or a LoRA one given to
``mcore-to-hf``, is refused with the subcommand to use instead.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from rlhf_megatron.convert.checkpoint import conversion_world_size, convert_hf_to_mcore, convert_mcore_to_hf
from rlhf_megatron.convert.common import DTYPES, ConversionError
from rlhf_megatron.convert.lora import convert_lora_to_hf, convert_lora_to_peft
from rlhf_megatron.models.hf_io import HFCheckpointError
from rlhf_megatron.models.spec import SpecError, StageError
from rlhf_megatron.planning.model_arch import UnsupportedModelError

__all__ = [
    "ConversionError",
    "build_parser",
    "conversion_world_size",
    "convert_hf_to_mcore",
    "convert_lora_to_hf",
    "convert_lora_to_peft",
    "convert_mcore_to_hf",
    "main",
]


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"size {text!r}: use e.g. 500MB, 2GB or 123456 (bytes)")
    return int(float(m.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[m.group(2)])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    h2m = sub.add_parser("hf-to-mcore", help="HF safetensors -> megatron distributed checkpoint")
    h2m.add_argument("--hf", required=True, type=Path, help="HF model directory (config.json + safetensors)")
    h2m.add_argument("--out", required=True, type=Path, help="checkpoint directory to create")
    h2m.add_argument("--tp", type=int, default=1, help="tensor-parallel size to convert at")
    h2m.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to convert at")
    h2m.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    h2m.add_argument("--ep", type=int, default=1, help="expert-parallel size (mixture-of-experts models)")
    h2m.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp)")
    h2m.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter dtype to store")
    h2m.add_argument(
        "--head",
        choices=["lm", "value", "reward"],
        default=None,
        help="model head (default: from config.json's architectures)",
    )
    h2m.add_argument("--force", action="store_true", help="replace --out if it exists")
    m2h = sub.add_parser("mcore-to-hf", help="megatron model checkpoint -> HF safetensors")
    m2h.add_argument(
        "--ckpt", required=True, type=Path, help="checkpoint dir, or a trainer checkpoint holding model/"
    )
    m2h.add_argument("--out", required=True, type=Path, help="HF directory to create")
    m2h.add_argument(
        "--hf-config",
        type=Path,
        default=None,
        help="take config.json/tokenizer from this HF dir instead of the checkpoint's copies",
    )
    m2h.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="output dtype (default: as saved)")
    m2h.add_argument(
        "--max-shard-size", type=_parse_size, default=2 * 1024**3, help="e.g. 2GB (default), 500MB"
    )
    m2h.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the checkpoint files")
    m2h.add_argument("--no-progress", action="store_true", help="no progress bar")
    m2h.add_argument("--force", action="store_true", help="replace --out if it exists")
    ckpt_help = "a LoRA checkpoint's adapter dir, its <step>/actor, or the <step> dir"
    base_help = "base HF model dir (default: the adapter's base_model_name_or_path)"
    l2p = sub.add_parser("lora-to-peft", help="LoRA checkpoint -> PEFT adapter directory")
    l2p.add_argument("--ckpt", required=True, type=Path, help=ckpt_help)
    l2p.add_argument("--out", required=True, type=Path, help="adapter directory to create")
    l2p.add_argument("--base", type=Path, default=None, help=base_help)
    l2p.add_argument("--force", action="store_true", help="replace --out if it exists")
    l2h = sub.add_parser("lora-to-hf", help="LoRA checkpoint + base -> merged HF safetensors")
    l2h.add_argument("--ckpt", required=True, type=Path, help=ckpt_help)
    l2h.add_argument("--out", required=True, type=Path, help="HF directory to create")
    l2h.add_argument("--base", type=Path, default=None, help=base_help)
    l2h.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="output dtype (default: as the base stores it)"
    )
    l2h.add_argument(
        "--max-shard-size", type=_parse_size, default=2 * 1024**3, help="e.g. 2GB (default), 500MB"
    )
    l2h.add_argument("--no-progress", action="store_true", help="no progress bar")
    l2h.add_argument("--force", action="store_true", help="replace --out if it exists")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``tools/convert_ckpt.py`` and ``rlhf-megatron convert``. Returns the exit status."""
    from rlhf_megatron.models.checkpoint import CheckpointError
    from rlhf_megatron.models.lora import LoraTargetError
    from rlhf_megatron.platform.multiproc import RankFailedError

    args = build_parser().parse_args(argv)
    try:
        if args.command == "hf-to-mcore":
            out = convert_hf_to_mcore(
                args.hf,
                args.out,
                args.tp,
                args.pp,
                args.vpp,
                args.dtype,
                args.head,
                args.force,
                args.ep,
                args.etp,
            )
        elif args.command == "mcore-to-hf":
            out = convert_mcore_to_hf(
                args.ckpt,
                args.out,
                args.hf_config,
                args.dtype,
                args.max_shard_size,
                args.force,
                verify=not args.no_verify,
                progress=not args.no_progress,
            )
        elif args.command == "lora-to-peft":
            out = convert_lora_to_peft(args.ckpt, args.out, args.base, args.force)
        else:
            out = convert_lora_to_hf(
                args.ckpt,
                args.out,
                args.base,
                args.dtype,
                args.max_shard_size,
                args.force,
                progress=not args.no_progress,
            )
    except (
        ConversionError,
        CheckpointError,
        HFCheckpointError,
        LoraTargetError,
        SpecError,
        StageError,
        UnsupportedModelError,
        FileNotFoundError,
        RankFailedError,
    ) as e:
        print(f"convert {args.command}: error: {e}", file=sys.stderr)
        return 2
    print(f"convert {args.command}: wrote {out}")
    return 0
