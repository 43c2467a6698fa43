"""RLHFDataset on image + text prompts: EasyR1's and verl's layouts through the real Qwen2.5-VL processor,
per-row multimodal fields through collate/split/balance, and the tiny checkpoint's processor loading."""

import math
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from vl_helpers import png

from rlhf_megatron.config.schema import DataConfig
from rlhf_megatron.data.balance import balance_batch, sequence_costs
from rlhf_megatron.data.dataset import RLHFDataset, collate_fn
from rlhf_megatron.data.multimodal import load_vision_processor, target_size
from rlhf_megatron.data.rope_index import get_rope_index, image_token_counts

MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 16  # 4 to 16 merged patches before the processor
SYSTEM = "Think first."
PAD = "<|image_pad|>"
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


def easyr1_cfg(**overrides):
    base = dict(prompt_key="problem", max_prompt_length=160, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return DataConfig(**{**base, **overrides})


def geo_rows():
    """geometry3k-shaped rows: ``problem`` with <image>, ``answer``, ``images`` as HF stores them."""
    return [
        {"problem": "<image>Find x.", "answer": "3", "images": [{"bytes": png(300, 200), "path": None}]},
        {
            "problem": "Compare <image> with <image>.",
            "answer": "4",
            "images": [{"bytes": png(56, 56), "path": None}, {"bytes": png(20, 40), "path": None}],
        },
        {"problem": "What is 2+2?", "answer": "4", "images": []},
        {
            "problem": "<image>Area?",
            "answer": "\\frac{1}{2}",
            "images": [{"bytes": png(112, 56), "path": None}],
        },
    ]


@pytest.fixture
def geo_parquet(tmp_path):
    path = tmp_path / "geometry3k" / "train.parquet"
    path.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(geo_rows()), path)
    return str(path)


def test_load_vision_processor_reads_config_and_processor(vision, tmp_path):
    tok = vision.processor.tokenizer
    assert vision.image_token == PAD and vision.image_token_id == tok.convert_tokens_to_ids(PAD)
    assert vision.spatial_merge_size == 2 and vision.patch_dim == 3 * 2 * 14 * 14
    # A text-only checkpoint has no vision processor.
    (tmp_path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    assert load_vision_processor(tmp_path) is None


def test_easyr1_row_is_built_as_easyr1_builds_it(vision, geo_parquet, tmp_path):
    template = tmp_path / "math.jinja"
    template.write_text("{{ content | trim }} Put the answer in \\boxed{}.\n")
    cfg = easyr1_cfg(format_prompt=str(template), system_prompt=SYSTEM, return_raw_chat=True)
    ds = RLHFDataset(geo_parquet, vision.processor.tokenizer, cfg, vision)
    item = ds[0]
    tok = vision.processor.tokenizer

    expected_prompt = (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{VISION}Find x. Put the answer in "
        "\\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(item["raw_prompt_ids"]) == expected_prompt
    assert item["raw_prompt"][1]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "Find x. Put the answer in \\boxed{}."},
    ]
    # 300 x 200 = 60000 px > 12544: EasyR1 scales by sqrt(12544 / 60000) and truncates -> 137 x 91;
    # the processor rounds to 28-multiples -> 140 x 84 = 10 x 6 patches of 14 px -> 15 merged tokens.
    (image,) = item["multi_modal_data"]["image"]
    assert image.size == (137, 91) and image.mode == "RGB"
    mm = item["multi_modal_inputs"]
    assert mm["image_grid_thw"].tolist() == [[1, 6, 10]]
    assert mm["pixel_values"].shape == (60, 3 * 2 * 14 * 14) and mm["pixel_values"].dtype == torch.float32

    ids = item["input_ids"]
    valid = item["attention_mask"].bool()
    assert ids.shape == (160,) and not valid[: 160 - int(valid.sum())].any()  # left padded
    assert item["raw_prompt_ids"].count(vision.image_token_id) == 1
    assert int((ids == vision.image_token_id).sum()) == 15
    # The expanded ids are the raw ids with the one pad repeated 15 times.
    pad_at = item["raw_prompt_ids"].index(vision.image_token_id)
    raw = item["raw_prompt_ids"]
    assert ids[valid].tolist() == raw[:pad_at] + [vision.image_token_id] * 15 + raw[pad_at + 1 :]
    expected_pos = get_rope_index(
        ids[None],
        item["attention_mask"][None],
        mm["image_grid_thw"],
        image_token_id=vision.image_token_id,
        spatial_merge_size=2,
    )[0]
    assert item["position_ids"].shape == (3, 160) and torch.equal(item["position_ids"], expected_pos)

    assert item["reward_model"] == {"ground_truth": "3"} and item["data_source"] == "train"
    assert item["extra_info"] == {} and item["index"] == 0
    assert not {"problem", "answer", "images"} & set(item)


def test_two_images_text_rows_and_dataset_name_as_data_source(vision, tmp_path):
    repo = tmp_path / "hiyouga" / "geometry3k"
    (repo / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(geo_rows()), repo / "data" / "train-00000-of-00001.parquet")
    ds = RLHFDataset(f"{repo}@train", vision.processor.tokenizer, easyr1_cfg(), vision)
    two, text = ds[1], ds[2]
    tok = vision.processor.tokenizer
    assert tok.decode(two["raw_prompt_ids"]).count(VISION) == 2
    # 56 x 56 -> 4 x 4 patches -> 4 tokens. 20 x 40 = 800 px < 3136: EasyR1 scales it by sqrt(3136 / 800)
    # -> 39 x 79; the processor rounds to 28 x 84 = 2352 px, under its own 3136 minimum, so it rounds
    # up instead -> 56 x 84 -> 4 x 6 patches -> 6 tokens.
    assert [im.size for im in two["multi_modal_data"]["image"]] == [(56, 56), (39, 79)]
    assert two["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 4]]
    assert int((two["input_ids"] == vision.image_token_id).sum()) == 4 + 6
    assert two["data_source"] == "geometry3k"  # the directory's name

    # A row without images in a multimodal dataset: string content, M-RoPE positions that equal 1-D
    # positions, and empty multimodal inputs with the right widths.
    assert tok.decode(text["raw_prompt_ids"]) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    n = int(text["attention_mask"].sum())
    assert text["position_ids"][:, -n:].tolist() == [list(range(n))] * 3
    assert text["multi_modal_data"] == {"image": []}
    assert text["multi_modal_inputs"]["pixel_values"].shape == (0, 1176)
    assert text["multi_modal_inputs"]["image_grid_thw"].shape == (0, 3)


def test_verl_multimodal_parquet_with_image_paths(vision, tmp_path):
    """verl's layout: chat messages with <image> placeholders plus an images column (here: file paths,
    relative to the data file's directory)."""
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png(56, 84))
    row = {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": "Look: <image> What is x?"}],
        "images": ["img/a.png"],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "7"},
        "extra_info": {"index": 42},
    }
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "geo.parquet")
    cfg = DataConfig(
        max_prompt_length=96,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        return_raw_chat=True,
        system_prompt=SYSTEM,
    )
    item = RLHFDataset(str(tmp_path / "geo.parquet"), vision.processor.tokenizer, cfg, vision)[0]
    assert item["raw_prompt"] == [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image"},
                {"type": "text", "text": " What is x?"},
            ],
        },
    ]
    assert vision.processor.tokenizer.decode(item["raw_prompt_ids"]).endswith(
        f"user\nLook: {VISION} What is x?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert item["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 6, 4]]  # 56 x 84 px, 14-px patches
    assert item["data_source"] == "hiyouga/geometry3k" and item["ability"] == "math"
    assert item["reward_model"]["ground_truth"] == "7" and item["index"] == 42 and "images" not in item


def test_collate_split_and_balance_keep_each_rows_patches(vision, geo_parquet):
    ds = RLHFDataset(geo_parquet, vision.processor.tokenizer, easyr1_cfg(), vision)
    items = [ds[i] for i in range(4)]
    batch = collate_fn(items)
    assert batch["position_ids"].shape == (4, 3, 160) and batch["input_ids"].shape == (4, 160)
    assert batch["multi_modal_inputs"].dtype == object and batch["multi_modal_inputs"].shape == (4,)

    def assert_rows_consistent(part):
        # Each row's image tokens match its own grids: patches travelled with their row.
        for r in range(len(part)):
            grid = part["multi_modal_inputs"][r]["image_grid_thw"]
            n_pads = int((part["input_ids"][r] == vision.image_token_id).sum())
            assert n_pads == int(image_token_counts(grid, 2).sum())
            assert part["multi_modal_inputs"][r]["pixel_values"].shape[0] == int(grid.prod(-1).sum())
            assert len(part["multi_modal_data"][r]["image"]) == grid.shape[0]

    picked = batch[[3, 0]]
    assert torch.equal(
        picked["multi_modal_inputs"][0]["pixel_values"], items[3]["multi_modal_inputs"]["pixel_values"]
    )
    assert_rows_consistent(picked)
    for part in batch.chunk(2) + batch.split([1, 3]):
        assert_rows_consistent(part)
    clone = pickle.loads(pickle.dumps(batch))  # what Ray does between driver and workers
    assert torch.equal(
        clone["multi_modal_inputs"][1]["image_grid_thw"], items[1]["multi_modal_inputs"]["image_grid_thw"]
    )

    # Balancing costs count image tokens: text tokens plus each row's merged patches.
    costs = sequence_costs(batch)
    for r, item in enumerate(items):
        text_tokens = len(item["raw_prompt_ids"]) - len(item["multi_modal_data"]["image"])
        images = int(image_token_counts(item["multi_modal_inputs"]["image_grid_thw"], 2).sum())
        assert costs[r] == text_tokens + images
    balanced, metrics = balance_batch(batch, dp_size=2)
    assert sorted(balanced["reward_model"][r]["ground_truth"] for r in range(4)) == [
        "3",
        "4",
        "4",
        "\\frac{1}{2}",
    ]
    assert_rows_consistent(balanced)
    sums = [sum(sequence_costs(part)) for part in balanced.chunk(2)]
    assert max(sums) == metrics["balance/max_partition_tokens"]


def test_filter_overlong_counts_image_tokens_without_decoding(vision, geo_parquet):
    full = RLHFDataset(geo_parquet, vision.processor.tokenizer, easyr1_cfg(), vision)
    actual = [int(full[i]["attention_mask"].sum()) for i in range(4)]
    limit = sorted(actual)[1]  # keeps the two shortest
    ds = RLHFDataset(
        geo_parquet,
        vision.processor.tokenizer,
        easyr1_cfg(filter_overlong_prompts=True, max_prompt_length=limit),
        vision,
    )
    kept = [i for i, n in enumerate(actual) if n <= limit]
    assert ds.prompt_lengths.tolist() == [actual[i] for i in kept] and len(ds) == len(kept)
    assert [ds[j]["reward_model"] for j in range(len(ds))] == [full[i]["reward_model"] for i in kept]


def test_image_prompt_over_the_limit_is_never_truncated(vision, geo_parquet):
    ds = RLHFDataset(
        geo_parquet, vision.processor.tokenizer, easyr1_cfg(max_prompt_length=20, truncation="left"), vision
    )
    with pytest.raises(
        ValueError, match=r"row 0: prompt is \d+ tokens \(15 of them for 1 image\(s\)\).*cannot be truncated"
    ):
        ds[0]
    text_row = ds[2]  # a text row (31 tokens) is still truncated per data.truncation
    assert (
        text_row["attention_mask"].sum() == 20 and text_row["raw_prompt_ids"][-1] == text_row["input_ids"][-1]
    )


def test_target_size_is_easyr1s_resize():
    assert target_size(300, 200, MIN_PIXELS, MAX_PIXELS) == (137, 91)
    assert target_size(20, 40, MIN_PIXELS, MAX_PIXELS) == (39, 79)
    assert target_size(56, 56, MIN_PIXELS, MAX_PIXELS) == (56, 56)
    assert target_size(20, 40, None, None) == (20, 40)
    w, h = target_size(4000, 3000, 262144, 4194304)  # EasyR1's defaults
    assert w * h <= 4194304 and (w, h) == (
        int(4000 * math.sqrt(4194304 / 12e6)),
        int(3000 * math.sqrt(4194304 / 12e6)),
    )
