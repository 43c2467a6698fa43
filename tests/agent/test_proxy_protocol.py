"""``agent.proxy_protocol`` through the real ``openai`` SDK: its requests are accepted, our replies
parse as its types (content, tool calls, streaming, token ids), and every malformed request is an
OpenAI-style error the SDK raises as ``BadRequestError`` with our message.

The SDK talks to the protocol functions through httpx's in-process transport: the wire format is
tested here; the endpoint's server and engine are not part of this module.
"""

import json

import httpx
import openai
import pytest

from rlhf_megatron.agent.proxy_protocol import (
    ChatRequest,
    OpenAIError,
    SamplingDefaults,
    chat_completion,
    models_list,
    parse_chat_request,
    stream_chunks,
)
from rlhf_megatron.agent.tools.calculator import CalculatorTool

DEFAULTS = SamplingDefaults(temperature=1.0, top_p=1.0, max_tokens=64)
TOOLS = [CalculatorTool.default_tool_schema]  # the built-in calculator, as a client sends it


def client_for(reply_text: str, seen: list):
    """An SDK client whose requests reach ``parse_chat_request`` and get the reply built from
    ``reply_text`` (as if the engine had sampled it), or the request's error."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json=models_list("policy"))
        parsed = parse_chat_request(request.content, DEFAULTS, budget_left=32)
        seen.append(parsed)
        if isinstance(parsed, OpenAIError):
            return httpx.Response(parsed.status, json=parsed.body())
        prompt, output = [1, 2, 3], [7, 8, 9, 10]
        if parsed.stream:
            body = "".join(stream_chunks(parsed, reply_text, prompt, output, "stop"))
            return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=chat_completion(parsed, reply_text, prompt, output, "stop"))

    return openai.OpenAI(
        base_url="http://policy.local/v1",
        api_key="episode-1",
        http_client=httpx.Client(transport=httpx.MockTransport(handle)),
        max_retries=0,
    )


def test_a_plain_reply_with_token_ids_and_sampling_overridden():
    seen = []
    client = client_for("The answer is 42.", seen)
    out = client.chat.completions.create(
        model="policy",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6*7?"}],
        temperature=0.2,
        max_tokens=500,
    )
    assert out.choices[0].message.content == "The answer is 42." and out.choices[0].finish_reason == "stop"
    assert out.model_extra["prompt_token_ids"] == [1, 2, 3]
    assert out.choices[0].model_extra["token_ids"] == [7, 8, 9, 10]
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 4
    (req,) = seen
    assert isinstance(req, ChatRequest)
    assert (req.temperature, req.max_tokens) == (1.0, 32)  # the trainer's, capped by the episode's budget
    assert req.overridden == {"temperature": 0.2, "max_tokens": 500}
    assert [m.id for m in client.models.list().data] == ["policy"]


def test_tool_calls_come_back_as_openai_tool_calls():
    text = (
        'Let me compute.\n<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    )
    client = client_for(text, [])
    out = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "6*7?"}], tools=TOOLS
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me compute."
    (tc,) = choice.message.tool_calls
    assert tc.type == "function" and tc.function.name == "calculator" and tc.id.startswith("call_")
    assert json.loads(tc.function.arguments) == {"expression": "6*7"}
    # The agent sends the call and the tool's answer back; the request is accepted as it is.
    seen = []
    client_for("42", seen).chat.completions.create(
        model="policy",
        messages=[
            {"role": "user", "content": "6*7?"},
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tc.id, "content": "42"},
        ],
        tools=TOOLS,
    )
    assert isinstance(seen[0], ChatRequest) and seen[0].messages[1]["tool_calls"][0]["id"] == tc.id


def test_without_tools_a_tool_call_block_is_plain_content():
    text = '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>'
    out = client_for(text, []).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "x"}]
    )
    assert out.choices[0].message.content == text and out.choices[0].message.tool_calls is None


def test_a_malformed_tool_call_is_left_out_and_the_reply_stops():
    text = 'Hmm <tool_call>{"name": "calculator", "arguments": </tool_call>'
    out = client_for(text, []).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "x"}], tools=TOOLS
    )
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"
    assert "<tool_call>" not in out.choices[0].message.content


def test_streaming_gives_the_same_reply_in_chunks():
    text = 'Sure.<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    stream = client_for(text, []).chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "1+1?"}],
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == "Sure." and finish == ["tool_calls"]
    assert len(calls) == 1 and calls[0].function.name == "calculator"
    assert chunks[-1].usage.completion_tokens == 4


BAD_REQUESTS = [
    (b"{not json", "the request body is not valid JSON", None),
    (b"[" * 5000, "nested too deeply", None),
    (
        b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "seed": ' + b"9" * 5000 + b"}",
        "cannot be read",
        None,
    ),
    (json.dumps(["a list"]).encode(), "must be a JSON object", None),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "model is required", "model"),
    (
        json.dumps({"model": "policy", "messages": []}).encode(),
        "messages must be a non-empty list",
        "messages",
    ),
    (
        json.dumps({"model": "policy", "messages": [{"content": "x"}]}).encode(),
        "messages[0].role must be one of",
        "messages[0].role",
    ),
    (
        json.dumps({"model": "policy", "messages": ["hi"]}).encode(),
        "messages[0] must be an object",
        "messages[0]",
    ),
    (
        json.dumps(
            {"model": "policy", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
        ).encode(),
        "must be a text part",
        "messages[0].content",
    ),
    (
        json.dumps({"model": "policy", "messages": [{"role": "user", "content": 5}]}).encode(),
        "content must be a string",
        "messages[0].content",
    ),
    (
        json.dumps(
            {"model": "policy", "messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}
        ).encode(),
        "tool_calls must be a list on an assistant message",
        "messages[0].tool_calls",
    ),
    (
        json.dumps(
            {
                "model": "policy",
                "messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}],
            }
        ).encode(),
        "tool_calls[0] must be",
        "messages[0].tool_calls",
    ),
    (
        json.dumps({"model": "policy", "messages": [{"role": "user", "content": "x"}], "n": 4}).encode(),
        "n must be 1",
        "n",
    ),
    (
        json.dumps(
            {"model": "policy", "messages": [{"role": "user", "content": "x"}], "temperature": 9}
        ).encode(),
        "temperature must be a number from 0 to 2",
        "temperature",
    ),
    (
        json.dumps(
            {"model": "policy", "messages": [{"role": "user", "content": "x"}], "top_p": "high"}
        ).encode(),
        "top_p must be a number",
        "top_p",
    ),
    (
        json.dumps(
            {"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}
        ).encode(),
        "max_tokens must be a positive integer",
        "max_tokens",
    ),
    (
        json.dumps(
            {"model": "policy", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}
        ).encode(),
        "stop must be",
        "stop",
    ),
    (
        json.dumps(
            {"model": "policy", "messages": [{"role": "user", "content": "x"}], "tools": {"x": 1}}
        ).encode(),
        "tools must be a list",
        "tools",
    ),
    (
        json.dumps(
            {
                "model": "policy",
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": ""}}],
            }
        ).encode(),
        "tools[0].function.name must be",
        "tools[0].function.name",
    ),
    (
        json.dumps(
            {"model": "policy", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}
        ).encode(),
        "stream must be true or false",
        "stream",
    ),
    ("\ud800".encode("utf-8", "surrogatepass"), "not valid JSON", None),
]


@pytest.mark.parametrize(("body", "message", "param"), BAD_REQUESTS)
def test_every_malformed_request_is_an_openai_error_never_an_exception(body, message, param):
    err = parse_chat_request(body, DEFAULTS)
    assert isinstance(err, OpenAIError) and err.status == 400, err
    assert message in err.message and err.param == param
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_the_sdk_raises_our_errors_with_their_message():
    client = client_for("unused", [])
    with pytest.raises(openai.BadRequestError, match="n must be 1 here"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], n=2)


def test_a_spent_budget_and_an_oversized_body_are_errors():
    err = parse_chat_request(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}), DEFAULTS, 0
    )
    assert isinstance(err, OpenAIError) and err.code == "context_length_exceeded"
    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * (9 << 20) + b'"}]}'
    err = parse_chat_request(big, DEFAULTS)
    assert isinstance(err, OpenAIError) and err.status == 413
