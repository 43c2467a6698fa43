"""The tiny character-level tokenizer: round trips, single-digit tokens, chat template, save/load."""

from transformers import AutoTokenizer

from rlhf_megatron.data.tokenizer import build_tiny_tokenizer


def test_round_trip_and_digits(tokenizer):
    for text in ["12+7=19", "#### 19", "(1 + 2) / 3", "a\tb\nC!?", "<answer> 3*4 </answer>"]:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    ids = tokenizer.encode("12+7=19", add_special_tokens=False)
    assert len(ids) == 7
    assert tokenizer.convert_ids_to_tokens(ids) == list("12+7=19")
    assert len(tokenizer.encode("#### 19", add_special_tokens=False)) == 4  # "####" is one token
    assert len(tokenizer) < 512


def test_special_tokens_and_chat_template(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+5="}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|system|>be brief</s><|user|>3+5=</s><|assistant|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "be brief3+5="
    # markers the scorers look for survive skip_special_tokens
    assert tokenizer.decode(tokenizer.encode("#### 8</s>"), skip_special_tokens=True) == "#### 8"


def test_deterministic_extra_words_and_save_load(tmp_path):
    a, b = build_tiny_tokenizer(extra_words=["plus"]), build_tiny_tokenizer(extra_words=["plus"])
    assert a.get_vocab() == b.get_vocab()
    assert len(a.encode("plus", add_special_tokens=False)) == 1
    a.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode("12+7=19", add_special_tokens=False) == a.encode("12+7=19", add_special_tokens=False)
    chat = [{"role": "user", "content": "1+1="}]
    assert (
        loaded.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        == "<|user|>1+1=</s><|assistant|>"
    )
