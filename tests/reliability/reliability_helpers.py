"""The trainer tests' tiny model/data fixture and CLI runner, loaded under a unique module name
(``from conftest import ...`` is ambiguous when several test directories run together)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "trainer_conftest_for_reliability", Path(__file__).resolve().parents[1] / "trainer" / "trainer_helpers.py"
)
_trainer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_trainer)

tiny_run_inputs = _trainer.tiny_run_inputs  # session fixture: tiny Llama + arith parquet
run_train = _trainer.run_train
train_overrides = _trainer.train_overrides
ROOT = _trainer.ROOT
