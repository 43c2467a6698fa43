"""Multi-turn agentic RL: the tool and interaction protocol, configs, and tool calls.

A verl tool or interaction runs here after changing only its imports::

    from verl.tools.base_tool import BaseTool            ->  from rlhf_megatron.agent import BaseTool
    from verl.tools.schemas import ToolResponse, ...     ->  from rlhf_megatron.agent import ToolResponse, ...
    from verl.interactions.base import BaseInteraction   ->  from rlhf_megatron.agent import BaseInteraction

Modules: ``schemas`` (OpenAI function schemas, ``ToolResponse``), ``base`` (``BaseTool``,
``BaseInteraction``), ``config`` (verl's tool / interaction YAML, ``tools_kwargs`` checks),
``calls`` (hermes parsing, ``run_tool_call``), ``tools`` (built-in tools). The agent loop that
drives the rollout engine turn by turn builds on these; the sandbox for model-written code is its
own module. Boundaries: no Megatron, Ray or vLLM imports.
"""

from rlhf_megatron.agent.base import BaseInteraction, BaseTool
from rlhf_megatron.agent.calls import (
    TRUNCATE_SIDES,
    CallStatus,
    parse_hermes,
    run_tool_call,
    truncate_text,
    unknown_tool_response,
    validate_arguments,
)
from rlhf_megatron.agent.config import (
    TOOLS_KWARGS_KEYS,
    check_tools_kwargs,
    import_class,
    initialize_interactions_from_config,
    initialize_tools_from_config,
    load_interactions,
    load_tools,
)
from rlhf_megatron.agent.errors import ToolConfigError, ToolError, ToolTimeout
from rlhf_megatron.agent.schemas import (
    OpenAIFunctionCallSchema,
    OpenAIFunctionParametersSchema,
    OpenAIFunctionParsedSchema,
    OpenAIFunctionPropertySchema,
    OpenAIFunctionSchema,
    OpenAIFunctionToolCall,
    OpenAIFunctionToolSchema,
    ToolResponse,
)

__all__ = [
    "TOOLS_KWARGS_KEYS",
    "TRUNCATE_SIDES",
    "BaseInteraction",
    "BaseTool",
    "CallStatus",
    "OpenAIFunctionCallSchema",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionParsedSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolCall",
    "OpenAIFunctionToolSchema",
    "ToolConfigError",
    "ToolError",
    "ToolResponse",
    "ToolTimeout",
    "check_tools_kwargs",
    "import_class",
    "initialize_interactions_from_config",
    "initialize_tools_from_config",
    "load_interactions",
    "load_tools",
    "parse_hermes",
    "run_tool_call",
    "truncate_text",
    "unknown_tool_response",
    "validate_arguments",
]
