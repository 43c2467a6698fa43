"""Qwen2.5-VL / Qwen2-VL / Qwen3-VL without processes: config parsing, the HF⇄mcore spec, stages,
image layout, Qwen3-VL's learned-position taps and interleaved M-RoPE."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlhf_megatron.models.multimodal import (
    check_pixel_values,
    images_per_row,
    scatter_image_embeddings,
    select_rows,
)
from rlhf_megatron.models.spec import (
    DictTensorSource,
    SpecError,
    expected_hf_shapes,
    gather_tp_shards,
    hf_source,
    hf_to_mcore,
    local_to_global_layer,
    mcore_full_shape,
    mcore_param_names,
    mcore_to_hf,
    param_owner,
    split_tp_shard,
    tp_shard_slices,
)
from rlhf_megatron.models.tiny import make_tiny_qwen2_5_vl
from rlhf_megatron.models.vision import vision_layout
from rlhf_megatron.planning.model_arch import ModelArch, UnsupportedModelError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{family: (arch, HF state, config.json)} for a tiny Qwen2.5-VL, a tied Qwen2-VL and a Qwen3-VL."""
    root = tmp_path_factory.mktemp("vl_spec")
    out = {}
    for family, tied in (("qwen2_5_vl", False), ("qwen2_vl", True), ("qwen3_vl", False)):
        d = make_tiny_qwen2_5_vl(root / family, family=family, tie_word_embeddings=tied)
        out[family] = (
            ModelArch.from_hf_dir(d),
            load_file(str(d / "model.safetensors")),
            json.loads((d / "config.json").read_text()),
        )
    return out


def _hub_layout(config: dict) -> dict:
    """transformers-5 config.json -> the hub's layout: text keys on top, rope_scaling with mrope."""
    text = dict(config["text_config"])
    rope = text.pop("rope_parameters")
    flat = {k: v for k, v in config.items() if k != "text_config"}
    flat.update({k: v for k, v in text.items() if k != "model_type"})
    flat["rope_theta"] = rope["rope_theta"]
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    vision = dict(config["vision_config"])
    vision["in_chans"] = vision.pop("in_channels")
    flat["vision_config"] = vision
    return flat


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_both_config_layouts_give_one_arch_and_json_round_trips(tiny, family):
    arch, _, config = tiny[family]
    assert ModelArch.from_hf_config(_hub_layout(config)) == arch
    assert ModelArch.from_dict(json.loads(json.dumps(arch.to_dict()))) == arch
    assert arch.mrope_section == (8, 12, 12) and arch.qkv_bias and arch.head_dim == 64
    assert arch.image_token_id == 117 and arch.vision.patch_dim == 3 * 2 * 14 * 14
    if family == "qwen2_5_vl":
        assert (arch.vision.norm, arch.vision.mlp, arch.vision.window_tokens) == ("rmsnorm", "swiglu", 2)
        assert arch.vision.fullatt_block_indexes == (1,) and not arch.tie_word_embeddings
    else:
        assert (arch.vision.norm, arch.vision.mlp, arch.vision.window_size) == (
            "layernorm",
            "quick_gelu",
            None,
        )
        assert arch.vision.fullatt_block_indexes == (0, 1) and arch.tie_word_embeddings
    assert arch.with_head("value").architecture.endswith("ForTokenClassification")


def test_qwen3_vl_config_parses_to_its_parts(tiny):
    arch, _, config = tiny["qwen3_vl"]
    assert ModelArch.from_dict(json.loads(json.dumps(arch.to_dict()))) == arch
    assert (arch.qk_norm, arch.qkv_bias, arch.mrope_interleaved, arch.head_dim) == (True, False, True, 64)
    v = arch.vision
    assert (v.norm, v.mlp, v.patch_bias, v.num_position_embeddings) == ("layernorm", "gelu_tanh", True, 16)
    assert v.deepstack_visual_indexes == (0, 1) and v.frames_apart and v.patch_dim == 3 * 2 * 16 * 16


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_parameter_count_is_the_checkpoints_exactly(tiny, family):
    from rlhf_megatron.planning.arch import count_parameters

    arch, state, _ = tiny[family]
    count = count_parameters(arch)
    assert count.total == sum(t.numel() for t in state.values())
    visual = ("visual.", "model.visual.")
    assert count.vision == sum(t.numel() for n, t in state.items() if n.startswith(visual))


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[8, 8, 8]),
            "mrope_section .* head_dim / 2 = 32",
        ),
        (
            lambda c: c["vision_config"].update(out_hidden_size=128),
            "merger outputs 128 .* hidden_size is 256",
        ),
        (lambda c: c["vision_config"].update(hidden_act="gelu"), "vision_config.hidden_act 'gelu'"),
        (lambda c: c.pop("vision_config"), "needs a 'vision_config' section"),
        (
            lambda c: c["vision_config"].update(fullatt_block_indexes=[2]),
            r"fullatt_block_indexes \[2\] are outside",
        ),
    ],
)
def test_bad_vision_language_configs_name_the_key(tiny, edit, match):
    config = json.loads(json.dumps(tiny["qwen2_5_vl"][2]))
    edit(config)
    with pytest.raises(UnsupportedModelError, match=match):
        ModelArch.from_hf_config(config, source="/m/config.json")


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda c: c["text_config"]["rope_parameters"].pop("mrope_interleaved"),
            '"mrope_interleaved": true in text_config.rope_parameters',
        ),
        (
            lambda c: c["vision_config"].update(deepstack_visual_indexes=[0, 2]),
            r"deepstack_visual_indexes \[0, 2\] must name distinct blocks of the 2",
        ),
        (
            lambda c: c["vision_config"].update(num_position_embeddings=15),
            "num_position_embeddings=15 is not a square",
        ),
        (
            lambda c: c["vision_config"].update(hidden_act="silu"),
            "hidden_act 'silu' .*only 'gelu_pytorch_tanh'",
        ),
    ],
)
def test_bad_qwen3_vl_configs_name_the_key(tiny, edit, match):
    config = json.loads(json.dumps(tiny["qwen3_vl"][2]))
    edit(config)
    with pytest.raises(UnsupportedModelError, match=match):
        ModelArch.from_hf_config(config, source="/m/config.json")


def test_learned_position_taps_match_transformers():
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    arch = ModelArch.from_hf_config(_tiny_config("qwen3_vl"))
    grids = torch.tensor([[1, 6, 4], [2, 8, 12], [1, 2, 2]])
    index, weight = vision_layout(grids, arch.vision).taps
    ref_index, ref_weight = get_vision_interpolation_indices_and_weights(
        grids, num_grid_per_side=4, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    assert torch.equal(index, ref_index) and torch.equal(weight, ref_weight)


def test_interleaved_mrope_matches_transformers():
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from rlhf_megatron.models.gpt import InterleavedMultimodalRotaryEmbedding

    section = [12, 10, 10]
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": section, "mrope_interleaved": True}
    hf = Qwen3VLTextRotaryEmbedding(Qwen3VLTextConfig(head_dim=64, rope_parameters=rope))
    # The forward alone (megatron's constructor puts inv_freq on the current CUDA device).
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    state = SimpleNamespace(inv_freq=inv_freq, seq_len_interpolation_factor=None, cp_group=None)
    positions = torch.randint(0, 50, (3, 2, 7))
    cos, _ = hf(torch.zeros(1, dtype=torch.float32), positions)  # (B, S, D)
    angles = InterleavedMultimodalRotaryEmbedding.forward(state, positions, section)  # (S, B, 1, D)
    assert torch.allclose(angles[:, :, 0].transpose(0, 1).cos(), cos, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_hf_to_mcore_to_hf_is_bit_exact_and_complete(tiny, family):
    arch, state, _ = tiny[family]
    source = DictTensorSource(state)
    exported = {}
    names = mcore_param_names(arch)
    assert names[0] == "vision_model.patch_embed.weight" and names[-1] == "language_model.output_layer.weight"
    for name in names:
        full = hf_to_mcore(name, arch, source)
        assert tuple(full.shape) == mcore_full_shape(name, arch), name
        for hf_name, t in mcore_to_hf(name, full, arch):
            assert hf_name not in exported, hf_name
            exported[hf_name] = t
    assert set(exported) == set(state) == set(expected_hf_shapes(arch))
    for hf_name, t in exported.items():
        assert torch.equal(t, state[hf_name]), hf_name


def test_vision_mlp_is_padded_and_tp_shards_reassemble(tiny):
    arch, state, _ = tiny["qwen2_5_vl"]  # vision MLP 252: padded to 256
    source = DictTensorSource(state)
    fc1, fc2 = (
        "vision_model.decoder.layers.0.mlp.linear_fc1.weight",
        "vision_model.decoder.layers.0.mlp.linear_fc2.weight",
    )
    assert mcore_full_shape(fc1, arch, 4) == (512, 128) and mcore_full_shape(fc2, arch, 4) == (128, 256)
    full = hf_to_mcore(fc1, arch, source)
    gate, up = full.chunk(2)
    assert torch.equal(gate[:252], state["visual.blocks.0.mlp.gate_proj.weight"]) and not gate[252:].any()
    assert torch.equal(up[:252], state["visual.blocks.0.mlp.up_proj.weight"]) and not up[252:].any()
    vision = [n for n in mcore_param_names(arch) if n.startswith("vision_model.")]
    for tp in (2, 4):  # 4 vision heads
        for name in vision:
            whole = hf_to_mcore(name, arch, source)
            shards = [hf_to_mcore(name, arch, source, r, tp) for r in range(tp)]
            for r, shard in enumerate(shards):
                assert torch.equal(shard, split_tp_shard(name, whole, arch, r, tp)), (name, tp, r)
            assert torch.equal(gather_tp_shards(name, shards, arch), whole), (name, tp)
    # The fused HF qkv [q; k; v] becomes megatron's per-head [q_h; k_h; v_h]; TP splits whole heads.
    qkv = hf_to_mcore("vision_model.decoder.layers.1.self_attention.linear_qkv.bias", arch, source, 1, 2)
    hf = state["visual.blocks.1.attn.qkv.bias"].view(3, 4, 32)  # (q/k/v, head, head_dim)
    expected = hf[:, 2:4].transpose(0, 1).reshape(-1)  # rank 1 of 2: heads 2 and 3, each [q; k; v]
    assert torch.equal(qkv, expected)
    with pytest.raises(SpecError, match=r"vision_config.num_heads \(4\) is not divisible by the TP size 3"):
        tp_shard_slices("vision_model.decoder.layers.0.self_attention.linear_qkv.weight", arch, 0, 3)


def test_transformers5_prefixed_names_are_found(tiny):
    arch, state, _ = tiny["qwen2_5_vl"]
    renamed = {
        (
            "model.visual." + k[7:]
            if k.startswith("visual.")
            else "model.language_model." + k[6:]
            if k.startswith("model.")
            else k
        ): v
        for k, v in state.items()
    }
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in renamed
    source, plain = hf_source(DictTensorSource(renamed), arch), DictTensorSource(state)
    for name in mcore_param_names(arch):
        assert torch.equal(hf_to_mcore(name, arch, source, 1, 2), hf_to_mcore(name, arch, plain, 1, 2)), name


def test_vision_lives_on_the_first_stage_and_lm_layers_split():
    layers = 8
    assert param_owner("vision_model.decoder.layers.1.mlp.linear_fc2.weight", layers, 2, 2) == (
        0,
        0,
        "vision_model.decoder.layers.1.mlp.linear_fc2.weight",
    )
    assert param_owner("language_model.decoder.layers.5.mlp.linear_fc2.weight", layers, 2, 2) == (
        0,
        1,
        "language_model.decoder.layers.1.mlp.linear_fc2.weight",
    )
    assert param_owner("language_model.embedding.word_embeddings.weight", layers, 4) == (
        0,
        None,
        "language_model.embedding.word_embeddings.weight",
    )
    assert param_owner("language_model.output_layer.weight", layers, 4, 2)[:2] == (3, 1)
    assert local_to_global_layer("language_model.decoder.layers.1.input_layernorm.weight", layers, 1, 2) == (
        "language_model.decoder.layers.5.input_layernorm.weight"
    )
    assert local_to_global_layer("vision_model.decoder.layers.1.input_layernorm.weight", layers, 1, 2) == (
        "vision_model.decoder.layers.1.input_layernorm.weight"
    )


@pytest.mark.parametrize("grids", [[[1, 6, 4], [1, 8, 6]], [[2, 8, 12], [1, 4, 4], [1, 10, 2]]])
def test_window_order_and_masks_match_transformers(grids):
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

    arch = ModelArch.from_hf_config(_tiny_config("qwen2_5_vl"))
    grid = torch.tensor(grids)
    layout = vision_layout(grid, arch.vision)
    window_index, cu_windows = get_vision_window_index(grid, 2, arch.vision.window_size, 14)
    unit = torch.arange(4)
    assert torch.equal(layout.order, (window_index[:, None] * 4 + unit).flatten())
    assert torch.equal(layout.restore, torch.argsort(window_index))
    assert torch.equal(layout.window.mask()[0, 0], _mask_from(cu_windows))
    assert torch.equal(
        layout.full.mask()[0, 0], _mask_from(get_vision_cu_seqlens(grid))
    )  # one segment per frame
    assert layout.rotary.shape == (grid.prod(-1).sum().item(), 1, 1, arch.vision.head_dim)


def _mask_from(cu_seqlens):
    seg = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff())
    return seg[:, None] != seg[None, :]


def _tiny_config(family):
    from rlhf_megatron.models.tiny import build_tiny_qwen2_5_vl

    model, _ = build_tiny_qwen2_5_vl(family)
    return {**model.config.to_dict(), "architectures": [type(model).__name__]}


def test_images_are_assigned_to_rows_and_mismatches_name_the_row():
    grids = torch.tensor([[1, 4, 4], [1, 2, 4], [1, 4, 2]])  # 4, 2, 2 tokens
    ids = torch.tensor([[9, 7, 7, 7, 7, 9], [9, 9, 9, 9, 9, 9], [7, 7, 9, 7, 7, 9]])
    rows = images_per_row(ids, grids, 7, 2)
    assert rows == [(0, 1), (1, 1), (1, 3)]
    pixels = torch.arange(32 * 3.0).reshape(32, 3)  # 16 + 8 + 8 patches
    check_pixel_values(pixels, grids, 3)
    px, g = select_rows(pixels, grids, rows, range(1, 3))
    assert torch.equal(px, pixels[16:]) and torch.equal(g, grids[1:])
    assert select_rows(pixels, grids, rows, range(1, 2)) == (None, None)
    short = ids.clone()
    short[2, 0] = 9
    with pytest.raises(
        ValueError, match=r"row 2: 3 image tokens \(id 7\) but .* \[\[1, 2, 4\], \[1, 4, 2\]\], make 4"
    ):
        images_per_row(short, grids, 7, 2)
    with pytest.raises(
        ValueError, match="image_grid_thw has 4 images but the rows' image tokens .* only the first 3"
    ):
        images_per_row(ids, torch.cat([grids, grids[:1]]), 7, 2)
    with pytest.raises(ValueError, match=r"image 1: image_grid_thw \[1, 3, 4\] must have"):
        images_per_row(ids, torch.tensor([[1, 4, 4], [1, 3, 4]]), 7, 2)
    with pytest.raises(ValueError, match="pixel_values has 31 patches but image_grid_thw implies 32"):
        check_pixel_values(pixels[:-1], grids, 3)


def test_image_embeddings_go_in_row_major_order_like_masked_scatter():
    ids = torch.tensor([[7, 1, 7], [1, 7, 1]])
    emb = torch.zeros(3, 2, 4)  # (S, B, H)
    images = torch.arange(12.0).reshape(3, 4)
    out = scatter_image_embeddings(emb, ids, images, 7)
    hf = torch.zeros(2, 3, 4).masked_scatter(
        (ids == 7)[..., None], images
    )  # what transformers does on [B, S, H]
    assert torch.equal(out.transpose(0, 1), hf)
    with pytest.raises(ValueError, match="3 image tokens but the vision tower produced 2"):
        scatter_image_embeddings(emb, ids, images[:2], 7)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_export_without_a_config_rebuilds_one_transformers_reads_back(tiny, family):
    from transformers import AutoConfig

    from rlhf_megatron.convert.common import hf_config as _hf_config

    arch = tiny[family][0]
    config = _hf_config(
        arch, None, torch.float32
    )  # from the arch alone, as mcore-to-hf does without config.json
    assert ModelArch.from_hf_config(config) == arch
    reread = AutoConfig.for_model(**config).to_dict()  # transformers accepts it
    assert ModelArch.from_hf_config({**reread, "architectures": [arch.architecture]}) == arch


def test_segments_group_equal_lengths_and_cover_every_position_once():
    from rlhf_megatron.models.vision import Segments

    segments = Segments([3, 5, 3, 2, 5])
    groups = {n: index.tolist() for n, index in segments.groups()}
    assert groups == {3: [[0, 1, 2], [8, 9, 10]], 5: [[3, 4, 5, 6, 7], [13, 14, 15, 16, 17]], 2: [[11, 12]]}
    # Attention over the segments of each length side by side equals the masked attention.
    q, k, v = (torch.randn(18, 2, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = segments.mask()[0, 0]
    scores = (torch.einsum("shd,thd->hst", q, k) / 2).masked_fill(mask, float("-inf")).softmax(-1)  # d = 4
    dense = torch.einsum("hst,thd->shd", scores, v)
    out = torch.empty_like(q)
    for _, index in segments.groups():
        qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))
        ctx = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs)
        out[index.flatten()] = ctx.transpose(1, 2).flatten(0, 1)
    torch.testing.assert_close(out, dense)
