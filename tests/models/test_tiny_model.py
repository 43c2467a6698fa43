"""The tiny random checkpoints' own knobs (``rlhf_megatron.models.tiny``)."""

import pytest
import torch

from rlhf_megatron.models.tiny import build_tiny_hf_model


def _eos_probability(model, tokenizer) -> torch.Tensor:
    ids = torch.randint(5, len(tokenizer), (16, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits.softmax(-1)[..., tokenizer.eos_token_id]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_eos_logit_makes_the_model_end_its_answers_at_every_position(arch):
    plain = _eos_probability(*build_tiny_hf_model(arch))
    ending = _eos_probability(*build_tiny_hf_model(arch, eos_logit=5.0))
    assert plain.max() < 0.2  # a random model rarely stops: its answers run to the length limit
    # ~5 logits above ~110 others: e^5 / (e^5 + 110) = 0.57, at every position alike
    assert float(ending.min()) > 0.3 and float(ending.max()) < 0.85


def test_eos_logit_refuses_tied_embeddings():
    with pytest.raises(ValueError, match="untied embeddings"):
        build_tiny_hf_model("llama", tie_word_embeddings=True, eos_logit=5.0)
