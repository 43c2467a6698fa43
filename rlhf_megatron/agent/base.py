"""The plugin protocol for tools and interactions, in verl's shape.

A tool (``BaseTool``) lives for the whole run and serves many trajectories at once: ``create``
opens per-trajectory state under an instance id, ``execute`` runs one call, ``calc_reward``
scores the state, ``release`` drops it. An interaction (``BaseInteraction``) plays the user in a
multi-turn rollout. A verl subclass runs here unchanged once its imports point at
``rlhf_megatron.agent``.

Boundaries: no tokenizer, no rollout engine. The agent loop calls tools through
``calls.run_tool_call``, which adds the timeout, argument checks and error messages, so a tool
only implements what it does.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar
from uuid import uuid4

from rlhf_megatron.agent.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["BaseInteraction", "BaseTool"]

logger = logging.getLogger(__name__)


class BaseTool:
    """A tool the model can call. Subclasses override ``execute`` and, when they keep per-trajectory
    state, ``create`` / ``calc_reward`` / ``release``.

    ``tool_schema`` comes from the tool config; without one, ``get_openai_tool_schema()`` must
    supply it (built-in tools set ``default_tool_schema``). ``execute`` runs on the rollout's event
    loop: blocking work (a subprocess, a big search) belongs in ``asyncio.to_thread``, or the
    timeout in ``run_tool_call`` cannot fire.
    """

    #: The OpenAI tool schema used when the config gives none (a dict, validated on use).
    default_tool_schema: ClassVar[dict[str, Any] | None] = None

    def __init__(self, config: dict | None, tool_schema: OpenAIFunctionToolSchema | None = None):
        self.config = dict(config or {})
        # Set first: verl subclasses override get_openai_tool_schema() as ``return self.tool_schema``.
        self.tool_schema = tool_schema
        if self.tool_schema is None:
            self.tool_schema = self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(
                f"{type(self).__name__} has no tool schema: give it a tool_schema in the tool config "
                "(type: function, function: {name, description, parameters})."
            )
        self.name: str = self.tool_schema.function.name
        logger.debug("tool %s: %s", self.name, self.tool_schema.model_dump(exclude_none=True))

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        """The schema shown to the model: the configured one, else ``default_tool_schema``."""
        schema = getattr(self, "tool_schema", None)
        if schema is None and self.default_tool_schema is not None:
            schema = OpenAIFunctionToolSchema.model_validate(self.default_tool_schema)
        return schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Open the state of one trajectory; returns its instance id and an optional first response."""
        return (instance_id if instance_id is not None else str(uuid4())), ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        """Run one call; returns the response, a step reward and metrics."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """Score the trajectory's tool state (e.g. the last submitted answer)."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Drop the trajectory's state."""


class BaseInteraction:
    """A simulated user: after an assistant turn without tool calls it answers, scores the turn
    and decides whether the rollout ends. ``config["name"]`` is the name rows select it by
    (``extra_info.interaction_kwargs.name``)."""

    def __init__(self, config: dict[str, Any] | None):
        self.config = dict(config or {})
        self.name: str = self.config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Open the state of one trajectory; returns its instance id."""
        return instance_id if instance_id is not None else str(uuid4())

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """Answer the conversation so far: ``(should_terminate, content, turn_score, extra)``."""
        return False, "Your current result seems acceptable.", 0.0, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs: Any) -> float:
        """Score the trajectory (verl's base takes no instance id, its subclasses do: both work)."""
        return 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs: Any) -> None:
        """Drop the trajectory's state."""
