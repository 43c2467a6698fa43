"""Typed schema of the stages before RL: supervised fine-tuning (``SFTConfig``) and reward-model
training (``RMConfig``).

Key names and defaults are verl's SFT trainer's (``sft_trainer.yaml``: ``data.*``, ``model.*``,
``optim.*``, ``trainer.*``) where verl has them; the layout (``megatron``) and the optimizer are
the RL roles' own sections, so a stage trains on the same engine with the same knobs. Every field
carries an attribute docstring (``keys.field_docs`` reads them; the config reference shows them).

Boundaries: declarations and each section's own rules; the stages' drivers are in
``rlhf_megatron/stages/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf_megatron.choices import Device, Truncation, WarmupStyle
from rlhf_megatron.config.checks import count_problems
from rlhf_megatron.config.schema_model import MegatronConfig, OptimConfig

__all__ = [
    "RMConfig",
    "RMDataConfig",
    "SFTConfig",
    "SFTDataConfig",
    "StageModelConfig",
    "StageMultiturnConfig",
    "StageTrainerConfig",
]


@dataclass
class StageMultiturnConfig:
    """``data.multiturn``: rows are chat transcripts (OpenAI messages) instead of prompt/response."""

    enable: bool = False
    """Read ``messages_key`` (and ``tools_key``) instead of ``prompt_key`` / ``response_key``."""

    messages_key: str = "messages"
    """Column holding the list of ``{role, content[, tool_calls]}`` messages."""

    tools_key: str = "tools"
    """Column holding the tool schemas the chat template presents (absent or null: none)."""


@dataclass
class SFTDataConfig:
    """``data`` of the SFT stage: parquet or jsonl rows, tokenized with the model's chat template."""

    train_files: Any = "~/data/gsm8k/train.parquet"
    """A parquet or jsonl file, or a list of them."""

    val_files: Any = "~/data/gsm8k/test.parquet"
    """Validation file(s); null: no validation."""

    prompt_key: str = "question"
    """Single-turn rows: the prompt column (rendered as a user message)."""

    response_key: str = "answer"
    """Single-turn rows: the response column (the assistant message the loss trains on)."""

    multiturn: StageMultiturnConfig = field(default_factory=StageMultiturnConfig)
    """Chat-transcript rows: the loss trains every assistant message (tool calls included), never
    the system, user or tool turns."""

    image_key: str = "images"
    """Column holding each row's list of images (``{"bytes": ...}`` as HF datasets store them, or
    file paths), placed by ``<image>`` in user messages or ``{"type": "image"}`` content parts, in
    order. Needs a vision-language model (Qwen2.5-VL); an absent column means no images."""

    min_pixels: int | None = 262144
    """Images with fewer pixels are scaled up to this many before the processor sees them (as in
    RL's ``data.min_pixels``); null: no lower bound."""

    max_pixels: int | None = 4194304
    """Images with more pixels are scaled down to this many before the processor sees them (as in
    RL's ``data.max_pixels``); null: no upper bound."""

    max_length: int = 1024
    """Tokens of one sample (and of one packed row), vision tokens included."""

    truncation: Truncation = Truncation.error
    """A sample over ``max_length``: error, left (keep its end) or right (keep its start). A sample
    with images is never truncated (always an error)."""

    train_batch_size: int = 256
    """Samples per optimizer step, over all data-parallel ranks."""

    micro_batch_size_per_gpu: int = 4
    """Rows per forward/backward on one data-parallel rank (packed rows when ``packing``)."""

    packing: bool = True
    """Put whole samples side by side in rows of ``max_length`` tokens (attention stays inside each
    sample, positions restart): no padding between them. Samples with images too (each brings its
    images; M-RoPE positions restart). Our extension."""

    shuffle: bool = True
    """Shuffle the training rows every epoch (seeded by ``trainer.seed``)."""

    def validate(self, key: str = "data") -> list[str]:
        out = _data_problems(self, key)
        low, high = self.min_pixels, self.max_pixels
        if low is not None and high is not None and low > high:
            out.append(
                f"{key}.min_pixels={low} is above {key}.max_pixels={high}; lower one or raise the other"
            )
        return out


@dataclass
class RMDataConfig:
    """``data`` of reward-model training: preference pairs (TRL's / OpenRLHF's column layout)."""

    train_files: Any = "~/data/preference/train.parquet"
    """A parquet or jsonl file, or a list of them."""

    val_files: Any = "~/data/preference/test.parquet"
    """Validation file(s): accuracy and margin are measured on them; null: no validation."""

    prompt_key: str = "prompt"
    """The prompt column: a string, or a list of chat messages put before both responses (optional
    with conversational ``chosen`` / ``rejected``)."""

    chosen_key: str = "chosen"
    """The preferred response: a string, or a list of chat messages."""

    rejected_key: str = "rejected"
    """The other response: a string, or a list of chat messages."""

    max_length: int = 1024
    """Tokens of one side of a pair."""

    truncation: Truncation = Truncation.error
    """A side over ``max_length``: error or left (keep its end, where the score is read)."""

    train_batch_size: int = 256
    """Pairs per optimizer step, over all data-parallel ranks."""

    micro_batch_size_per_gpu: int = 4
    """Pairs per forward/backward on one data-parallel rank (both sides in one micro-batch)."""

    shuffle: bool = True
    """Shuffle the training pairs every epoch (seeded by ``trainer.seed``)."""

    def validate(self, key: str = "data") -> list[str]:
        out = _data_problems(self, key)
        if self.truncation == "right":
            out.append(
                f"{key}.truncation=right would cut the last token, where a reward model's score is read; "
                "use error or left"
            )
        return out


def _data_problems(data: SFTDataConfig | RMDataConfig, key: str) -> list[str]:
    out = count_problems(
        key,
        {
            "max_length": data.max_length,
            "train_batch_size": data.train_batch_size,
            "micro_batch_size_per_gpu": data.micro_batch_size_per_gpu,
        },
    )
    if data.truncation == "middle":
        out.append(f"{key}.truncation=middle is not supported for training rows; use error, left or right")
    if not data.train_files:
        out.append(f"{key}.train_files is empty: name a parquet or jsonl file")
    return out


@dataclass
class StageModelConfig:
    """``model``: the checkpoint a stage starts from."""

    partial_pretrain: str = "~/models/gemma-1.1-7b-it"
    """Hugging Face model directory to fine-tune (verl's key)."""

    tokenizer_path: str | None = None
    """Tokenizer directory; null uses ``partial_pretrain``."""

    trust_remote_code: bool = False
    """Allow code from the model directory when loading its config and tokenizer."""

    enable_gradient_checkpointing: bool = False
    """Full, uniform recomputation of every layer when ``megatron.recompute_granularity`` is null."""

    override_config: dict[str, Any] = field(default_factory=dict)
    """Entries that override the HF config; free-form keys."""


@dataclass
class StageTrainerConfig:
    """``trainer``: epochs, logging, checkpoints and the processes (verl's SFT keys)."""

    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    """Run directory: checkpoints (``global_step_<k>``), ``metrics.jsonl``, ``metrics.png``."""

    project_name: str = "gsm8k-sft"
    """Project name for loggers."""

    experiment_name: str = "test"
    """Run name for loggers."""

    total_epochs: int = 4
    """Passes over the training rows."""

    total_training_steps: int | None = None
    """Stop after this many optimizer steps; null: ``total_epochs`` passes."""

    logger: list[str] = field(default_factory=lambda: ["console"])
    """Metric sinks: console, jsonl (``metrics.jsonl``), wandb, tensorboard."""

    save_freq: int = -1
    """Save a checkpoint every this many steps (and after the last); -1: only after the last."""

    test_freq: int = -1
    """Validate every this many steps (and after the last); -1: only after the last."""

    max_ckpt_to_keep: int | None = None
    """Checkpoints kept on disk (oldest removed first); null: all."""

    resume_mode: str = "auto"
    """auto: continue from the newest checkpoint in ``default_local_dir`` if any; disable: start over."""

    nnodes: int = 1
    """Nodes of the run."""

    n_gpus_per_node: int = 8
    """Processes per node (GPUs; on CPU, gloo processes)."""

    device: Device = Device.auto
    """auto: GPUs when there are, else CPU; cpu forces CPU mode."""

    seed: int = 1
    """Seed of the data order and the model-parallel RNG."""

    def validate(self, key: str = "trainer") -> list[str]:
        return count_problems(key, {"nnodes": self.nnodes, "n_gpus_per_node": self.n_gpus_per_node})


def _verl_sft_optim() -> OptimConfig:
    """verl's ``sft_trainer.yaml`` optimizer defaults."""
    return OptimConfig(lr=1e-5, betas=[0.9, 0.95], lr_warmup_steps_ratio=0.1, warmup_style=WarmupStyle.cosine)


@dataclass
class SFTConfig:
    """``python -m rlhf_megatron.sft``: supervised fine-tuning on the Megatron engine."""

    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: StageModelConfig = field(default_factory=StageModelConfig)
    optim: OptimConfig = field(default_factory=lambda: _verl_sft_optim())
    """The optimizer, with verl's SFT defaults (lr 1e-5, betas 0.9/0.95, 10% warmup, cosine decay)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout, dtype and recomputation, as an RL role's ``megatron`` section."""
    trainer: StageTrainerConfig = field(default_factory=StageTrainerConfig)


@dataclass
class RMConfig:
    """``python -m rlhf_megatron.rm``: reward-model training (Bradley-Terry on preference pairs)."""

    data: RMDataConfig = field(default_factory=RMDataConfig)
    model: StageModelConfig = field(default_factory=StageModelConfig)
    optim: OptimConfig = field(default_factory=lambda: _verl_sft_optim())
    """The optimizer, with SFT's defaults (lr 1e-5, betas 0.9/0.95, 10% warmup, cosine decay)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout, dtype and recomputation, as an RL role's ``megatron`` section."""
    trainer: StageTrainerConfig = field(
        default_factory=lambda: StageTrainerConfig(project_name="reward-model")
    )
