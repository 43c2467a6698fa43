"""Bad input is refused early, with an error that names what is wrong (one parametrised matrix).

Entry points, called in-process: the config loader (``load_config``: schema types, unknown
keys, cross-section rules), ``RLHFDataset`` (verl and EasyR1 layouts, images, format prompts,
sources), HF checkpoints (``ModelArch.from_hf_dir``, the
driver's tokenizer/model vocabulary check), ``convert`` and ``launch`` argument parsing, and
checkpoint output directories. Each case asserts the exception type (or exit status) and key
words of the message.
"""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_megatron.config import ConfigError

# --------------------------------------------------------------------------- config
from rlhf_megatron.planning import load_config

# --------------------------------------------------------------------------- config
CONFIG_CASES = [
    # (id, overrides, words the ConfigError must contain)
    ("wrong_type_int", ["data.train_batch_size=abc"], ["train_batch_size"]),
    ("wrong_type_bool", ["trainer.val_before_train=maybe"], ["val_before_train"]),
    ("wrong_type_float", ["actor_rollout_ref.actor.optim.lr=fast"], ["lr"]),
    ("unknown_key", ["trainer.totl_epochs=3"], ["totl_epochs", "total_epochs"]),
    ("unknown_section", ["trainr.seed=3"], ["trainr"]),
    ("unknown_adv_estimator", ["algorithm.adv_estimator=grpoo"], ["adv_estimator", "grpoo"]),
    ("unknown_policy_loss", ["actor_rollout_ref.actor.policy_loss.loss_mode=nope"], ["loss_mode", "nope"]),
    ("unknown_loss_agg_mode", ["actor_rollout_ref.actor.loss_agg_mode=avg"], ["loss_agg_mode"]),
    ("unknown_kl_penalty", ["algorithm.kl_penalty=l9"], ["kl_penalty"]),
    ("unknown_rollout_name", ["actor_rollout_ref.rollout.name=sglang2"], ["rollout.name", "sglang2"]),
    ("unknown_strategy", ["actor_rollout_ref.actor.strategy=fsdp"], ["strategy", "megatron"]),
    ("unknown_device", ["trainer.device=tpu"], ["trainer.device"]),
    ("unknown_nan_policy", ["trainer.nan_policy=ignore"], ["trainer.nan_policy", "skip"]),
    ("unknown_verify_mode", ["trainer.verify_checkpoint=md5"], ["trainer.verify_checkpoint", "sha256"]),
    ("unknown_reward_on_error", ["reward.on_error=ignore"], ["reward.on_error"]),
    ("temperature_negative", ["actor_rollout_ref.rollout.temperature=-1"], ["temperature"]),
    ("top_p_above_one", ["actor_rollout_ref.rollout.top_p=1.5"], ["top_p"]),
    ("top_p_zero", ["actor_rollout_ref.rollout.top_p=0"], ["top_p"]),
    ("batch_size_zero", ["data.train_batch_size=0"], ["train_batch_size"]),
    ("rollout_n_zero", ["actor_rollout_ref.rollout.n=0"], ["rollout.n"]),
    ("grpo_needs_n_gt_1", ["actor_rollout_ref.rollout.n=1"], ["grpo", "n"]),
    (
        "tp_does_not_divide_heads",
        ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3", "trainer.n_gpus_per_node=3"],
        ["tensor_model_parallel_size"],
    ),
    (
        "tp_times_pp_exceeds_world",
        ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"],
        ["world size 2", "TP x PP x CP = 2 x 2 x 1 = 4"],
    ),
    (
        "layers_not_divisible_by_pp",
        [
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
            "trainer.n_gpus_per_node=3",
        ],
        ["pipeline_model_parallel_size"],
    ),
    (
        "mini_batch_larger_than_batch",
        ["actor_rollout_ref.actor.ppo_mini_batch_size=64"],
        ["ppo_mini_batch_size"],
    ),
    (
        "rollout_tp_does_not_divide_world",
        ["actor_rollout_ref.rollout.tensor_model_parallel_size=3"],
        ["rollout.tensor_model_parallel_size"],
    ),
    ("sequence_exceeds_positions", ["data.max_response_length=100000"], ["max_response_length"]),
    ("bad_resume_mode", ["trainer.resume_mode=sometimes"], ["resume_mode"]),
    ("missing_required_value", ["data.train_files=???"], ["train_files"]),
]


@pytest.mark.parametrize("overrides, words", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_config_refused(overrides, words):
    with pytest.raises(ConfigError) as info:
        # The layout written out (TP=2): `parallelism: auto` would search around an explicit PP=2.
        load_config("quickstart_cpu_tp2", overrides)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in: {message}"


# --------------------------------------------------------------------------- dataset
def _tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _data_cfg(**extra):
    """The preset's typed ``data`` section (what the trainer hands the dataset), with ``extra`` changed."""
    import dataclasses

    from omegaconf import OmegaConf

    return dataclasses.replace(OmegaConf.to_object(load_config("quickstart_cpu", [])).data, **extra)


def _write(tmp, rows, name="bad.parquet", empty=False):
    path = tmp / name
    table = pa.Table.from_pylist(rows)
    pq.write_table(table.slice(0, 0) if empty else table, path)
    return path


def _good_row(**change):
    row = {
        "data_source": "arith",
        "prompt": [{"role": "user", "content": "1+1?"}],
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"index": 0},
    }
    row.update(change)
    return row


def _ds_empty(tmp, model):
    from rlhf_megatron.data import RLHFDataset

    path = _write(tmp, [_good_row()], empty=True)
    RLHFDataset(str(path), _tokenizer(model), _data_cfg())


def _ds_missing_file(tmp, model):
    from rlhf_megatron.data import RLHFDataset

    RLHFDataset(str(tmp / "nope.parquet"), _tokenizer(model), _data_cfg())


def _ds_missing_column(tmp, model):
    from rlhf_megatron.data import RLHFDataset

    row = _good_row()
    del row["reward_model"]
    RLHFDataset(str(_write(tmp, [row])), _tokenizer(model), _data_cfg())


def _ds_prompt_not_messages(tmp, model):
    from rlhf_megatron.data import RLHFDataset

    RLHFDataset(str(_write(tmp, [_good_row(prompt=42)])), _tokenizer(model), _data_cfg())


def _ds_prompt_too_long(tmp, model):
    from rlhf_megatron.data import RLHFDataset

    long = _good_row(prompt=[{"role": "user", "content": "x " * 500}])
    ds = RLHFDataset(
        str(_write(tmp, [long])),
        _tokenizer(model),
        _data_cfg(filter_overlong_prompts=False, truncation="error"),
    )
    ds[0]


def _ds_no_chat_template(tmp, model):
    from rlhf_megatron.data import RLHFDataset

    tok = _tokenizer(model)
    tok.chat_template = None
    RLHFDataset(str(_write(tmp, [_good_row()])), tok, _data_cfg())


def _ds_no_files(tmp, model):
    from rlhf_megatron.data import RLHFDataset

    RLHFDataset([], _tokenizer(model), _data_cfg())


def _ds_not_on_disk(tmp, model):
    from rlhf_megatron.data import RLHFDataset

    RLHFDataset(str(tmp / "hiyouga" / "geometry3k") + "@train", _tokenizer(model), _data_cfg())


# ----- EasyR1's layout and images: a tiny Qwen2.5-VL processor (tests/data/vl_helpers.py, loaded by path)
def _vl_helpers():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "vl_helpers_for_reliability", Path(__file__).resolve().parents[1] / "data" / "vl_helpers.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mm_dataset(tmp, rows, limit_images=0, **cfg):
    """An EasyR1-layout dataset of ``rows`` through the tiny VL processor; returns its first item."""
    from rlhf_megatron.data import RLHFDataset
    from rlhf_megatron.data.multimodal import load_vision_processor

    vision = load_vision_processor(_vl_helpers().write_tiny_vl_model(tmp / "vl"))
    cfg = _data_cfg(prompt_key="problem", max_prompt_length=256, min_pixels=3136, max_pixels=12544, **cfg)
    ds = RLHFDataset(
        str(_write(tmp, rows)), vision.processor.tokenizer, cfg, vision, limit_images=limit_images
    )
    return ds[0]


def _image(size=56):
    return {"bytes": _vl_helpers().png(size, size), "path": None}


def _mm_undecodable_image(tmp, model):
    _mm_dataset(
        tmp, [{"problem": "<image>x?", "answer": "1", "images": [{"bytes": b"not a png", "path": None}]}]
    )


def _mm_more_images_than_placeholders(tmp, model):
    _mm_dataset(tmp, [{"problem": "<image>x?", "answer": "1", "images": [_image(), _image()]}])


def _mm_fewer_images_than_placeholders(tmp, model):
    _mm_dataset(tmp, [{"problem": "<image> and <image>?", "answer": "1", "images": [_image()]}])


def _mm_over_limit_images(tmp, model):
    _mm_dataset(
        tmp, [{"problem": "<image><image>?", "answer": "1", "images": [_image(), _image()]}], limit_images=1
    )


def _mm_missing_image_file(tmp, model):
    _mm_dataset(tmp, [{"problem": "<image>x?", "answer": "1", "images": ["pics/nope.png"]}])


def _mm_images_for_text_model(tmp, model):
    from rlhf_megatron.data import RLHFDataset

    rows = [{"problem": "<image>x?", "answer": "1", "images": [_image()]}]
    RLHFDataset(str(_write(tmp, rows)), _tokenizer(model), _data_cfg(prompt_key="problem"))


def _easyr1_text(tmp, model, template_text=None, template_name="fmt.jinja"):
    from rlhf_megatron.data import RLHFDataset

    template = tmp / template_name
    if template_text is not None:
        template.write_text(template_text)
    cfg = _data_cfg(prompt_key="problem", max_prompt_length=256, format_prompt=str(template))
    RLHFDataset(str(_write(tmp, [{"problem": "1+1?", "answer": "2"}])), _tokenizer(model), cfg)[0]


def _format_prompt_missing(tmp, model):
    _easyr1_text(tmp, model, template_name="nope.jinja")


def _format_prompt_bad_syntax(tmp, model):
    _easyr1_text(tmp, model, "first line\n{{ content ")


def _format_prompt_render_fails(tmp, model):
    _easyr1_text(tmp, model, "{{ content.split(1) }} Think step by step.")


DATASET_CASES = [
    ("empty_parquet", _ds_empty, ValueError, ["no rows"]),
    ("missing_file", _ds_missing_file, FileNotFoundError, ["nope.parquet", "does not exist"]),
    ("missing_column", _ds_missing_column, ValueError, ["missing column 'reward_model'"]),
    ("malformed_prompt", _ds_prompt_not_messages, ValueError, ["prompt"]),
    ("prompt_over_limit", _ds_prompt_too_long, ValueError, ["max_prompt_length"]),
    ("no_chat_template", _ds_no_chat_template, ValueError, ["chat template"]),
    ("no_files", _ds_no_files, ValueError, ["no parquet files"]),
    (
        "dataset_not_on_disk",
        _ds_not_on_disk,
        FileNotFoundError,
        ["data.train_files", "geometry3k@train", "does not exist", "no hub is contacted"],
    ),
    (
        "mm_undecodable_image",
        _mm_undecodable_image,
        ValueError,
        ["bad.parquet row 0", "'images'[0]", "not a readable image"],
    ),
    (
        "mm_more_images_than_placeholders",
        _mm_more_images_than_placeholders,
        ValueError,
        ["bad.parquet row 0", "2 image(s) in 'images' but 1 '<image>' placeholder"],
    ),
    (
        "mm_fewer_images_than_placeholders",
        _mm_fewer_images_than_placeholders,
        ValueError,
        ["bad.parquet row 0", "1 image(s) in 'images' but 2 '<image>' placeholder"],
    ),
    (
        "mm_more_images_than_limit_images",
        _mm_over_limit_images,
        ValueError,
        ["bad.parquet row 0", "2 images", "actor_rollout_ref.rollout.limit_images=1"],
    ),
    (
        "mm_image_file_missing",
        _mm_missing_image_file,
        ValueError,
        ["bad.parquet row 0", "pics/nope.png", "does not exist"],
    ),
    (
        "mm_images_for_a_text_model",
        _mm_images_for_text_model,
        ValueError,
        ["bad.parquet", "'images' (data.image_key)", "no image processor"],
    ),
    (
        "format_prompt_missing",
        _format_prompt_missing,
        FileNotFoundError,
        ["data.format_prompt", "nope.jinja", "does not exist"],
    ),
    (
        "format_prompt_bad_syntax",
        _format_prompt_bad_syntax,
        ValueError,
        ["data.format_prompt", "fmt.jinja line 2", "not a valid Jinja template"],
    ),
    (
        "format_prompt_does_not_render",
        _format_prompt_render_fails,
        ValueError,
        ["bad.parquet row 0", "rendering data.format_prompt", "fmt.jinja", "TypeError"],
    ),
]


# --------------------------------------------------------------------------- HF checkpoints
def _copy_model(tmp, model):
    dst = tmp / "model"
    shutil.copytree(model, dst)
    return dst


def _edit_config(path, **change):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(change)
    (path / "config.json").write_text(json.dumps(cfg))


def _hf_unsupported_arch(tmp, model):
    from rlhf_megatron.planning.model_arch import ModelArch

    m = _copy_model(tmp, model)
    _edit_config(m, architectures=["FalconForCausalLM"], model_type="falcon")
    ModelArch.from_hf_dir(m)


def _hf_missing_config(tmp, model):
    from rlhf_megatron.planning.model_arch import ModelArch

    m = _copy_model(tmp, model)
    (m / "config.json").unlink()
    ModelArch.from_hf_dir(m)


def _hf_missing_shard(tmp, model):
    from rlhf_megatron.models.hf_io import HFCheckpoint

    m = _copy_model(tmp, model)
    for f in m.glob("*.safetensors"):
        f.unlink()
    HFCheckpoint(m)


def _hf_tokenizer_larger_than_vocab(tmp, model):
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.trainer.run import check_tokenizer_fits_model

    tok = _tokenizer(model)
    arch = ModelArch.from_hf_dir(model)
    tok.add_tokens([f"<extra_{i}>" for i in range(arch.vocab_size - len(tok) + 5)])
    check_tokenizer_fits_model(tok, arch, model)


HF_CASES = [
    ("unsupported_architecture", _hf_unsupported_arch, Exception, ["FalconForCausalLM", "not supported"]),
    ("missing_config", _hf_missing_config, Exception, ["config.json"]),
    ("missing_weight_shard", _hf_missing_shard, Exception, ["safetensors"]),
    (
        "tokenizer_larger_than_model_vocab",
        _hf_tokenizer_larger_than_vocab,
        ValueError,
        ["tokens", "vocab_size"],
    ),
]


# --------------------------------------------------------------------------- checkpoints / output dirs
def _readonly_output_dir(tmp, model):
    from rlhf_megatron.trainer.checkpoint import CheckpointManager

    target = tmp / "file_not_dir"
    target.write_text("I am a file")
    CheckpointManager(target / "run").begin(1)


def _resume_from_non_checkpoint(tmp, model):
    from rlhf_megatron.trainer.checkpoint import CheckpointManager

    CheckpointManager(tmp).resolve("resume_path", str(tmp))


def _bad_marker(tmp, model):
    from rlhf_megatron.trainer.checkpoint import CheckpointManager

    (tmp / "latest_checkpointed_iteration.txt").write_text("banana")
    CheckpointManager(tmp).latest()


CKPT_CASES = [
    ("output_dir_unwritable", _readonly_output_dir, OSError, ["file_not_dir"]),
    ("resume_from_non_checkpoint", _resume_from_non_checkpoint, Exception, ["trainer_state.json"]),
    ("corrupt_marker", _bad_marker, Exception, ["banana"]),
]


@pytest.mark.parametrize(
    "fn, exc, words",
    [c[1:] for c in DATASET_CASES + HF_CASES + CKPT_CASES],
    ids=[c[0] for c in DATASET_CASES + HF_CASES + CKPT_CASES],
)
def test_input_refused(tiny_run_inputs, tmp_path, fn, exc, words):
    with pytest.raises(exc) as info:
        fn(tmp_path, tiny_run_inputs["model"])
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in: {message}"


# --------------------------------------------------------------------------- CLI arguments
CLI_CASES = [
    # (id, entry point, argv, words in stderr)
    ("convert_no_subcommand", "convert", [], ["usage"]),
    ("convert_missing_hf", "convert", ["hf-to-mcore", "--out", "{tmp}/o"], ["--hf"]),
    (
        "convert_hf_dir_missing",
        "convert",
        ["hf-to-mcore", "--hf", "{tmp}/none", "--out", "{tmp}/o"],
        ["none"],
    ),
    (
        "convert_bad_dtype",
        "convert",
        ["hf-to-mcore", "--hf", "{tmp}", "--out", "{tmp}/o", "--dtype", "int3"],
        ["--dtype"],
    ),
    (
        "convert_ckpt_not_checkpoint",
        "convert",
        ["mcore-to-hf", "--ckpt", "{tmp}", "--out", "{tmp}/o"],
        ["rlhf_megatron_ckpt.json"],
    ),
    (
        "convert_tp_not_int",
        "convert",
        ["hf-to-mcore", "--hf", "{tmp}", "--out", "{tmp}/o", "--tp", "two"],
        ["--tp"],
    ),
    ("launch_unknown_launcher", "launch", ["yarn"], ["unknown launcher 'yarn'"]),
    ("launch_no_args", "launch", [], ["launch"]),
    ("launch_local_missing_config", "launch", ["local", "--no-such-flag"], ["required", "--config"]),
    (
        "launch_local_bad_flag",
        "launch",
        ["local", "--config", "quickstart_cpu", "--num-cpus", "many"],
        ["--num-cpus"],
    ),
    ("train_bad_override", "train", ["--config", "quickstart_cpu", "trainer.totl_epochs=1"], ["totl_epochs"]),
    ("train_missing_preset", "train", ["--config", "no_such_preset"], ["no_such_preset"]),
]


@pytest.mark.parametrize("entry, argv, words", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_arguments_refused(tmp_path, capsys, entry, argv, words):
    from rlhf_megatron import train
    from rlhf_megatron.convert import main as convert_main
    from rlhf_megatron.launch import main as launch_main

    main = {"convert": convert_main, "launch": launch_main, "train": train.main}[entry]
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        status = main(argv)
    except SystemExit as e:  # argparse errors
        status = e.code
    except Exception as e:  # an entry point that raises instead of returning a status
        status, _ = 1, print(f"{type(e).__name__}: {e}", file=__import__("sys").stderr)
    captured = capsys.readouterr()
    assert status not in (0, None), captured
    text = captured.err + captured.out
    for word in words:
        assert word in text, f"{word!r} not in: {text[-2000:]}"
