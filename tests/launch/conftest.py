"""Fixtures for the launcher tests: a small valid run config and a way to call the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_megatron.launch import main as launch_main

HERE = Path(__file__).resolve().parent
# A small GRPO run whose batch sizes divide every world size the tests use (1-32 GPUs, or
# CPU processes). `model_arch` keeps validation from looking for a checkpoint.
RUN_CONFIG = HERE / "golden" / "run.yaml"


@pytest.fixture
def run_config() -> str:
    return str(RUN_CONFIG)


@pytest.fixture
def launch(capsys):
    """launch(argv) -> (exit status, stdout, stderr) of `rlhf-megatron launch ...`, in process."""

    def call(argv: list[str]) -> tuple[int, str, str]:
        try:
            rc = launch_main([str(a) for a in argv])
        except SystemExit as exc:  # argparse's own usage errors
            rc = exc.code
        out, err = capsys.readouterr()
        return rc, out, err

    return call
