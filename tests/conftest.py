"""Shared pytest setup: the `gpu` marker skips without CUDA; quiet, single-threaded torch."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (marked gpu); this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
