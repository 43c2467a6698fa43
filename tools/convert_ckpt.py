"""Convert checkpoints between Hugging Face and megatron-core formats.

    python tools/convert_ckpt.py hf-to-mcore --hf HF_DIR --out CKPT_DIR --tp 2 --pp 2 [--vpp 2]
    python tools/convert_ckpt.py mcore-to-hf --ckpt CKPT_DIR --out HF_DIR [--dtype bf16] [--hf-config HF_DIR]
    python tools/convert_ckpt.py lora-to-peft --ckpt STEP/actor --out ADAPTER_DIR [--base HF_DIR]
    python tools/convert_ckpt.py lora-to-hf --ckpt STEP/actor --out HF_DIR [--base HF_DIR] [--dtype bf16]

The implementation is ``rlhf_megatron.convert`` (also ``rlhf-megatron convert``);
``--help`` on each subcommand lists every option.
"""

from __future__ import annotations

import sys

from rlhf_megatron.convert import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
