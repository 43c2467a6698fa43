"""A tiny, deterministic character-level tokenizer for tests and the CPU quickstart.

No model hub is reachable from this project's machines, so tests, `tools/make_tiny_model.py`
and the quickstart build their tokenizer in-process. Every printable ASCII character is one
token (so "12+7=19" is seven tokens and small numbers tokenize digit by digit), plus a few
multi-character tokens the rule-based rewards look for (`<answer>`, `</answer>`, `####`) and
chat-role markers. The result is an ordinary `transformers.PreTrainedTokenizerFast` with a
chat template, so it can be `save_pretrained`-ed and reloaded with `AutoTokenizer`.

Boundaries: builds a tokenizer; knows nothing of datasets or models.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
ROLE_TOKENS = ("<|user|>", "<|assistant|>", "<|system|>")
# Not special: they must survive `decode(..., skip_special_tokens=True)`, because the
# countdown and gsm8k scorers read them from decoded responses.
MARKER_TOKENS = ("<answer>", "</answer>", "####")

# `<|role|>content</s>` per message, then `<|assistant|>` when a reply is expected. For tool use
# (multi-turn rollouts, Qwen's hermes format): `tools=` adds `<|system|>tools: a, b</s>` first, an
# assistant message's `tool_calls` follow its content as `<tool_call>{json}</tool_call>`, and a
# tool message is a user turn `<|user|><tool_response>...</tool_response></s>`.
TINY_CHAT_TEMPLATE = (
    "{%- if tools -%}{{ '<|system|>tools: ' }}"
    "{%- for tool in tools -%}{{ tool['function']['name'] if 'function' in tool else tool['name'] }}"
    "{{ '' if loop.last else ', ' }}{%- endfor -%}{{ eos_token }}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{ '<|user|><tool_response>' + message['content'] + '</tool_response>' + eos_token }}"
    "{%- elif message['role'] in ['system', 'user', 'assistant'] -%}"
    "{{ '<|' + message['role'] + '|>' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{ '<tool_call>' + (call['function'] | tojson) + '</tool_call>' }}"
    "{%- endfor -%}{{ eos_token }}"
    "{%- else -%}{{ raise_exception('tiny chat template: unknown role ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)

MAX_VOCAB = 512


def build_tiny_tokenizer(extra_words: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer described in the module docstring.

    Ids are deterministic: specials first (`<pad>`=0, `<s>`=1, `</s>`=2, `<unk>`=3), then
    `string.printable` in order, then role markers, answer markers and `extra_words`
    (each of which becomes a single, non-special token). Characters outside printable
    ASCII map to `<unk>`, so only ASCII text round-trips through encode/decode.
    """
    vocab: dict[str, int] = {}
    for token in (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN):
        vocab[token] = len(vocab)
    for char in string.printable:
        vocab.setdefault(char, len(vocab))

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # One pre-token per character (whitespace included); `[\s\S]` also matches newlines.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse concatenates pieces; WordLevel's default decoding would join them with spaces.
    tok.decoder = decoders.Fuse()

    specials = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    words = [w for w in dict.fromkeys([*MARKER_TOKENS, *extra_words]) if w and w not in vocab]
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in words])

    if tok.get_vocab_size(with_added_tokens=True) >= MAX_VOCAB:
        raise ValueError(
            f"build_tiny_tokenizer: {len(words)} extra words give a vocabulary of "
            f"{tok.get_vocab_size(with_added_tokens=True)} tokens; keep it under {MAX_VOCAB}."
        )

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=4096,
    )
    hf_tok.chat_template = TINY_CHAT_TEMPLATE
    return hf_tok


# -- vision-language ---------------------------------------------------------------------------

# Qwen2-VL's special tokens, spelled as in the released tokenizers, so the processor, vLLM's
# Qwen2.5-VL and the chat template find them by name.
VL_SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Not special: the math reward reads them from decoded responses.
VL_MARKER_TOKENS = ("<think>", "</think>", "\\boxed")

# Qwen2-VL's chat template, reduced to what the tiny models need: string or list content,
# an image entry becomes <|vision_start|><|image_pad|><|vision_end|> (the processor expands
# the pad to the image's token count), a video entry the same with <|video_pad|>. Qwen3-VL's
# processor (and vLLM's) expands a video's pad into a `<t seconds><|vision_start|>...<|vision_end|>`
# run per temporal patch, inside these markers, so the same template serves both families.
TINY_VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or 'image' in part -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' or 'video' in part -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def build_tiny_vl_tokenizer(extra_words: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """The character tokenizer with Qwen2-VL's special tokens and chat template.

    ``<|im_end|>`` is the EOS token (as in Qwen's instruct models), ``<|image_pad|>`` the
    image placeholder the processor expands, and ``<think>``/``</think>``/``\\boxed`` single
    tokens for the math reward's format.
    """
    base = build_tiny_tokenizer([*VL_MARKER_TOKENS, *extra_words])
    tok = base.backend_tokenizer
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VL_SPECIAL_TOKENS])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[*ROLE_TOKENS, *VL_SPECIAL_TOKENS],
        model_max_length=8192,
    )
    hf_tok.chat_template = TINY_VL_CHAT_TEMPLATE
    return hf_tok


VL_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
"""The processors `build_tiny_vl_processor` builds."""


def build_tiny_vl_processor(
    min_pixels: int = 28 * 28 * 4, max_pixels: int = 28 * 28 * 64, extra_words=(), family: str = "qwen2_5_vl"
):
    """A Qwen2.5-VL processor (Qwen2-VL's image processor, 14-pixel patches merged 2 x 2)
    around ``build_tiny_vl_tokenizer``; ``save_pretrained`` writes what ``AutoProcessor`` loads.
    Needs torchvision importable (the processor class insists on a video processor): see
    ``platform/torchvision_compat.py``.

    ``min_pixels``/``max_pixels`` bound an image's area after resizing, so a test image gives
    between ``min_pixels / 28**2`` and ``max_pixels / 28**2`` image tokens.

    ``family="qwen3_vl"``: a Qwen3-VL processor instead, with Qwen3-VL's 16-pixel patches (an
    image gives ``area / 32**2`` tokens) and its video processor, which writes a ``<t seconds>``
    timestamp and a ``<|vision_start|>...<|vision_end|>`` run per temporal patch in place of
    ``<|video_pad|>`` (from the frames' ``VideoMetadata``). The chat template is the same.
    """
    if family not in VL_FAMILIES:
        raise ValueError(f"build_tiny_vl_processor: family must be one of {VL_FAMILIES}, got {family!r}")
    if family == "qwen3_vl":
        return _tiny_qwen3_vl_processor(min_pixels, max_pixels, extra_words)
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    patches = dict(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**patches),
        tokenizer=build_tiny_vl_tokenizer(extra_words),
        # Videos: frames bounded like images; the per-video pixel cap (transformers' coming default).
        video_processor=Qwen2VLVideoProcessor(**patches, cap_pixels_per_frame=True),
        chat_template=TINY_VL_CHAT_TEMPLATE,
    )


def _tiny_qwen3_vl_processor(min_pixels: int, max_pixels: int, extra_words):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    # Qwen3-VL normalises images and videos alike (mean = std = 0.5), and vLLM relies on it: it
    # normalises both on the device with the image processor's numbers.
    half = [0.5, 0.5, 0.5]
    patches = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=half, image_std=half)
    # Qwen3-VL's video processor bounds a clip's pixels over all its frames. Its per-frame cap
    # (max_video_tokens merged 32 x 32 patches) under a clip budget that never binds up to 768
    # frames bounds every frame by max_pixels, as images are; min_pixels bounds the whole clip.
    videos = Qwen3VLVideoProcessor(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels * 768},
        cap_pixels_per_frame=True,
        max_video_tokens=max_pixels // 32**2,
        **patches,
    )
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels, **patches),
        tokenizer=build_tiny_vl_tokenizer(extra_words),
        video_processor=videos,
        chat_template=TINY_VL_CHAT_TEMPLATE,
    )
