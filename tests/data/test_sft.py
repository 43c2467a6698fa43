"""SFT rows: the loss mask covers exactly what the assistant says (tool calls included), and
truncation and packing keep samples whole and separable; rows with images (the tiny Qwen2.5-VL
processor) are the processor's tokens, never train a vision token, name what does not add up,
and batch with their images and M-RoPE positions."""

from __future__ import annotations

import pytest
import torch
from vl_helpers import png

from rlhf_megatron.data.sft import (
    SFTDataError,
    SFTImages,
    SFTSample,
    image_parts,
    pack_samples,
    single_turn_messages,
    tokenize_conversation,
    tokenize_with_images,
    truncate,
)
from rlhf_megatron.data.tokenizer import build_tiny_tokenizer

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "37*48"}}}


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _trained_text(tok, sample: SFTSample) -> str:
    return tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])


def test_only_assistant_turns_and_their_end_of_turn_are_trained(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3="},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "4+4="},
        {"role": "assistant", "content": "8"},
    ]
    sample = tokenize_conversation(tok, messages, source="row 0")
    full = tok.apply_chat_template(messages, tokenize=True)
    assert list(sample.input_ids) == _ids(full), "the sample is the whole rendered transcript"
    eos = tok.eos_token
    assert _trained_text(tok, sample) == f"5{eos}8{eos}"  # no role headers, no user or system text


def test_tool_calls_are_trained_and_tool_responses_are_not(tok):
    messages = [
        {"role": "user", "content": "What is 37*48?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "1776"},
        {"role": "assistant", "content": "1776"},
    ]
    sample = tokenize_conversation(tok, messages, tools=TOOLS, source="row 7")
    trained = _trained_text(tok, sample)
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>' in trained
    assert "<tool_response>" not in trained and "tools: calculator" not in trained
    assert trained.endswith(f"1776{tok.eos_token}")
    assert list(sample.input_ids) == _ids(tok.apply_chat_template(messages, tools=TOOLS, tokenize=True))


def test_a_single_turn_row_is_a_user_assistant_chat(tok):
    sample = tokenize_conversation(tok, single_turn_messages("12+7=", "19", "row 2"), source="row 2")
    assert _trained_text(tok, sample) == f"19{tok.eos_token}"
    with pytest.raises(SFTDataError, match="row 3: the response must be a non-empty string"):
        single_turn_messages("12+7=", None, "row 3")


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "user", "content": "hi"}], "row 4: no assistant message"),
        (
            [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}],
            "message 0 has role 'narrator'",
        ),
    ],
)
def test_rows_without_anything_to_train_are_named(tok, messages, message):
    with pytest.raises(SFTDataError, match=message):
        tokenize_conversation(tok, messages, source="row 4")


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    class Rewriting:  # renders the last assistant turn in a different way than earlier ones
        chat_template = "x"

        def apply_chat_template(self, messages, add_generation_prompt=False, **_):
            body = [len(m["content"]) + (5 if i == len(messages) - 1 else 0) for i, m in enumerate(messages)]
            return body + ([99] if add_generation_prompt else [])

    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(SFTDataError, match="row 9: rendering message 1 changed the tokens"):
        tokenize_conversation(Rewriting(), messages, source="row 9")


def test_truncation_follows_verls_modes():
    sample = SFTSample(tuple(range(10)), (0, 0, 0, 0, 0, 1, 1, 1, 1, 1))
    with pytest.raises(SFTDataError, match="row 1: 10 tokens, more than data.max_length=6"):
        truncate(sample, 6, "error", "row 1")
    assert truncate(sample, 6, "left", "row 1").input_ids == (4, 5, 6, 7, 8, 9)
    assert truncate(sample, 8, "right", "row 1").loss_mask == (0, 0, 0, 0, 0, 1, 1, 1)
    with pytest.raises(SFTDataError, match="no assistant token is left"):
        truncate(sample, 4, "right", "row 1")
    assert truncate(sample, 10, "error", "row 1") is sample


def test_packing_keeps_samples_whole_in_segments_with_their_own_positions():
    samples = [SFTSample((1,) * n, (1,) * n) for n in (5, 3, 4, 2, 6)]
    rows = pack_samples(samples, 8)
    assert sorted(len(r.input_ids) for r in rows) == [4, 8, 8]  # first fit, longest first: 6+2, 5+3, 4
    assert sum(len(r.input_ids) for r in rows) == 20
    for row in rows:
        assert len(row.input_ids) <= 8
        for seg in set(row.segment_ids):
            positions = [p for p, s in zip(row.position_ids, row.segment_ids) if s == seg]
            assert positions == list(range(len(positions))), "positions restart in every segment"
    with pytest.raises(SFTDataError, match="sample 4: 6 tokens do not fit a packed row of 5"):
        pack_samples(samples, 5)


def test_stage_batches_pad_with_attended_untrained_filler_rows():
    from rlhf_megatron.config.schema_stages import SFTDataConfig
    from rlhf_megatron.stages.data import sft_batch

    samples = [SFTSample((5, 6, 7), (0, 1, 1)), SFTSample((8, 9), (0, 1))]
    batch = sft_batch(samples, SFTDataConfig(max_length=4, packing=True), dp=4)
    assert len(batch) == 4  # two packed rows (3 and 2 tokens do not share 4), two filler rows
    for row in range(len(batch)):
        assert batch["attention_mask"][row].sum() >= 1, "every row attends to at least one token"
    assert int(batch["loss_mask"].sum()) == 3, "filler rows train nothing"


# --- images (a vision-language model: the tiny Qwen2.5-VL processor) ---------------------------

IMAGE_CHAT = [
    {"role": "user", "content": "<image>How many squares?"},
    {"role": "assistant", "content": "3"},
]


def _stored(*values, **kw) -> SFTImages:
    return SFTImages(tuple(values), "f.parquet row 0: 'images'", **kw)


def _vision_tokens(vision, sample: SFTSample) -> list[int]:
    return [i for i, t in enumerate(sample.input_ids) if t == vision.image_token_id]


def test_image_rows_are_the_processors_tokens_and_vision_tokens_are_never_trained(vision):
    tok = vision.processor.tokenizer
    sample = tokenize_with_images(tok, vision, IMAGE_CHAT, _stored(png(84, 56)), source="row 0")
    assert sample.images.grid_thw == ((1, 4, 6),)  # 56 x 84 pixels: 4 x 6 patches, 2 x 2 merged
    pads = _vision_tokens(vision, sample)
    assert len(pads) == 6 and not any(sample.loss_mask[i] for i in pads)
    assert _trained_text(tok, sample) == "3<|im_end|>\n", "the reply and its end-of-turn, nothing else"
    parts, placed = image_parts(IMAGE_CHAT, "row 0")
    assert placed == 1
    text = vision.processor.apply_chat_template(parts, tokenize=False)
    encoded = vision.processor(images=sample.images.prepare(), text=[text], add_special_tokens=False)
    assert list(sample.input_ids) == encoded["input_ids"][0], "exactly what the model's processor gives"


def test_qwen_content_parts_place_images_as_placeholders_do(vision):
    """Qwen's content-list form (with the null fields Arrow adds to struct parts) is the same row."""
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "image", "text": None},
                {"type": "text", "text": "How many squares?", "image": None},
            ],
        },
        {"role": "assistant", "content": "3"},
    ]
    tok = vision.processor.tokenizer
    a = tokenize_with_images(tok, vision, IMAGE_CHAT, _stored(png(56, 56)), source="row 0")
    b = tokenize_with_images(tok, vision, parts, _stored(png(56, 56)), source="row 0")
    assert a == b


@pytest.mark.parametrize(
    "messages, images, message",
    [
        (
            IMAGE_CHAT,
            2,
            r"f.parquet row 0: 'images' holds 2 image\(s\), but the messages place 1; put one <image>",
        ),
        (IMAGE_CHAT, 0, r"'images' holds 0 image\(s\), but the messages place 1"),
        (
            [{"role": "user", "content": "Draw."}, {"role": "assistant", "content": "<image>"}],
            1,
            r"row 0: message 1 \(assistant\) places 1 image\(s\); images go in user messages",
        ),
        (
            [{"role": "user", "content": [{"type": "video"}]}, {"role": "assistant", "content": "x"}],
            1,
            "row 0: message 0 content part 0 is {'type': 'video'}; expected",
        ),
    ],
)
def test_image_rows_that_do_not_add_up_are_named(vision, messages, images, message):
    with pytest.raises(SFTDataError, match=message):
        tokenize_with_images(
            vision.processor.tokenizer, vision, messages, _stored(*[png(56, 56)] * images), source="row 0"
        )


def test_an_undecodable_image_names_its_row_key_and_index(vision):
    with pytest.raises(
        SFTDataError, match=r"f.parquet row 0: 'images'\[0\]: .*not a readable image.*Fix or drop"
    ):
        tokenize_with_images(
            vision.processor.tokenizer, vision, IMAGE_CHAT, _stored(b"not a png"), source="row 0"
        )


def test_a_sample_with_images_is_never_truncated(vision):
    sample = tokenize_with_images(vision.processor.tokenizer, vision, IMAGE_CHAT, _stored(png(56, 56)))
    for mode in ("error", "left", "right"):
        with pytest.raises(SFTDataError, match="row 5: .* a sample with images is not truncated"):
            truncate(sample, len(sample) - 1, mode, "row 5")
    assert truncate(sample, len(sample), "right", "row 5") is sample


def _write_rows(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_stage_rows_read_images_from_the_image_key_and_text_models_refuse_them(vision, tmp_path):
    from rlhf_megatron.config.schema_stages import SFTDataConfig
    from rlhf_megatron.stages.data import sft_samples

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png(56, 56))
    rows = [
        {"messages": IMAGE_CHAT, "pics": [{"bytes": None, "path": "img/a.png"}]},  # relative to the file
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "pics": []},
    ]
    path = _write_rows(tmp_path / "train.parquet", rows)
    data = SFTDataConfig(image_key="pics", min_pixels=None, max_pixels=None, max_length=128)
    data.multiturn.enable = True
    with_images, text = sft_samples(data, vision.processor.tokenizer, path, "data.train_files", vision)
    assert with_images.images.grid_thw == ((1, 4, 4),) and text.images is None
    with pytest.raises(
        SFTDataError,
        match=r"data.train_files: .*train.parquet row 0: 'pics' \(data.image_key\) holds 1 image\(s\), but the model "
        "is text-only",
    ):
        sft_samples(data, vision.processor.tokenizer, path, "data.train_files", None)
    # Videos are not trained by the SFT stage yet: a row holding some is refused, not dropped.
    rows = [{**rows[0], "videos": ["clip.mp4"]}]
    path = _write_rows(tmp_path / "videos.parquet", rows)
    with pytest.raises(
        SFTDataError,
        match=r"videos.parquet row 0: column 'videos' holds videos.*reward-model stages do not train on",
    ):
        sft_samples(data, vision.processor.tokenizer, path, "data.train_files", vision)


@pytest.mark.parametrize("packing", [True, False])
def test_image_batches_carry_each_rows_images_and_restarting_mrope_positions(vision, packing):
    """Packed or not, a row's ``multi_modal_inputs`` are its samples' images in order (what the
    processor gives them), its positions are each sample's own M-RoPE positions, and micro-batches
    of one row keep that row's images."""
    from rlhf_megatron.config.schema_stages import SFTDataConfig
    from rlhf_megatron.data.rope_index import get_rope_index
    from rlhf_megatron.stages.data import sft_batch
    from rlhf_megatron.workers.megatron_engine import MODEL_KEYS, split_micro_batches

    tok = vision.processor.tokenizer
    two = [
        {"role": "user", "content": "<image>and"},
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "<image>?"},
        {"role": "assistant", "content": "two"},
    ]
    samples = [
        tokenize_with_images(tok, vision, IMAGE_CHAT, _stored(png(84, 56))),
        tokenize_with_images(
            tok,
            vision,
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            _stored(),
        ),
        tokenize_with_images(tok, vision, two, _stored(png(56, 56), png(56, 112, (0, 90, 200)))),
    ]
    assert [len(_vision_tokens(vision, s)) for s in samples] == [6, 0, 12]
    assert sum(samples[2].loss_mask) == sum(len(tok(t + "<|im_end|>\n")["input_ids"]) for t in ("one", "two"))
    length = len(samples[0]) + len(samples[1])  # the first two share a packed row
    batch = sft_batch(samples, SFTDataConfig(max_length=length, packing=packing), dp=4, vision=vision)
    rows = [(2,), (0, 1)] if packing else [(0,), (1,), (2,)]
    assert len(batch) == 4 and batch["position_ids"].shape[:2] == (4, 3)
    images = batch["multi_modal_inputs"]
    assert images[len(rows) :].tolist() == [None] * (4 - len(rows)), "filler rows carry no images"
    for r, members in enumerate(rows):
        start = 0
        for i in members:  # each sample's positions are its own, from 0
            s = samples[i]
            ids = torch.tensor(s.input_ids)[None]
            grid = torch.tensor(s.images.grid_thw) if s.images else None
            alone = get_rope_index(
                ids, torch.ones_like(ids), grid, image_token_id=vision.image_token_id, spatial_merge_size=2
            )[0]
            assert torch.equal(batch["position_ids"][r, :, start : start + len(s)], alone)
            start += len(s)
        with_images = [samples[i] for i in members if samples[i].images]
        if not with_images:
            assert images[r] is None
            continue
        expected = vision.processor.image_processor(
            images=[im for s in with_images for im in s.images.prepare()], return_tensors="pt"
        )
        assert torch.equal(images[r]["pixel_values"], expected["pixel_values"])
        assert torch.equal(images[r]["image_grid_thw"], expected["image_grid_thw"])
    vision_columns = batch["input_ids"] == vision.image_token_id
    assert int(vision_columns.sum()) == 18 and not batch["loss_mask"][vision_columns].any()
    for micro in split_micro_batches(batch, (*MODEL_KEYS, "loss_mask"), 1):
        row = int(micro["_rows"][0])
        grid = images[row]["image_grid_thw"] if images[row] is not None else None
        assert (
            torch.equal(micro["image_grid_thw"], grid) if grid is not None else "image_grid_thw" not in micro
        )
