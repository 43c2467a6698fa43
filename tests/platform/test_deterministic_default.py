"""``platform.deterministic_default``: deterministic kernels on CPU, off on CUDA, ``RLHF_DETERMINISTIC`` wins."""

import pytest
import torch

from rlhf_megatron import platform


@pytest.mark.parametrize(
    ("env", "cuda", "expected"),
    [(None, False, True), (None, True, False), ("1", True, True), ("0", False, False), ("", True, False)],
)
def test_cpu_yes_cuda_no_unless_the_environment_says(monkeypatch, env, cuda, expected):
    if env is None:
        monkeypatch.delenv("RLHF_DETERMINISTIC", raising=False)
    else:
        monkeypatch.setenv("RLHF_DETERMINISTIC", env)
    monkeypatch.setattr(platform, "is_cuda", lambda: cuda)
    assert platform.deterministic_default() is expected


def test_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("RLHF_DETERMINISTIC", "yes")
    with pytest.raises(ValueError, match="RLHF_DETERMINISTIC='yes'"):
        platform.deterministic_default()


def test_set_seed_follows_it(monkeypatch):
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        monkeypatch.setenv("RLHF_DETERMINISTIC", "0")
        platform.set_seed(0)
        assert not torch.are_deterministic_algorithms_enabled()
        monkeypatch.delenv("RLHF_DETERMINISTIC")
        platform.set_seed(0)  # CPU here
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before, warn_only=True)
