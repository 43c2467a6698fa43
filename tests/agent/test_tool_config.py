"""verl-format tool and interaction configs: a verl tool ported by its imports loads and runs; every
bad config is refused with the file, the entry and the fix; tools_kwargs rows are checked."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import textwrap

import pytest

from rlhf_megatron.agent import (
    BaseTool,
    ToolConfigError,
    check_tools_kwargs,
    load_interactions,
    load_tools,
    parse_hermes,
    run_tool_call,
)
from rlhf_megatron.agent.tools import CalculatorTool

# verl's verl/tools/gsm8k_tool.py with the import lines pointed at this project. Beyond the imports,
# @rollout_trace_op (verl's tracing) is dropped and the scorer takes no ``method=`` (it has one).
VERL_GSM8K_TOOL = """
import logging
import os
from typing import Any, Optional
from uuid import uuid4

from rlhf_megatron.rewards import gsm8k
from rlhf_megatron.agent import BaseTool, OpenAIFunctionToolSchema, ToolResponse

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))


class Gsm8kTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(
        self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None, **kwargs
    ) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth", None)
        self._instance_dict[instance_id] = {
            "response": "",
            "ground_truth": ground_truth,
            "reward": 0.0,
        }
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)

        if answer.startswith("#### "):
            self._instance_dict[instance_id]["response"] = answer
        else:
            self._instance_dict[instance_id]["response"] = "#### " + answer

        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > self._instance_dict[instance_id]["reward"] else -0.05
        self._instance_dict[instance_id]["reward"] = reward

        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return gsm8k.compute_score(
            self._instance_dict[instance_id]["response"],
            self._instance_dict[instance_id]["ground_truth"],
            format_score=0.0,
            score=1.0,
        )

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
"""

# verl's verl/interactions/gsm8k_interaction.py, imports pointed here (the scorer as above).
VERL_GSM8K_INTERACTION = """
from typing import Any, Optional
from uuid import uuid4

from rlhf_megatron.rewards import gsm8k
from rlhf_megatron.agent import BaseInteraction


class Gsm8kInteraction(BaseInteraction):
    def __init__(self, config: dict):
        super().__init__(config)
        self._instance_dict = {}

    async def start_interaction(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None, **kwargs) -> str:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs) -> tuple[bool, str, float, dict]:
        content = ""
        for i in range(len(messages) - 1, -1, -1):
            item = messages[i]
            if item.get("role") == "assistant":
                content = item.get("content")
                break
        self._instance_dict[instance_id]["response"] = content
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, "Your response is correct!", reward, {}
        return False, "Your response is incorrect! You need to reflect on your answer and try again.", reward, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        return gsm8k.compute_score(
            self._instance_dict[instance_id]["response"],
            self._instance_dict[instance_id]["ground_truth"],
            format_score=0.0,
            score=1.0,
        )

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
"""

# verl's gsm8k_tool_config.yaml; {class_name} is filled in by each test.
GSM8K_TOOL_CONFIG = """
tools:
  - class_name: "{class_name}"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def _calculator_entry(name="calculator", extra=""):
    return f"""
  - class_name: rlhf_megatron.agent.tools.CalculatorTool
    config: {{type: native{extra}}}
    tool_schema:
      type: function
      function:
        name: {name}
        description: arithmetic
        parameters: {{type: object, properties: {{expression: {{type: string}}}}, required: [expression]}}
"""


def _run_gsm8k_tool(tool):
    async def scenario():
        instance_id, created = await tool.create(create_kwargs={"ground_truth": "72"})
        wrong = await tool.execute(instance_id, {"answer": "70"})
        right = await tool.execute(instance_id, {"answer": "72"})
        again = await tool.execute(instance_id, {"answer": "72"})
        final = await tool.calc_reward(instance_id)
        await tool.release(instance_id)
        return instance_id, created, wrong, right, again, final

    return asyncio.run(scenario())


@pytest.mark.parametrize("form", ["file", "dotted"])
def test_verl_gsm8k_tool_ported_by_imports_loads_and_runs(tmp_path, monkeypatch, form):
    module = _write(tmp_path / "my_verl_tools.py", VERL_GSM8K_TOOL)
    if form == "dotted":
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, "my_verl_tools", raising=False)
        class_name = "my_verl_tools.Gsm8kTool"
    else:
        class_name = f"{module}:Gsm8kTool"
    config = _write(tmp_path / "gsm8k_tool_config.yaml", GSM8K_TOOL_CONFIG.format(class_name=class_name))

    [tool] = load_tools(config)
    assert type(tool).__name__ == "Gsm8kTool" and isinstance(tool, BaseTool)
    assert tool.name == "calc_gsm8k_reward"
    assert tool.config == {"type": "native"}
    instance_id, created, wrong, right, again, final = _run_gsm8k_tool(tool)
    assert created.is_empty()
    assert (wrong[0].text, wrong[1]) == ("Current parsed answer='70' reward=0.0", -0.05)
    assert (right[0].text, right[1]) == ("Current parsed answer='72' reward=1.0", 0.0)
    assert again[1] == -0.05  # no improvement: verl's penalty
    assert final == 1.0
    assert instance_id not in tool._instance_dict  # released


def test_ported_tool_runs_from_a_model_turn(tmp_path):
    module = _write(tmp_path / "gsm8k_tool_mod.py", VERL_GSM8K_TOOL)
    config = _write(tmp_path / "tools.yaml", GSM8K_TOOL_CONFIG.format(class_name=f"{module}.Gsm8kTool"))
    [tool] = load_tools(config)
    turn = 'So the answer is 72.\n<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}</tool_call>'
    content, [call], errors = parse_hermes(turn)
    assert (content, errors, call.name) == ("So the answer is 72.", [], "calc_gsm8k_reward")

    async def scenario():
        instance_id, _ = await tool.create(ground_truth="72")
        return await run_tool_call(tool, instance_id, call, timeout_s=5, max_response_chars=256)

    response, reward, metrics, status = asyncio.run(scenario())
    assert (response.text, reward, status) == ("Current parsed answer='72' reward=1.0", 0.0, "ok")
    assert metrics["truncated"] is False


def test_builtin_tools_load_by_class_name_without_a_schema(tmp_path):
    config = _write(
        tmp_path / "tools.yaml",
        """
        tools:
          - class_name: rlhf_megatron.agent.tools.CalculatorTool
            config: {type: native}
          - class_name: rlhf_megatron.agent.tools.calculator.AnswerCheckTool
        """,
    )
    calculator, checker = load_tools(config)
    assert isinstance(calculator, CalculatorTool)
    assert [calculator.name, checker.name] == ["calculator", "calc_gsm8k_reward"]
    assert calculator.tool_schema.function.parameters.required == ["expression"]


def test_interpolations_resolve_like_verl(tmp_path, monkeypatch):
    monkeypatch.setenv("CALC_NAME", "calc_from_env")
    config = _write(tmp_path / "tools.yaml", "tools:" + _calculator_entry(name="${oc.env:CALC_NAME}"))
    [tool] = load_tools(config)
    assert tool.name == "calc_from_env"


def test_verl_gsm8k_interaction_loads_and_runs(tmp_path):
    module = _write(tmp_path / "my_interactions.py", VERL_GSM8K_INTERACTION)
    config = _write(
        tmp_path / "interaction.yaml",
        f"""
        interaction:
          - name: "judge"
            class_name: "{module}:Gsm8kInteraction"
            config: {{strict: true}}
          - class_name: "{module}:Gsm8kInteraction"
        """,
    )
    interactions = load_interactions(config)
    # Without a name, verl's rule: the class name minus "Interaction", lower-cased.
    assert sorted(interactions) == ["gsm8k", "judge"]
    judge = interactions["judge"]
    assert judge.name == "judge" and judge.config == {"strict": True, "name": "judge"}

    async def scenario():
        instance_id = await judge.start_interaction("r1", ground_truth="72")
        wrong = await judge.generate_response(instance_id, [{"role": "assistant", "content": "#### 70"}])
        right = await judge.generate_response(instance_id, [{"role": "assistant", "content": "#### 72"}])
        await judge.finalize_interaction(instance_id)
        return wrong, right

    wrong, right = asyncio.run(scenario())
    assert wrong[0] is False and wrong[2] == 0.0 and "incorrect" in wrong[1]
    assert right == (True, "Your response is correct!", 1.0, {})
    assert "r1" not in judge._instance_dict


def _error(tmp_path, text, loader=load_tools, name="tools.yaml"):
    path = _write(tmp_path / name, text)
    with pytest.raises(ToolConfigError) as info:
        loader(path)
    return str(info.value), str(path)


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ToolConfigError, match="does not exist; fix the path") as info:
        load_tools(missing)
    assert str(missing) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_yaml_that_is_not_a_mapping(tmp_path):
    message, path = _error(tmp_path, "- class_name: a.B\n")
    assert path in message and "must be a YAML mapping with a top-level 'tools' list" in message


def test_invalid_yaml(tmp_path):
    message, path = _error(tmp_path, "tools: [unclosed\n")
    assert path in message and "cannot be read as YAML" in message


def test_tools_missing_or_not_a_list(tmp_path):
    message, path = _error(tmp_path, "tool:\n  - class_name: a.B\n")
    assert (
        path in message and "no top-level 'tools' key (found: tool)" in message and "write tools:" in message
    )
    message, path = _error(tmp_path, "tools: {class_name: a.B}\n")
    assert path in message and "'tools' must be a list" in message


def test_entry_without_class_name(tmp_path):
    message, path = _error(
        tmp_path, "tools:" + _calculator_entry() + "  - config: {type: native}\n    tool_schema: null\n"
    )
    assert f"{path}: tools[1] (?)" in message
    assert "class_name is missing" in message and 'dotted import path ("package.module.Class")' in message


def test_class_that_cannot_be_imported(tmp_path):
    message, path = _error(
        tmp_path, "tools:\n  - class_name: no_such_pkg.tools.Tool\n    config: {type: native}\n"
    )
    assert f"{path}: tools[0] (no_such_pkg.tools.Tool)" in message
    assert "ModuleNotFoundError: No module named 'no_such_pkg'" in message
    assert "set class_name to" in message


def test_class_missing_from_its_module_and_broken_module(tmp_path):
    message, _ = _error(tmp_path, "tools:\n  - class_name: rlhf_megatron.agent.tools.calculator.Nope\n")
    assert "has no 'Nope'" in message and "CalculatorTool" in message  # lists what the module defines
    broken = _write(tmp_path / "broken_tool.py", "raise RuntimeError('tool module exploded')\n")
    message, _ = _error(tmp_path, f"tools:\n  - class_name: {broken}:Tool\n")
    assert "RuntimeError: tool module exploded" in message
    message, _ = _error(tmp_path, f"tools:\n  - class_name: {tmp_path}/absent.py:Tool\n")
    assert "absent.py does not exist" in message


def test_class_that_is_not_a_base_tool(tmp_path):
    message, path = _error(tmp_path, "tools:\n  - class_name: collections.OrderedDict\n")
    assert f"{path}: tools[0] (collections.OrderedDict)" in message
    assert "is not a subclass of BaseTool" in message
    assert "from rlhf_megatron.agent import BaseTool" in message


def test_schema_that_is_not_an_openai_function_schema(tmp_path):
    text = """
    tools:
      - class_name: rlhf_megatron.agent.tools.CalculatorTool
        config: {type: native}
        tool_schema:
          type: function
          function: {description: no name here, parameters: {type: object, properties: {x: {}}}}
    """
    message, path = _error(tmp_path, text)
    assert f"{path}: tools[0] (rlhf_megatron.agent.tools.CalculatorTool)" in message
    assert "tool_schema is not an OpenAI function schema" in message
    assert "function.name: Field required" in message
    assert "function.parameters.properties.x.type: Field required" in message
    assert "write {type: function, function: {name, description, parameters" in message


def test_duplicate_tool_names(tmp_path):
    message, path = _error(tmp_path, "tools:" + _calculator_entry() + _calculator_entry())
    assert f"{path}: tools[1] (calculator)" in message
    assert "already used by tools[0]" in message and "tool_schema.function.name" in message


def test_mcp_and_other_types_are_refused(tmp_path):
    message, path = _error(tmp_path, "tools:" + _calculator_entry().replace("native", "mcp"))
    assert f"{path}: tools[0] (calculator)" in message
    assert "MCP tools are not supported" in message and "config.type: native" in message
    message, _ = _error(tmp_path, "tools:" + _calculator_entry().replace("native", "http"))
    assert "config.type is 'http'" in message and "only supported type is native" in message


def test_constructor_failure_names_the_entry(tmp_path):
    text = f"""
    tools:
      - class_name: rlhf_megatron.agent.tools.LocalSearchTool
        config: {{type: native, corpus_path: {tmp_path}/missing.jsonl}}
    """
    message, path = _error(tmp_path, text)
    assert f"{path}: tools[0] (rlhf_megatron.agent.tools.LocalSearchTool)" in message
    assert "missing.jsonl (config.corpus_path) does not exist" in message


@pytest.fixture
def fake_verl(tmp_path, monkeypatch):
    """A stand-in ``verl`` package with verl's BaseTool location, as if verl were installed."""
    if importlib.util.find_spec("verl") is not None:
        pytest.skip("verl is installed; the stand-in would shadow it")
    root = tmp_path / "site"
    (root / "verl" / "tools").mkdir(parents=True)
    (root / "verl" / "__init__.py").write_text("")
    (root / "verl" / "tools" / "__init__.py").write_text("")
    (root / "verl" / "tools" / "base_tool.py").write_text(
        "class BaseTool:\n"
        "    def __init__(self, config, tool_schema):\n"
        "        self.config, self.tool_schema = config, tool_schema\n"
        "        self.name = tool_schema.function.name\n"
    )
    (root / "verl_user_tool.py").write_text(
        "from verl.tools.base_tool import BaseTool\n\nclass UserTool(BaseTool):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.") or n == "verl_user_tool"]:
        del sys.modules[name]


def test_subclass_of_verls_own_base_tool_is_accepted(tmp_path, fake_verl):
    config = _write(
        tmp_path / "tools.yaml",
        "tools:"
        + _calculator_entry().replace("rlhf_megatron.agent.tools.CalculatorTool", "verl_user_tool.UserTool"),
    )
    [tool] = load_tools(config)
    assert type(tool).__name__ == "UserTool" and tool.name == "calculator"


def test_interaction_config_errors(tmp_path):
    message, path = _error(tmp_path, "interactions: []\n", loader=load_interactions)
    assert path in message and "no top-level 'interaction' key" in message
    message, path = _error(tmp_path, "interaction:\n  - name: judge\n", loader=load_interactions)
    assert f"{path}: interaction[0] (judge)" in message and "class_name is missing" in message
    message, path = _error(
        tmp_path,
        "interaction:\n  - {name: judge, class_name: collections.OrderedDict}\n",
        loader=load_interactions,
    )
    assert (
        "is not a subclass of BaseInteraction" in message
        and "from rlhf_megatron.agent import BaseInteraction" in message
    )
    message, path = _error(
        tmp_path,
        "interaction:\n"
        "  - {name: judge, class_name: rlhf_megatron.agent.BaseInteraction}\n"
        "  - {name: judge, class_name: rlhf_megatron.agent.BaseInteraction}\n",
        loader=load_interactions,
    )
    assert f"{path}: interaction[1] (judge)" in message and "already used" in message


def test_check_tools_kwargs():
    names = ["calculator", "search"]
    check_tools_kwargs(None, names, "row 0")
    check_tools_kwargs(
        {"search": None, "calculator": {"create_kwargs": {"a": 1}, "release_kwargs": None}}, names, "row 1"
    )
    with pytest.raises(ToolConfigError) as info:
        check_tools_kwargs({"calc_gsm8k_reward": {"create_kwargs": {}}}, names, "train_files row 7")
    assert str(info.value).startswith("train_files row 7: tools_kwargs names tool 'calc_gsm8k_reward'")
    assert "configured tools: calculator, search" in str(info.value)
    with pytest.raises(
        ToolConfigError,
        match=r"row 3: tools_kwargs\['search'\] has key 'kwargs'; allowed keys: "
        r"create_kwargs, execute_kwargs, calc_reward_kwargs, release_kwargs",
    ):
        check_tools_kwargs({"search": {"kwargs": {}}}, names, "row 3")
    with pytest.raises(
        ToolConfigError, match=r"row 4: tools_kwargs\['search'\]\['create_kwargs'\] must be a mapping"
    ):
        check_tools_kwargs({"search": {"create_kwargs": [1]}}, names, "row 4")
    with pytest.raises(ToolConfigError, match=r"row 5: tools_kwargs must be a mapping"):
        check_tools_kwargs(["search"], names, "row 5")


def test_ported_tool_without_a_schema_anywhere(tmp_path):
    module = _write(tmp_path / "schema_less.py", VERL_GSM8K_TOOL)
    message, path = _error(
        tmp_path, f"tools:\n  - class_name: {module}:Gsm8kTool\n    config: {{type: native}}\n"
    )
    assert f"{path}: tools[0] ({module}:Gsm8kTool): constructing" in message
    assert "Gsm8kTool has no tool schema: give it a tool_schema in the tool config" in message
