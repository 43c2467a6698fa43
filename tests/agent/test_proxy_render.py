"""``agent.proxy_render``: an agent's requests rendered token-exact where they continue a reply,
with the project's tiny tokenizer and its hermes chat template; the calls then merge or fork in
``agent.proxy_records`` as the module says."""

import json

import pytest

from rlhf_megatron.agent.loop import render_turn_ids
from rlhf_megatron.agent.proxy_protocol import SamplingDefaults, chat_completion, parse_chat_request
from rlhf_megatron.agent.proxy_records import CallRecord, assemble_samples
from rlhf_megatron.agent.proxy_render import PromptRenderer, ServedCall
from rlhf_megatron.agent.tools.calculator import CalculatorTool

TOOLS = [CalculatorTool.default_tool_schema]  # the built-in calculator, as a client sends it
FIRST = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "6*7?"}]
CALL_TEXT = 'Let me.<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


@pytest.fixture(scope="module")
def tok():
    from rlhf_megatron.data.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer()


def _serve(tok, messages, tools, served, text, eos=True):
    """One call as the endpoint serves it: render, 'sample' ``text``, build the reply."""
    prompt, how = PromptRenderer(tok).render(messages, tools, served)
    output = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
    request = parse_chat_request(
        json.dumps({"model": "p", "messages": messages, "tools": tools}), SamplingDefaults(1, 1, 64)
    )
    reply = chat_completion(request, text, prompt, output, "stop" if eos else "length")["choices"][0][
        "message"
    ]
    record = CallRecord(f"c{len(served)}", tuple(prompt), tuple(output), tuple([-1.0] * len(output)), 0)
    return prompt, how, reply, record, ServedCall.of(messages, tools, reply, prompt, output)


def _agent_echo(reply, arguments=None):
    """The reply as an agent sends it back: new call ids, arguments re-serialised its own way."""
    msg = {"role": "assistant", "content": reply["content"], "tool_calls": []}
    for call in reply.get("tool_calls", []):
        args = (
            arguments
            if arguments is not None
            else json.dumps(json.loads(call["function"]["arguments"]), separators=(",", ":"))
        )
        msg["tool_calls"].append(
            {
                "id": "agent-own-id",
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": args},
            }
        )
    return msg


def test_the_first_call_is_the_chat_template_and_a_continuation_is_its_tokens_plus_the_turn(tok):
    p1, how1, reply, r1, s1 = _serve(tok, FIRST, TOOLS, [], CALL_TEXT)
    assert how1 == "rendered"
    assert p1 == list(
        tok.apply_chat_template(FIRST, tools=TOOLS, tokenize=True, add_generation_prompt=True)["input_ids"]
    )
    assert reply["tool_calls"][0]["function"]["name"] == "calculator"
    tool_turn = {"role": "tool", "tool_call_id": "agent-own-id", "content": "42"}
    second = [*FIRST, _agent_echo(reply), tool_turn]
    p2, how2, _, r2, _ = _serve(tok, second, TOOLS, [s1], "It is 42.")
    assert how2 == "continued"
    assert p2 == [*r1.prompt_ids, *r1.output_ids, *render_turn_ids(tok, [tool_turn])]
    samples, counts = assemble_samples([r1, r2])
    assert counts["samples"] == 1 and counts["merged"] == 1
    assert tok.decode(samples[0].response_ids[len(r1.output_ids) :], skip_special_tokens=False).startswith(
        "<|user|><tool_response>42</tool_response>"
    )


def test_a_rewritten_reply_is_rendered_afresh_and_forks(tok):
    _, _, reply, r1, s1 = _serve(tok, FIRST, TOOLS, [], CALL_TEXT)
    edited = _agent_echo(reply)
    edited["content"] = "I will use the calculator."  # the agent summarised its own turn
    second = [*FIRST, edited, {"role": "tool", "tool_call_id": "x", "content": "42"}]
    _, how, _, r2, _ = _serve(tok, second, TOOLS, [s1], "42.")
    assert how == "rendered"
    assert assemble_samples([r1, r2])[1]["forked"] == 1


@pytest.mark.parametrize(
    "change",
    [
        lambda msgs, tools: (msgs, []),  # the tools changed
        lambda msgs, tools: (
            [*msgs[:3], {"role": "assistant", "content": "extra"}],
            tools,
        ),  # an assistant turn it made up
        lambda msgs, tools: (
            [{"role": "system", "content": "Other."}, *msgs[1:]],
            tools,
        ),  # an edited system prompt
    ],
)
def test_anything_but_tool_and_user_turns_after_the_same_reply_is_rendered(tok, change):
    _, _, reply, _, s1 = _serve(tok, FIRST, TOOLS, [], CALL_TEXT)
    msgs, tools = change([*FIRST, _agent_echo(reply), {"role": "user", "content": "and 7*8?"}], TOOLS)
    assert PromptRenderer(tok).render(msgs, tools, [s1])[1] == "rendered"


def test_a_cut_off_reply_is_closed_with_the_eos_before_the_next_turn(tok):
    p1, _, reply, r1, s1 = _serve(tok, FIRST, None, [], "Thinking about", eos=False)
    user = {"role": "user", "content": "go on"}
    p2, how, *_ = _serve(
        tok, [*FIRST, {"role": "assistant", "content": reply["content"]}, user], None, [s1], "ok"
    )
    assert how == "continued"
    assert p2 == [*p1, *r1.output_ids, tok.eos_token_id, *render_turn_ids(tok, [user])]


def test_the_latest_continued_call_is_chosen(tok):
    _, _, reply1, r1, s1 = _serve(tok, FIRST, None, [], "A")
    second = [
        *FIRST,
        {"role": "assistant", "content": reply1["content"]},
        {"role": "user", "content": "more"},
    ]
    _, _, reply2, r2, s2 = _serve(tok, second, None, [s1], "B")
    third = [
        *second,
        {"role": "assistant", "content": reply2["content"]},
        {"role": "user", "content": "more"},
    ]
    p3, how, *_ = _serve(tok, third, None, [s1, s2], "C")
    assert how == "continued" and p3[: len(r2.prompt_ids) + len(r2.output_ids)] == [
        *r2.prompt_ids,
        *r2.output_ids,
    ]
