"""Teachers for on-policy distillation: a teacher of another tokenizer is refused before any engine
starts, naming both directories (the scoring itself runs end to end in
tests/trainer/test_distillation_e2e.py)."""

from __future__ import annotations

import pytest

from rlhf_megatron.config.schema_distill import DistillationConfig, TeacherModelConfig
from rlhf_megatron.models.tiny import make_tiny_hf_model
from rlhf_megatron.rollout.teacher import check_teacher_tokenizers

SMALL = dict(num_layers=1, hidden_size=64, num_heads=1, num_kv_heads=1, ffn_hidden_size=64)


def _distillation(**teachers: str) -> DistillationConfig:
    if list(teachers) == ["teacher_model"]:
        return DistillationConfig(
            enabled=True, teacher_model=TeacherModelConfig(model_path=teachers["teacher_model"])
        )
    models = {name: TeacherModelConfig(model_path=path, key=name) for name, path in teachers.items()}
    return DistillationConfig(enabled=True, teacher_models=models)


def test_a_teacher_with_the_students_tokenizer_is_accepted(tmp_path):
    student = make_tiny_hf_model(tmp_path / "student", **SMALL, seed=0)
    teacher = make_tiny_hf_model(tmp_path / "teacher", **SMALL, seed=1)  # other weights, same tokenizer
    check_teacher_tokenizers(str(student), _distillation(teacher_model=str(teacher)))


def test_a_teacher_with_another_vocabulary_is_refused_naming_both_paths(tmp_path):
    student = make_tiny_hf_model(tmp_path / "student", **SMALL)
    same = make_tiny_hf_model(tmp_path / "same", **SMALL, seed=1)
    other = make_tiny_hf_model(tmp_path / "other", **SMALL, extra_words=("distillation",))
    with pytest.raises(ValueError) as err:
        check_teacher_tokenizers(str(student), _distillation(math=str(same), code=str(other)))
    text = str(err.value)
    assert f"distillation.teacher_models.code.model_path={other}" in text
    assert f"actor_rollout_ref.model.path={student}" in text
    assert "the vocabularies differ" in text and "'distillation'" in text


def _rows(sources):
    import numpy as np
    import torch

    from rlhf_megatron.data.batch import Batch

    return Batch.from_dict(
        {"responses": torch.zeros(len(sources), 2)}, {"data_source": np.array(sources, dtype=object)}
    )


def test_each_teacher_scores_the_rows_of_its_key():
    from rlhf_megatron.rollout.teacher import rows_by_teacher

    teachers = _distillation(gsm8k="/m", mbpp="/c").teachers()
    batch = _rows(["gsm8k", "mbpp", "gsm8k", "mbpp", "mbpp"])
    assert rows_by_teacher(teachers, batch, "data_source") == {"gsm8k": [0, 2], "mbpp": [1, 3, 4]}
    one = _distillation(teacher_model="/t").teachers()
    assert rows_by_teacher(one, batch, "data_source") == {"teacher_model": [0, 1, 2, 3, 4]}
    with pytest.raises(
        ValueError, match="row 1 has data_source='math', which no teacher serves.*'gsm8k', 'mbpp'"
    ):
        rows_by_teacher(teachers, _rows(["gsm8k", "math"]), "data_source")
    with pytest.raises(ValueError, match="data.reward_fn_key='source'"):
        rows_by_teacher(teachers, batch, "source")
