"""The step-time tools' own logic: where ``tools/profile_step.py`` attributes a sampled stack, and
how ``tools/bench_step.py`` turns the trainer's step starts into seconds per step."""

import importlib.util
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _frames(*names: str) -> list[str]:
    return [f"{name} (some/file.py:1)" for name in names]


ROOT = ("<module>", "Worker.main_loop")


@pytest.mark.parametrize(
    "stack, phase",
    [
        # a colocated generation runs its batch's reference pass in its own call: that is the ref pass
        (
            (
                *ROOT,
                "ActorRolloutRefWorker.generate_sequences",
                "ActorRolloutRefWorker.compute_ref_log_prob",
                "MegatronEngine.run",
            ),
            "compute_ref_log_prob",
        ),
        (
            (
                *ROOT,
                "ActorRolloutRefWorker.generate_sequences",
                "VLLMEngine.generate_sequences",
                "LLM.generate",
            ),
            "generate_sequences",
        ),
        ((*ROOT, "ActorRolloutRefWorker.update_actor", "MegatronEngine.train_step"), "update_actor"),
        ((*ROOT, "Worker.poll"), "other"),
    ],
)
def test_worker_samples_go_to_the_innermost_phase(stack, phase):
    assert _load("profile_step")._phase(_frames(*stack), driver=False) == phase


def test_driver_samples_go_to_the_innermost_trainer_method():
    profile = _load("profile_step")
    stack = _frames(
        "<module>", "PPOTrainer.fit", "PPOTrainer.train_step", "PPOTrainer.score", "compute_score"
    )
    assert profile._phase(stack, driver=True) == "PPOTrainer.score"
    assert profile._phase(_frames("<module>", "main"), driver=True) == "other"


def test_seconds_per_step_are_gaps_between_step_starts():
    records = [{"timeline/step_start_s": t} for t in (1.0, 1.5, 2.25)] + [{"val/reward_mean": 0.5}]
    assert _load("bench_step").wall_steps(records) == [0.5, 0.75]
