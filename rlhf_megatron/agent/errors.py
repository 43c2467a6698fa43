"""Exceptions shared by the agent package.

``ToolConfigError`` is for people setting up a run (a bad tool or interaction config, a bad
``tools_kwargs`` row, a corpus that cannot be read): it is raised before any rollout starts and
names the file, entry and fix. ``ToolError`` is for the model: a tool raises it with a message the
model can act on, and ``run_tool_call`` returns that message as the tool's response instead of
failing the rollout.
"""

from __future__ import annotations

__all__ = ["ToolConfigError", "ToolError", "ToolTimeout"]


class ToolConfigError(ValueError):
    """A tool or interaction cannot be set up as configured; the message says what to change."""


class ToolError(Exception):
    """Raised by a tool to send ``str(error)`` back to the model as an ``Error: ...`` response."""


class ToolTimeout(ToolError):
    """Raised by a tool whose work ran out of time (e.g. sandboxed code past its wall or CPU limit):
    an ``Error: ...`` response counted as a timeout (``tool_calls/timeout_rate``), not an error."""
