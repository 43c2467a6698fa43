"""Fixtures for the config tests."""

from pathlib import Path

import pytest
from cfg_helpers import write_hf_config


@pytest.fixture
def hf_model_dir(tmp_path: Path) -> Path:
    """A model directory holding only an HF config.json (Qwen2.5-3B numbers)."""
    return write_hf_config(tmp_path / "model")
