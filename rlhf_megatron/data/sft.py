"""Supervised fine-tuning rows: chat transcripts to token ids with a loss mask, and their packing.

The first stage before RL (SFT; a cold start on tool-call transcripts for agentic RL) trains on
what the assistant says and nothing else. ``tokenize_conversation`` renders a row's ``messages``
(and the row's ``tools``, as the chat template presents them) with the tokenizer's own chat
template, one message more at a time, so every token is attributed to the message that produced
it: the loss mask is 1 on an assistant message's tokens (its text, its tool calls and its
end-of-turn) and 0 on system, user and tool turns and on the template's assistant header (what
the rollout's generation prompt adds; the model never generates it). A single-turn row
(``prompt_key`` / ``response_key``, verl's SFT dataset) is the conversation user → assistant.

Images (a vision-language model; ``tokenize_with_images``): a row's images (``data.image_key``)
go where its user messages place them, in order: an ``<image>`` placeholder in a string content
(verl's and EasyR1's convention) or a ``{"type": "image"}`` part of a content list (Qwen's form;
the image itself always comes from the images column). The transcript is rendered as above with
the processor's chat template, which writes one ``<|image_pad|>`` per image; the model's own
processor then expands each pad into one per merged patch, and those vision tokens are never
trained (mask 0). A sample keeps its images as the row stores them (`SFTImages`: compressed
bytes or paths, never pixels, so a dataset costs its files' size in memory) with the grids the
processor gave them, and `SFTImages.pixel_inputs` decodes them again when a batch is built.

``truncate`` applies verl's ``data.truncation`` to a sample over ``max_length`` (a sample with
images is refused instead: cutting its vision tokens would separate them from their image);
``pack_samples`` puts whole samples into rows of at most ``max_length`` tokens (first fit,
longest first), each sample a segment of its own: ``segment_ids`` keep attention inside a
segment and positions restart at each one (``data.packing``'s convention), so a packed row
computes what its samples would alone. Samples with images are packed too: a packed row
carries its members' images in row order (``PackedRow.members``), and their M-RoPE positions
restart with them (``stages.data``).

Boundaries: pure functions of a tokenizer, the model's processor and Python values (image files
are read through ``multimodal.prepare_image``); reading data files and batching are the SFT
stage's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rlhf_megatron.data.multimodal import IMAGE_PLACEHOLDER, ImageError, VisionProcessor, prepare_image
from rlhf_megatron.data.prompts import split_image_placeholders

__all__ = [
    "PackedRow",
    "SFTDataError",
    "SFTImages",
    "SFTSample",
    "image_parts",
    "pack_samples",
    "tokenize_conversation",
    "tokenize_with_images",
    "truncate",
]


class SFTDataError(ValueError):
    """A row that cannot be trained on; the message names the row and what to change."""


@dataclass(frozen=True)
class SFTImages:
    """A sample's images as its row stores them, decoded only when a batch is built."""

    values: tuple[Any, ...]
    """The row's images (bytes, ``{"bytes"|"path": ...}``, paths), in placeholder order."""
    where: str
    """``"<files key>: <file> row <i>: '<image_key>'"``, for errors."""
    base_dir: str | None = None
    """Relative image paths resolve here (the data file's directory)."""
    min_pixels: int | None = None
    """``data.min_pixels``: smaller images are scaled up first (``multimodal.prepare_image``)."""
    max_pixels: int | None = None
    """``data.max_pixels``: larger images are scaled down first."""
    grid_thw: tuple[tuple[int, int, int], ...] = ()
    """Each image's (t, h, w) patch grid, as the processor gave it at tokenization."""

    def prepare(self) -> list:
        """The images decoded, bounded and in RGB (PIL), or an error naming the image."""
        out = []
        for i, value in enumerate(self.values):
            try:
                out.append(prepare_image(value, self.min_pixels, self.max_pixels, self.base_dir))
            except ImageError as err:
                raise SFTDataError(f"{self.where}[{i}]: {err}. Fix or drop the image.") from err
        return out

    def pixel_inputs(self, vision: VisionProcessor) -> dict:
        """``pixel_values`` [patches, patch_dim] and ``image_grid_thw`` [images, 3] for the model."""
        out = vision.pixel_inputs(self.prepare())
        grid = tuple(tuple(g) for g in out["image_grid_thw"].tolist())
        if grid != self.grid_thw:  # the sample's vision tokens were counted from the old grids
            raise SFTDataError(
                f"{self.where}: the images now give patch grids {list(grid)}, but {list(self.grid_thw)} when "
                "the row was tokenized; an image file changed during the run"
            )
        return out


@dataclass(frozen=True)
class SFTSample:
    """One transcript's tokens. input_ids, loss_mask: [T] (1 where the loss trains); images:
    a vision-language row's images (None: text only)."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    images: SFTImages | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class PackedRow:
    """Samples side by side in one row. input_ids, loss_mask, position_ids: [L]; segment_ids: [L],
    1, 2, ... per sample (0 on padding, which ``pad_to`` adds); members: the samples' indices,
    in row order."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    position_ids: tuple[int, ...]
    segment_ids: tuple[int, ...]
    members: tuple[int, ...] = ()


def _render(
    tokenizer,
    messages: Sequence[Mapping],
    tools,
    generation_prompt: bool,
    source: str,
    chat_template: str | None = None,
    tokenize: bool = True,
):
    """Token ids (or, ``tokenize=False``, the text) of ``messages`` through the chat template."""
    extra = {"chat_template": chat_template} if chat_template else {}
    try:
        ids = tokenizer.apply_chat_template(
            list(messages),
            tools=tools or None,
            add_generation_prompt=generation_prompt,
            tokenize=tokenize,
            **extra,
        )
    except Exception as e:  # jinja's TemplateError, a KeyError from a template reading a missing field
        raise SFTDataError(
            f"{source}: the tokenizer's chat template cannot render it: {type(e).__name__}: {e}"
        ) from e
    if not tokenize:
        return ids
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def tokenize_conversation(
    tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping] | None = None,
    source: str = "row",
    chat_template: str | None = None,
) -> SFTSample:
    """``messages`` (OpenAI chat format: role, content, an assistant's ``tool_calls``) as token ids
    with the loss on the assistant's tokens only (see the module docstring). ``source`` names the
    row in errors; ``chat_template`` replaces the tokenizer's (a processor's, for image rows)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise SFTDataError(
            f"{source}: the tokenizer has no chat template, and every row (single-turn prompt/response "
            "too) is rendered with it; set tokenizer.chat_template in the model's tokenizer_config.json"
        )
    if not messages or not any(m.get("role") == "assistant" for m in messages):
        raise SFTDataError(f"{source}: no assistant message, so nothing to train on")
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise SFTDataError(
                f"{source}: message {i} has role {role!r}; expected system, user, assistant or tool"
            )
        start = len(ids)
        if role == "assistant":  # the template's header for this turn is the prompt, not the answer
            header = _render(tokenizer, messages[:i], tools, True, source, chat_template) if i else []
            _check_prefix(ids, header, source, i)
            mask.extend([0] * (len(header) - start))
            ids = header
            start = len(ids)
        full = _render(tokenizer, messages[: i + 1], tools, False, source, chat_template)
        _check_prefix(ids, full, source, i)
        mask.extend([1 if role == "assistant" else 0] * (len(full) - start))
        ids = full
    return SFTSample(tuple(ids), tuple(mask))


def image_parts(messages: Sequence[Mapping[str, Any]], source: str) -> tuple[list[dict], int]:
    """``messages`` with each image's place as a ``{"type": "image"}`` content part (``<image>``
    placeholders split out, content lists reduced to their text and image parts), and the number
    of images they place. Contents without an image stay as they are."""
    out, count = [], 0
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) and IMAGE_PLACEHOLDER in content:
            content = split_image_placeholders(content)
        elif isinstance(content, (list, tuple)):
            content = [_content_part(part, source, i, k) for k, part in enumerate(content)]
        images = sum(p["type"] == "image" for p in content) if isinstance(content, list) else 0
        if images and message.get("role") != "user":
            raise SFTDataError(
                f"{source}: message {i} ({message.get('role')}) places {images} image(s); images go in user "
                f"messages (the model reads them, it does not write them): move the {IMAGE_PLACEHOLDER}"
            )
        count += images
        out.append({**message, "content": content})
    return out, count


def _content_part(part: Any, source: str, i: int, k: int) -> dict:
    """One part of a content list as the chat template takes it: text, or an image's place."""
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind == "image":
        return {"type": "image"}  # Arrow may add a null text field, which templates would read
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    raise SFTDataError(
        f"{source}: message {i} content part {k} is {part!r:.120}; expected {{'type': 'text', 'text': ...}} "
        "or {'type': 'image'} (the image itself comes from the data.image_key column)"
    )


def tokenize_with_images(
    tokenizer,
    vision: VisionProcessor,
    messages: Sequence[Mapping[str, Any]],
    images: SFTImages,
    tools: Sequence[Mapping] | None = None,
    source: str = "row",
) -> SFTSample:
    """A vision-language model's row (``images.values`` may be empty) as token ids, each image's
    pad expanded by the model's processor, the loss on the assistant's tokens only."""
    messages, placeholders = image_parts(messages, source)
    n = len(images.values)
    if placeholders != n:
        raise SFTDataError(
            f"{images.where} holds {n} image(s), but the messages place {placeholders}; put one "
            f"{IMAGE_PLACEHOLDER} (or a {{'type': 'image'}} content part) in a user message where each image "
            "goes, in order, or fix the images list"
        )
    template = getattr(vision.processor, "chat_template", None)  # what the RL dataset renders with
    sample = tokenize_conversation(tokenizer, messages, tools, source, template)
    if not n:
        return sample
    pad = vision.image_token_id
    written = sample.input_ids.count(pad)
    if written != n:
        raise SFTDataError(
            f"{source}: the chat template wrote {written} {vision.image_token!r} for {n} image(s); the "
            "processor's chat template must write one per image part"
        )
    text = _render(tokenizer, messages, tools, False, source, template, tokenize=False)
    encoded = vision.processor(
        images=images.prepare(), text=[text], add_special_tokens=False, return_tensors="pt"
    )
    grid = encoded["image_grid_thw"]
    counts = iter((grid.prod(-1) // vision.spatial_merge_size**2).tolist())
    ids, mask = [], []
    for token, trained in zip(sample.input_ids, sample.loss_mask):
        repeat = next(counts) if token == pad else 1
        ids += [token] * repeat
        mask += [0 if token == pad else trained] * repeat  # vision tokens are never trained
    if encoded["input_ids"][0].tolist() != ids:
        raise SFTDataError(
            f"{source}: the processor tokenizes the rendered transcript differently from the tokenizer "
            f"(with each {vision.image_token!r} repeated per merged patch); model.tokenizer_path must be the "
            "processor's tokenizer"
        )
    grids = tuple(tuple(g) for g in grid.tolist())
    return SFTSample(tuple(ids), tuple(mask), replace(images, grid_thw=grids))


def _check_prefix(before: list[int], after: list[int], source: str, i: int) -> None:
    if after[: len(before)] != before:
        raise SFTDataError(
            f"{source}: rendering message {i} changed the tokens of the messages before it (the chat "
            "template is not prefix-stable, e.g. it drops earlier turns' reasoning); per-message loss "
            "masks need a template that renders earlier turns the same whatever follows"
        )


def single_turn_messages(prompt: Any, response: Any, source: str) -> list[dict[str, str]]:
    """verl's single-turn SFT row (``prompt_key`` / ``response_key``) as a user → assistant chat."""
    for name, value in (("prompt", prompt), ("response", response)):
        if not isinstance(value, str) or not value:
            raise SFTDataError(f"{source}: the {name} must be a non-empty string, got {value!r}")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def truncate(sample: SFTSample, max_length: int, mode: str, source: str) -> SFTSample:
    """verl's ``data.truncation``: ``error`` refuses a sample over ``max_length`` tokens; ``left``
    keeps its last tokens, ``right`` its first."""
    if len(sample) <= max_length:
        return sample
    if sample.images is not None:
        raise SFTDataError(
            f"{source}: {len(sample)} tokens with its images, more than data.max_length={max_length}; a sample "
            "with images is not truncated (its vision tokens would lose their image): raise data.max_length "
            "or lower data.max_pixels"
        )
    if mode == "error":
        raise SFTDataError(
            f"{source}: {len(sample)} tokens, more than data.max_length={max_length}; raise max_length, "
            "or set data.truncation=left or right"
        )
    cut = slice(len(sample) - max_length, None) if mode == "left" else slice(0, max_length)
    out = SFTSample(sample.input_ids[cut], sample.loss_mask[cut])
    if not any(out.loss_mask):
        raise SFTDataError(f"{source}: truncated to {max_length} tokens ({mode}), no assistant token is left")
    return out


def pack_samples(samples: Sequence[SFTSample], max_length: int) -> list[PackedRow]:
    """Whole samples into rows of at most ``max_length`` tokens, first fit over the samples sorted
    longest first (deterministic: ties keep their order); see the module docstring."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = len(samples[i])
        if n > max_length:
            raise SFTDataError(
                f"sample {i}: {n} tokens do not fit a packed row of {max_length}; truncate first"
            )
        slot = next((r for r, free in enumerate(room) if free >= n), None)
        if slot is None:
            rows.append([])
            room.append(max_length)
            slot = len(rows) - 1
        rows[slot].append(i)
        room[slot] -= n
    out = []
    for members in rows:
        ids, mask, pos, seg = [], [], [], []
        for k, i in enumerate(members, start=1):
            s = samples[i]
            ids += s.input_ids
            mask += s.loss_mask
            pos += range(len(s))
            seg += [k] * len(s)
        out.append(PackedRow(tuple(ids), tuple(mask), tuple(pos), tuple(seg), tuple(members)))
    return out
