"""Fixtures for the reliability tests: the trainer tests' tiny model and arith data."""

from reliability_helpers import tiny_run_inputs  # noqa: F401  (session fixture)
