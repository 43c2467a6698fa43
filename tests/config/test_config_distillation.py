"""``distillation.*`` (verl's keys): both teacher forms load, the cross-section rules name their keys."""

from __future__ import annotations

import pytest
from cfg_helpers import make_cfg
from omegaconf import OmegaConf

from rlhf_megatron.config import ConfigError

ON = ["distillation.enabled=true"]


def _errors(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        make_cfg(*ON, *overrides, validate=True)
    return err.value.errors


def test_the_single_teacher_form_loads_with_verl_defaults():
    run = OmegaConf.to_object(make_cfg(*ON, "distillation.teacher_model.model_path=/t", validate=True))
    ((name, teacher),) = run.distillation.teachers().items()
    assert (name, teacher.model_path, teacher.key) == ("teacher_model", "/t", None)
    loss = run.distillation.distillation_loss
    assert (loss.loss_mode, loss.topk, loss.use_task_rewards, loss.use_policy_gradient) == (
        "k3",
        128,
        True,
        True,
    )
    assert (loss.distillation_loss_coef, loss.loss_max_clamp, loss.log_prob_min_clamp) == (1.0, 10.0, -10.0)


def test_several_named_teachers_each_serve_their_key():
    run = OmegaConf.to_object(
        make_cfg(
            *ON,
            "distillation.teacher_models.math.model_path=/t/math",
            "distillation.teacher_models.math.key=gsm8k",
            "distillation.teacher_models.code.model_path=/t/code",
            "distillation.teacher_models.code.key=mbpp",
            "distillation.teacher_models.code.inference.max_num_seqs=8",
            validate=True,
        )
    )
    teachers = run.distillation.teachers()
    assert {n: (t.model_path, t.key) for n, t in teachers.items()} == {
        "math": ("/t/math", "gsm8k"),
        "code": ("/t/code", "mbpp"),
    }
    assert teachers["code"].inference.max_num_seqs == 8 and teachers["math"].inference.max_num_seqs == 256


def test_both_forms_at_once_are_refused():
    errors = _errors(
        "distillation.teacher_model.model_path=/t", "distillation.teacher_models.a.model_path=/a"
    )
    assert any("teacher_model.model_path and distillation.teacher_models are both set" in e for e in errors)


def test_a_replica_count_that_cannot_be_honoured_is_refused():
    make_cfg(*ON, "distillation.teacher_model.model_path=/t", "distillation.num_workers=8", validate=True)
    errors = _errors("distillation.teacher_model.model_path=/t", "distillation.num_workers=4")
    assert any("distillation.num_workers=4: the teacher replicas follow their placement" in e for e in errors)


def test_a_teacher_context_too_short_for_prompt_and_response_is_refused():
    errors = _errors(
        "distillation.teacher_model.model_path=/t",
        "data.max_prompt_length=16",
        "data.max_response_length=8",
        "distillation.teacher_model.inference.max_model_len=24",
    )
    assert any(
        "distillation.teacher_model.inference.max_model_len=24 cannot hold a prompt and a full response (24 tokens"
        in e
        and "at least 25" in e
        for e in errors
    ), errors


def test_a_missing_model_and_an_unknown_mode_are_refused_by_name():
    errors = _errors()
    assert any("distillation.teacher_model.model_path is required" in e for e in errors)
    with pytest.raises(
        ConfigError, match="distillation.distillation_loss.loss_mode='jsd' is not one of: k3, k1"
    ):
        make_cfg("distillation.distillation_loss.loss_mode=jsd")


def test_a_teacher_pool_needs_a_shape_its_tp_divides_and_frees_the_tp():
    pool = [
        "distillation.teacher_model.model_path=/t",
        "distillation.teacher_model.enable_resource_pool=true",
    ]
    errors = _errors(*pool, "distillation.teacher_model.inference.tensor_model_parallel_size=2")
    assert any(
        "distillation.teacher_model.n_gpus_per_node=0 must be >= 1 with enable_resource_pool=true" in e
        for e in errors
    )
    assert not any("differs from the rollout's" in e for e in errors)  # a pool has its own TP
    errors = _errors(
        *pool,
        "distillation.teacher_model.n_gpus_per_node=3",
        "distillation.teacher_model.nnodes=1",
        "distillation.teacher_model.inference.tensor_model_parallel_size=2",
    )
    assert any(
        "tensor_model_parallel_size=2 does not divide the teacher pool's 3 processes" in e for e in errors
    )
    make_cfg(
        *pool,
        "distillation.teacher_model.n_gpus_per_node=2",
        "distillation.teacher_model.nnodes=1",
        validate=True,
    )


def test_a_colocated_teacher_takes_the_rollouts_tp():
    errors = _errors(
        "distillation.teacher_model.model_path=/t",
        "distillation.teacher_model.inference.tensor_model_parallel_size=2",
    )
    assert any(
        "distillation.teacher_model.inference.tensor_model_parallel_size=2 differs from the rollout's 1" in e
        for e in errors
    )


def test_forward_kl_topk_needs_a_topk():
    errors = _errors(
        "distillation.teacher_model.model_path=/t",
        "distillation.distillation_loss.loss_mode=forward_kl_topk",
        "distillation.distillation_loss.topk=0",
    )
    assert any(
        "distillation.distillation_loss.topk=0 must be >= 1 with loss_mode=forward_kl_topk" in e
        for e in errors
    )


def test_disabled_distillation_checks_nothing():
    make_cfg("distillation.teacher_model.inference.max_model_len=2", validate=True)
