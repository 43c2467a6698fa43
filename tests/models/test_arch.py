"""ModelArch: reading HF configs, and refusing what megatron cannot build."""

from __future__ import annotations

import json

import pytest

from rlhf_megatron.models import SUPPORTED_ARCHITECTURES, ModelArch, RopeScaling, UnsupportedModelError

from . import tiny_hf


def _config(family: str, **overrides) -> dict:
    config = tiny_hf.hf_config(family, **overrides).to_dict()
    config.setdefault("architectures", [tiny_hf.hf_config(family).model_type.capitalize() + "ForCausalLM"])
    return config


def test_llama_gqa_and_llama3_rope_scaling():
    arch = ModelArch.from_hf_config(_config("llama"))
    assert (arch.architecture, arch.model_type, arch.head) == ("LlamaForCausalLM", "llama", "lm")
    assert (arch.num_layers, arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads) == (4, 128, 4, 2)
    assert (arch.head_dim, arch.queries_per_group, arch.ffn_hidden_size, arch.vocab_size) == (32, 2, 256, 300)
    assert not arch.qkv_bias and not arch.qk_norm and not arch.tie_word_embeddings
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


def test_qwen2_bias_tied_and_qwen3_qk_norm_head_dim():
    qwen2 = ModelArch.from_hf_config({**_config("qwen2"), "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.qkv_bias and qwen2.tie_word_embeddings and not qwen2.qk_norm and qwen2.rope_scaling is None
    qwen3 = ModelArch.from_hf_config({**_config("qwen3"), "architectures": ["Qwen3ForCausalLM"]})
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 64  # != hidden / heads


def test_mistral_sliding_window_kept_only_when_it_bites():
    config = {**_config("mistral"), "architectures": ["MistralForCausalLM"]}
    assert ModelArch.from_hf_config(config).sliding_window == 5
    assert ModelArch.from_hf_config({**config, "sliding_window": None}).sliding_window is None
    assert ModelArch.from_hf_config({**config, "sliding_window": 10**6}).sliding_window is None


def test_transformers4_style_rope_keys():
    config = {k: v for k, v in _config("llama").items() if k != "rope_parameters"}
    config["rope_theta"] = 500000.0
    config["rope_scaling"] = {
        "type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    arch = ModelArch.from_hf_config(config)
    assert arch.rope_theta == 500000.0 and arch.rope_scaling.factor == 32.0
    config["rope_scaling"] = {"type": "linear", "factor": 2.0}
    assert ModelArch.from_hf_config(config).rope_scaling == RopeScaling("linear", 2.0)


@pytest.mark.parametrize(
    "key, value",
    [("low_freq_factor", 2.0), ("high_freq_factor", 8.0), ("original_max_position_embeddings", 4096)],
)
def test_llama3_rope_with_non_megatron_parameters_is_refused(key, value):
    config = _config("llama")
    config["rope_parameters"] = {**config["rope_parameters"], key: value}
    with pytest.raises(UnsupportedModelError, match=f"llama3 RoPE scaling.*{key}.*megatron-core 0.16"):
        ModelArch.from_hf_config(config)


def test_unsupported_architecture_lists_the_supported_ones():
    config = {**_config("llama"), "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(UnsupportedModelError) as e:
        ModelArch.from_hf_config(config, source="/ckpt/config.json")
    msg = str(e.value)
    assert "/ckpt/config.json" in msg and "GPT2LMHeadModel" in msg
    assert all(
        a in msg for a in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
    )


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            "RoPE scaling type 'yarn'",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
        ({"architectures": ["Qwen2ForCausalLM"]}, "must name the same family"),
    ],
)
def test_unsupported_settings_are_refused_with_the_key(overrides, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelArch.from_hf_config({**_config("llama"), **overrides})


def test_qwen_sliding_window_is_refused():
    config = {**_config("qwen2"), "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        ModelArch.from_hf_config(config)


def test_heads_from_architectures_and_overrides():
    config = _config("llama")
    critic = ModelArch.from_hf_config({**config, "architectures": ["LlamaForTokenClassification"]})
    assert critic.head == "value" and critic.head_bias
    rm = ModelArch.from_hf_config({**config, "architectures": ["LlamaForSequenceClassification"]})
    assert rm.head == "reward" and not rm.head_bias
    actor = ModelArch.from_hf_config(config)
    assert actor.with_head("value") == critic
    assert ModelArch.from_hf_config(config, head="reward") == rm
    assert len(SUPPORTED_ARCHITECTURES) == 31  # 4 text and 5 MoE families x 3 heads, 4 vision-language


def test_padded_vocab_and_json_round_trip(tmp_path):
    arch = ModelArch.from_hf_config(_config("llama"))
    assert [arch.padded_vocab_size(tp) for tp in (1, 2, 4)] == [384, 512, 512]
    assert ModelArch.from_dict(json.loads(json.dumps(arch.to_dict()))) == arch
    (tmp_path / "config.json").write_text(json.dumps(_config("llama")))
    assert ModelArch.from_hf_dir(tmp_path) == arch
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelArch.from_hf_dir(tmp_path / "missing")
