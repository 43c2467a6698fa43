"""The one exception type of the config package.

Role: every problem found while loading or validating a config (unknown key, wrong type,
broken interpolation, cross-field rule) becomes a line in one ``ConfigError``, so a user
fixes them all in one pass instead of one per run.

Boundaries: formatting only.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """Invalid configuration. ``errors`` holds one message per problem; each names the key(s)
    involved and says what to change."""

    def __init__(self, errors: str | Iterable[str]):
        self.errors: list[str] = [errors] if isinstance(errors, str) else list(errors)
        if len(self.errors) == 1:
            message = f"invalid config: {self.errors[0]}"
        else:
            lines = "\n".join(f"  - {e}" for e in self.errors)
            message = f"invalid config ({len(self.errors)} problems):\n{lines}"
        super().__init__(message)
