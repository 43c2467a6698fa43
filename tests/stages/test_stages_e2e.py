"""The stages before RL through the real CLI: SFT and reward-model training on the Megatron engine
(2 gloo processes under Ray), their checkpoints resuming, exporting, and feeding an RL run.

All on the shared tiny random Llama and the arithmetic task: SFT transcripts from
``tools/data/arith_sft.py`` (chat ``messages``), preference pairs from ``tools/data/arith_prefs.py``;
and image SFT of a tiny random Qwen2.5-VL (``tools/data/shapes_vl.py --sft``), checked against
transformers.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from shared_artifacts import shared_artifact
from trainer_helpers import ONE_PROCESS, ROOT, run_train, train_overrides

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _stage(
    kind: str, overrides: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """``python -m rlhf_megatron.<kind> --config pipeline_cpu/<kind> ...``: the pipeline's shipped
    config with this test's paths and sizes. ``env`` may hold the pre-emption hook."""
    return run_train(f"pipeline_cpu/{kind}", overrides, env=env, module=f"rlhf_megatron.{kind}")


@pytest.fixture(scope="session")
def stage_data(tmp_path_factory):
    def build(root: Path) -> dict[str, str]:
        for tool, name in (("arith_sft.py", "sft"), ("arith_prefs.py", "prefs")):
            subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "tools/data" / tool),
                    "--output-dir",
                    str(root / name),
                    "--train-size",
                    "128",
                    "--test-size",
                    "16",
                    "--seed",
                    "0",
                ],
                check=True,
                capture_output=True,
            )
        return {"sft": str(root / "sft"), "prefs": str(root / "prefs")}

    return shared_artifact(tmp_path_factory, "stage_data", build)[1]


def _common(model: str, run_dir: Path, steps: int) -> list[str]:
    return [
        f"model.partial_pretrain={model}",
        "megatron.params_dtype=float32",
        "trainer.n_gpus_per_node=2",
        "trainer.device=cpu",
        "trainer.logger=['jsonl']",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={run_dir}",
        "optim.lr=1e-3",
        "data.max_length=32",
    ]


def _sft(inputs, data, run_dir: Path, steps: int) -> list[str]:
    return [
        *_common(inputs["model"], run_dir, steps),
        f"data.train_files={data['sft']}/train.parquet",
        f"data.val_files={data['sft']}/test.parquet",
        "data.multiturn.enable=true",
        "data.train_batch_size=16",
        "data.micro_batch_size_per_gpu=2",
        "trainer.save_freq=1",
    ]


@pytest.fixture(scope="session")
def sft_run(tiny_run_inputs, stage_data, tmp_path_factory):
    def build(root: Path) -> list[dict]:
        proc, records = _stage("sft", _sft(tiny_run_inputs, stage_data, root / "run", 3))
        assert proc.returncode == 0, proc.stderr[-4000:]
        return records

    root, records = shared_artifact(tmp_path_factory, "sft_run", build)
    return root / "run", records


def test_sft_trains_the_assistant_turns_and_logs_verls_names(sft_run):
    run_dir, records = sft_run
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert math.isfinite(r["train/loss"]) and r["train/lr"] > 0 and r["train/grad_norm"] > 0
        assert r["train/tokens"] > 0
    assert records[-1]["train/loss"] < records[0]["train/loss"], "the loss falls"
    assert "val/loss" in records[-1] and math.isfinite(records[-1]["val/loss"])
    ckpt = run_dir / "global_step_3" / "actor" / "model"
    assert (ckpt / "rlhf_megatron_ckpt.json").is_file(), "an actor checkpoint, as RL's"
    assert (run_dir / "metrics.png").is_file() and (run_dir / "resolved_config.yaml").is_file()


def test_sft_resumes_from_its_last_checkpoint_exactly(sft_run, tiny_run_inputs, stage_data, tmp_path):
    run_dir = tmp_path / "b"  # pre-empted after step 2 (its checkpoint is on disk), then restarted
    proc, first = _stage(
        "sft", _sft(tiny_run_inputs, stage_data, run_dir, 3), env={"RLHF_STOP_AFTER_STEP": "2"}
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in first] == [1, 2]
    proc, resumed = _stage("sft", _sft(tiny_run_inputs, stage_data, run_dir, 3))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in resumed] == [1, 2, 3], "the resumed run appends step 3"
    assert resumed[-1] == sft_run[1][-1]


def test_reward_model_then_rl_from_both_checkpoints(sft_run, tiny_run_inputs, stage_data, tmp_path):
    """RM training from the SFT checkpoint (exported to HF), its accuracy and margin on the
    validation pairs, then one PPO step (the pipeline's RL config) whose actor is the SFT model,
    whose reward model is the trained one (``reward_model.enable=true``) and whose critic starts
    from it too."""
    sft_dir, _ = sft_run
    sft_hf = tmp_path / "sft_hf"
    convert = [sys.executable, "-m", "rlhf_megatron.cli", "convert", "mcore-to-hf"]
    out = subprocess.run(
        [*convert, "--ckpt", str(sft_dir / "global_step_3/actor"), "--out", str(sft_hf)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rm_dir = tmp_path / "rm"
    proc, records = _stage(
        "rm",
        [
            *_common(str(sft_hf), rm_dir, 3),
            f"data.train_files={stage_data['prefs']}/train.parquet",
            f"data.val_files={stage_data['prefs']}/test.parquet",
            "data.train_batch_size=8",
            "data.micro_batch_size_per_gpu=2",
        ],
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in records] == [1, 2, 3]
    last = records[-1]
    assert 0.0 <= last["val/accuracy"] <= 1.0 and math.isfinite(last["val/margin"])
    assert all(0.0 <= r["train/accuracy"] <= 1.0 and math.isfinite(r["train/loss"]) for r in records)
    rm_hf = tmp_path / "rm_hf"
    out = subprocess.run(
        [*convert, "--ckpt", str(rm_dir / "global_step_3/reward_model"), "--out", str(rm_hf)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((rm_hf / "config.json").read_text())["architectures"] == [
        "LlamaForSequenceClassification"
    ]
    rl_dir = tmp_path / "rl"
    overrides = train_overrides(
        {**tiny_run_inputs, "model": str(sft_hf)},
        rl_dir,
        **{
            "trainer.total_training_steps": 1,
            "trainer.save_freq": -1,
            "reward_model.model.path": str(rm_hf),
            "reward_model.micro_batch_size_per_gpu": 8,
            "algorithm.adv_estimator": "gae",
            "critic.model.path": str(rm_hf),
            "critic.ppo_micro_batch_size_per_gpu": 8,
            **ONE_PROCESS,  # one process per role (actor, critic, reward model): what is checked is
            # which checkpoints they start from
        },
    )
    proc, rl = run_train("pipeline_cpu/ppo", overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in rl] == [1] and math.isfinite(rl[0]["reward/rm_score_mean"])
    assert math.isfinite(rl[0]["critic/vf_loss"]), "the critic, initialised from the reward model, trained"


def test_image_sft_trains_qwen2_5_vl_and_matches_transformers(tmp_path):
    """SFT of a tiny random Qwen2.5-VL on image transcripts (``tools/data/shapes_vl.py --sft``):
    two samples with their images packed in each row, one row a data-parallel rank. The first
    step's loss (the weights before any update) equals the masked cross-entropy transformers
    computes on the same rows from its own processor and model, so tokens, vision tokens, M-RoPE
    positions, the vision tower and the loss mask all agree; the second step's is lower."""
    import io

    import torch
    from PIL import Image
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from rlhf_megatron.data.sources import load_source
    from rlhf_megatron.models.tiny import make_tiny_qwen2_5_vl

    model = make_tiny_qwen2_5_vl(tmp_path / "model")
    data = tmp_path / "shapes"
    tool = [sys.executable, str(ROOT / "tools/data/shapes_vl.py"), "--output-dir", str(data), "--sft"]
    sizes = ["--train-size", "4", "--test-size", "2", "--size", "56", "--max-count", "4"]
    subprocess.run([*tool, *sizes], check=True, capture_output=True)
    run_dir = tmp_path / "run"
    proc, records = _stage(
        "sft",
        [
            *_common(str(model), run_dir, 2),
            f"data.train_files={data}@train",
            f"data.val_files={data}@test",
            "data.multiturn.enable=true",
            "data.max_length=192",  # a transcript is ~85 tokens: two share a packed row
            "data.min_pixels=3136",  # 56 x 56 pixels: 4 x 4 patches, 4 vision tokens
            "data.max_pixels=3136",
            "data.train_batch_size=4",
            "data.micro_batch_size_per_gpu=1",
            "data.shuffle=false",
        ],
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["train/loss"] < records[0]["train/loss"], "the loss falls"
    assert math.isfinite(records[-1]["val/loss"])

    processor = AutoProcessor.from_pretrained(model)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    nll, tokens = 0.0, 0
    for row in load_source(f"{data}@train")[0].table.to_pylist():
        image = Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")
        user, reply = row["messages"]
        question = user["content"].removeprefix("<image>")
        parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        prompt = processor.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
        n_prompt = len(processor(images=[image], text=[prompt])["input_ids"][0])
        full = processor.apply_chat_template([*parts, reply], tokenize=False)
        encoded = processor(images=[image], text=[full], return_tensors="pt")
        with torch.no_grad():
            logits = hf(**encoded).logits.float()[0]
        ids = encoded["input_ids"][0]
        log_probs = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        nll -= float(log_probs[n_prompt - 1 :].sum())  # the reply's tokens, after the assistant header
        tokens += len(ids) - n_prompt
    assert records[0]["train/tokens"] == tokens
    assert records[0]["train/loss"] == pytest.approx(nll / tokens, rel=1e-5)
