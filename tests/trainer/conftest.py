"""Fixtures for the trainer tests (defined in trainer_helpers)."""

from trainer_helpers import tiny_run_inputs  # noqa: F401  (session fixture)
