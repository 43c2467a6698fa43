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

# `<|role|>content</s>` per message, then `<|assistant|>` when a reply is expected.
TINY_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('tiny chat template: unknown role ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
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
