"""Built-in tools, each a ``BaseTool`` with a default OpenAI schema, loadable from a verl-format tool
config by class name (e.g. ``class_name: rlhf_megatron.agent.tools.CalculatorTool``).

``calculator`` (arithmetic without eval), ``calc_gsm8k_reward`` (verl's gsm8k answer tool),
``search`` (BM25 over a local corpus) and ``code_interpreter`` (Python in the local sandbox, verl's
sandbox_fusion tool). The search tool imports ``bm25s`` only when constructed.
"""

from rlhf_megatron.agent.tools.calculator import AnswerCheckTool, CalculatorTool
from rlhf_megatron.agent.tools.code_interpreter import CodeInterpreterTool
from rlhf_megatron.agent.tools.search import LocalSearchTool

__all__ = ["AnswerCheckTool", "CalculatorTool", "CodeInterpreterTool", "LocalSearchTool"]
