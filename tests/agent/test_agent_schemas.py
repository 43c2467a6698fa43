"""The OpenAI function schemas and ToolResponse: verl's field names, round trips, decode errors."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from rlhf_megatron.agent import (
    BaseInteraction,
    BaseTool,
    OpenAIFunctionCallSchema,
    OpenAIFunctionParsedSchema,
    OpenAIFunctionToolCall,
    OpenAIFunctionToolSchema,
    ToolResponse,
)

# verl's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml, as a dict.
GSM8K_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc_gsm8k_reward",
        "description": "A tool for calculating the reward of gsm8k.",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The model's answer"}},
            "required": ["answer"],
        },
    },
}


def test_tool_schema_round_trips_as_verl_dumps_it():
    schema = OpenAIFunctionToolSchema.model_validate(GSM8K_SCHEMA)
    assert schema.function.name == "calc_gsm8k_reward"
    assert schema.function.parameters.properties["answer"].type == "string"
    assert schema.function.parameters.required == ["answer"]
    # verl's agent loop hands the chat template model_dump(exclude_unset=True, exclude_none=True).
    assert schema.model_dump(exclude_unset=True, exclude_none=True) == GSM8K_SCHEMA
    again = OpenAIFunctionToolSchema.model_validate_json(schema.model_dump_json())
    assert again == schema
    assert again.function.strict is False


def test_schema_defaults_and_verl_extras():
    minimal = OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "ping", "description": "no arguments"}}
    )
    assert minimal.function.parameters.properties == {}
    assert minimal.function.parameters.required == []
    # verl's search_tool_config.yaml writes ``item:`` (a typo) under an array property: ignored, as in verl.
    search = OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": "search",
                "description": "d",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "query_list": {"type": "array", "item": {"type": "string"}, "description": "q"}
                    },
                    "required": ["query_list"],
                },
            },
        }
    )
    assert search.function.parameters.properties["query_list"].type == "array"
    with pytest.raises(ValidationError, match="name"):
        OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {"description": "x"}})


def test_parsed_call_decodes_arguments():
    parsed = OpenAIFunctionParsedSchema(name="calculator", arguments=json.dumps({"expression": "1+2"}))
    call, has_error = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(parsed)
    assert (call.name, call.arguments, has_error) == ("calculator", {"expression": "1+2"}, False)


@pytest.mark.parametrize("arguments", ["{not json", "[1, 2]", '"text"', "3"])
def test_parsed_call_with_bad_arguments_is_flagged(arguments):
    parsed = OpenAIFunctionParsedSchema(name="calculator", arguments=arguments)
    call, has_error = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(parsed)
    assert has_error is True
    assert call.arguments == {}
    assert call.name == "calculator"


def test_tool_call_round_trip():
    call = OpenAIFunctionToolCall(
        id="call_0", function=OpenAIFunctionCallSchema(name="f", arguments={"a": 1})
    )
    dumped = call.model_dump()
    assert dumped == {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    assert OpenAIFunctionToolCall.model_validate(dumped) == call


def test_tool_response_predicates_and_media_lists():
    assert ToolResponse().is_empty()
    assert ToolResponse(text="").is_empty()
    assert ToolResponse(text="hi").is_text_only() is True
    assert ToolResponse(text="hi", image=["img"]).is_text_only() is False
    assert ToolResponse(image=["img"]).is_empty() is False
    assert ToolResponse().is_text_only() is False
    with pytest.raises(ValidationError, match=r"wrap a single image in a list"):
        ToolResponse(image="img")
    with pytest.raises(ValidationError, match=r"wrap a single video in a list"):
        ToolResponse(video=object())


def test_base_tool_takes_its_name_from_the_schema():
    tool = BaseTool({"type": "native"}, OpenAIFunctionToolSchema.model_validate(GSM8K_SCHEMA))
    assert tool.name == "calc_gsm8k_reward"
    assert tool.get_openai_tool_schema() is tool.tool_schema
    assert tool.config == {"type": "native"}
    with pytest.raises(ValueError, match="has no tool schema"):
        BaseTool({}, None)


def test_base_tool_defaults_follow_verl():
    import asyncio

    tool = BaseTool({}, OpenAIFunctionToolSchema.model_validate(GSM8K_SCHEMA))

    async def scenario():
        instance_id, first = await tool.create()
        same_id, _ = await tool.create("given")
        response, reward, metrics = await tool.execute(instance_id, {"answer": "1"})
        return instance_id, first, same_id, response, reward, metrics, await tool.calc_reward(instance_id)

    instance_id, first, same_id, response, reward, metrics, final = asyncio.run(scenario())
    assert isinstance(instance_id, str) and len(instance_id) == 36
    assert first.is_empty() and same_id == "given"
    assert (response.text, reward, metrics, final) == ("Updated the tool state.", 0.0, {}, 0.0)


def test_base_interaction_defaults():
    import asyncio

    interaction = BaseInteraction({"name": "judge"})
    assert interaction.name == "judge"
    assert BaseInteraction({}).name == "interaction_agent"

    async def scenario():
        instance_id = await interaction.start_interaction()
        reply = await interaction.generate_response(instance_id, [{"role": "assistant", "content": "x"}])
        return (
            instance_id,
            reply,
            await interaction.calculate_score(instance_id),
            await interaction.calculate_score(),
        )

    instance_id, reply, score, score_without_id = asyncio.run(scenario())
    assert isinstance(instance_id, str)
    should_terminate, content, turn_score, extra = reply
    assert should_terminate is False and isinstance(content, str) and extra == {}
    assert score == 0.0 and score_without_id == 0.0
