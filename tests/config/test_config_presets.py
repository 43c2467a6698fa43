"""Shipped presets: each loads, validates without warnings, and carries published numbers."""

from __future__ import annotations

import json
import warnings

import pytest
from omegaconf import OmegaConf

from rlhf_megatron.config.presets import CONFIGS_DIR, list_presets, read_preset_layers
from rlhf_megatron.config.validate import ArchUnknownWarning
from rlhf_megatron.planning import load_config
from rlhf_megatron.planning.arch import arch_for_role

PRESETS = [p.relative_to(CONFIGS_DIR).as_posix() for p in list_presets()]
SEARCHED = [p for p in PRESETS if p.endswith("_auto.yaml") and p.startswith("models/")]
"""The cluster presets' ``parallelism: auto`` variants: a search each (seconds to minutes), so they
are loaded in ``test_auto_presets.py``, one of them whole and the rest checked by their layers."""

# Architecture numbers from the models' published config.json files.
PUBLISHED = {
    "models/llama2_7b.yaml": dict(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_kv_heads=32,
        ffn_hidden_size=11008,
        vocab_size=32000,
        tie_word_embeddings=False,
        qkv_bias=False,
        max_position_embeddings=4096,
    ),
    "models/llama3.1_8b.yaml": dict(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_kv_heads=8,
        ffn_hidden_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
        qkv_bias=False,
        rope_theta=500000.0,
    ),
    "models/qwen2.5_7b.yaml": dict(
        num_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_kv_heads=4,
        ffn_hidden_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
        qkv_bias=True,
    ),
    "models/qwen2.5_14b.yaml": dict(
        num_layers=48,
        hidden_size=5120,
        num_attention_heads=40,
        num_kv_heads=8,
        ffn_hidden_size=13824,
        vocab_size=152064,
        qkv_bias=True,
    ),
    "models/qwen2.5_32b.yaml": dict(
        num_layers=64,
        hidden_size=5120,
        num_attention_heads=40,
        num_kv_heads=8,
        ffn_hidden_size=27648,
        vocab_size=152064,
        qkv_bias=True,
    ),
    "models/llama3.1_70b.yaml": dict(
        num_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_kv_heads=8,
        ffn_hidden_size=28672,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "models/qwen2.5_72b.yaml": dict(
        num_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_kv_heads=8,
        ffn_hidden_size=29568,
        vocab_size=152064,
        qkv_bias=True,
    ),
    "models/qwen3_30b_a3b.yaml": dict(
        num_layers=48,
        hidden_size=2048,
        num_attention_heads=32,
        num_kv_heads=4,
        head_dim=128,
        vocab_size=151936,
        qk_norm=True,
        moe_experts=(128, 8, 768, True),  # experts, per token, width, norm_topk_prob
    ),
    "models/qwen3_235b_a22b.yaml": dict(
        num_layers=94,
        hidden_size=4096,
        num_attention_heads=64,
        num_kv_heads=4,
        head_dim=128,
        vocab_size=151936,
        qk_norm=True,
        moe_experts=(128, 8, 1536, True),
    ),
    "models/mixtral_8x7b.yaml": dict(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_kv_heads=8,
        vocab_size=32000,
        norm_eps=1e-5,
        moe_experts=(8, 2, 14336, True),
    ),
}


def test_the_promised_presets_exist():
    for name in [
        "quickstart_cpu.yaml",
        "quickstart_cpu_ppo.yaml",
        "quickstart_cpu_one_step_off.yaml",
        "examples/gsm8k_ppo.yaml",
        "examples/gsm8k_grpo.yaml",
        "examples/countdown_grpo.yaml",
        *PUBLISHED,
    ]:
        assert name in PRESETS


# Presets whose reward model is an earlier pipeline stage's output: before that stage has run,
# its architecture is unknown and loading must say where it looked.
STAGE_OUTPUTS = {"pipeline_cpu/ppo.yaml": "outputs/pipeline/rm_hf"}


@pytest.mark.parametrize("preset", [p for p in PRESETS if p not in SEARCHED])
def test_preset_loads_and_validates_without_warnings(preset, tmp_path, monkeypatch):
    # A clean clone's working directory: configs/ and examples/ (paths such as tool configs and
    # agents are relative to it) and no outputs/ from earlier local runs.
    (tmp_path / "configs").symlink_to(CONFIGS_DIR)
    (tmp_path / "examples").symlink_to(CONFIGS_DIR.parent / "examples")  # the agent quickstart's agent
    monkeypatch.chdir(tmp_path)
    if preset in STAGE_OUTPUTS:
        with pytest.warns(ArchUnknownWarning, match=STAGE_OUTPUTS[preset]):
            load_config(preset, [])
        # What the RM stage writes there: the SFT model's config.json (the quickstart's model).
        hf_dir = tmp_path / STAGE_OUTPUTS[preset]
        hf_dir.mkdir(parents=True)
        arch = OmegaConf.to_container(load_config("quickstart_cpu.yaml", []).model_arch)
        (hf_dir / "config.json").write_text(json.dumps(arch))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ignored keys, no unknown architecture
        cfg = load_config(preset, [])
    assert cfg.model_arch is not None


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_model_preset_architecture_is_the_published_one(preset):
    arch, source = arch_for_role(load_config(preset, []), "actor")
    assert source == "model_arch"
    for key, value in PUBLISHED[preset].items():
        if key == "moe_experts":
            moe = arch.moe
            assert (moe.num_experts, moe.top_k, moe.ffn_hidden_size, moe.norm_topk_prob) == value
            assert moe.moe_layers == tuple(range(arch.num_layers))  # every layer sparse
            continue
        assert getattr(arch, key) == value, key


def test_quickstart_cpu_matches_the_spec():
    cfg = load_config("quickstart_cpu", [])
    arch = arch_for_role(cfg, "actor")[0]
    # tools/make_tiny_model.py's policy: 2 layers, hidden 256, 4 query heads of 64, 2 KV heads
    assert (arch.num_layers, arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads) == (
        2,
        256,
        4,
        2,
    )
    assert arch.head_dim == 64 and arch.vocab_size < 1000
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.n == 8
    assert (cfg.trainer.device, cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes) == ("cpu", 2, 1)
    # `parallelism: auto` with the calibrated CPU cost model: no TP on 2 cores, one vLLM per process.
    assert cfg.parallelism == "auto"
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 1
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 1
    assert cfg.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 1
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (16, 8)
    assert cfg.actor_rollout_ref.model.path == "outputs/tiny_model"
    assert cfg.data.train_files == "outputs/data/arith/train.parquet"
    assert cfg.data.val_files == "outputs/data/arith/test.parquet"
    assert list(cfg.trainer.logger) == ["console", "jsonl"]


def test_quickstart_cpu_ppo_layers_on_the_grpo_one():
    layers = read_preset_layers("quickstart_cpu_ppo")
    assert [layer[0].rsplit("/", 1)[1] for layer in layers] == [
        "quickstart_cpu.yaml",
        "quickstart_cpu_ppo.yaml",
    ]
    cfg = load_config("quickstart_cpu_ppo", [])
    assert cfg.algorithm.adv_estimator == "gae"
    assert cfg.critic.ppo_micro_batch_size_per_gpu == 4
    assert cfg.model_arch.num_hidden_layers == 2  # inherited


def test_examples_layer_on_model_presets():
    grpo = load_config("examples/gsm8k_grpo", [])
    assert grpo.model_arch.hidden_size == 3584 and grpo.actor_rollout_ref.rollout.n == 5
    assert load_config("examples/gsm8k_ppo", []).model_arch.vocab_size == 128256


def test_quickstart_vocabulary_is_the_tiny_tokenizers():
    # tools/make_tiny_model.py sizes the model's vocabulary to this tokenizer.
    tokenizer = pytest.importorskip("rlhf_megatron.data.tokenizer")
    assert len(tokenizer.build_tiny_tokenizer()) == load_config("quickstart_cpu", []).model_arch.vocab_size


def _leaves(value, prefix=""):
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, value


def _same_value(a, b):
    numbers = (int, float)
    if isinstance(a, bool) or isinstance(b, bool) or not (isinstance(a, numbers) and isinstance(b, numbers)):
        return type(a) is type(b) and a == b
    return a == b


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_states_only_what_differs(preset):
    # The schema (or the `base` preset) is the source of truth: a preset line that restates the
    # value the key has without it is noise that can drift from the default it copies.
    from omegaconf import OmegaConf

    from rlhf_megatron.config.schema import RunConfig

    defaults = dict(
        _leaves(OmegaConf.to_container(OmegaConf.structured(RunConfig), resolve=False, enum_to_str=True))
    )
    *bases, (_, own) = read_preset_layers(preset)
    inherited = {}
    for _, mapping in bases:
        for key, value in _leaves(mapping):
            for other in [k for k in inherited if k.startswith(key + ".") or key.startswith(k + ".")]:
                del inherited[other]
            inherited[key] = value
    restated = []
    for key, value in _leaves(own):
        without = inherited[key] if key in inherited else defaults.get(key, object())
        if _same_value(value, without):
            restated.append(f"{key}: {value!r}")
    assert not restated, f"{preset} restates the value these keys have without it: {restated}"


STAGE_PRESETS = [
    (stage, p.relative_to(CONFIGS_DIR).as_posix()) for stage in ("sft", "rm") for p in list_presets(stage)
]


def test_the_pipeline_presets_are_stage_presets():
    assert ("sft", "pipeline_cpu/sft.yaml") in STAGE_PRESETS and (
        "rm",
        "pipeline_cpu/rm.yaml",
    ) in STAGE_PRESETS
    assert "pipeline_cpu/ppo.yaml" in PRESETS


@pytest.mark.parametrize("stage, preset", STAGE_PRESETS)
def test_stage_preset_loads_and_states_only_what_differs(stage, preset):
    from omegaconf import OmegaConf

    from rlhf_megatron.config.loader import load_stage_config
    from rlhf_megatron.config.schema_stages import RMConfig, SFTConfig

    schema = SFTConfig if stage == "sft" else RMConfig
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_stage_config(schema, preset, [])
    defaults = dict(
        _leaves(OmegaConf.to_container(OmegaConf.structured(schema), resolve=False, enum_to_str=True))
    )
    *_, (_, own) = read_preset_layers(preset)
    restated = [f"{k}: {v!r}" for k, v in _leaves(own) if _same_value(v, defaults.get(k, object()))]
    assert not restated, f"{preset} restates the value these keys have without it: {restated}"
