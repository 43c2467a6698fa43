"""The multi-turn agent loop: assistant turns from the rollout engine, tool and user turns between.

``ToolAgentLoop.run`` takes each sample from its prompt to the end of its trajectory, turn by
turn, as verl's tool agent does:

1. every unfinished sample's next assistant turn is generated in one engine call (the engine
   batches them), from its prompt and everything appended so far, for the response budget left;
2. each turn's text is searched for tool calls (hermes: ``<tool_call>{json}</tool_call>``);
   the calls of all samples run concurrently (asyncio: while one sample's tool waits, the others'
   run), at most ``max_parallel_calls`` per turn;
3. the tool responses (or an interaction's user turn) are appended through the tokenizer's chat
   template; a sample ends when it answers without calling a tool (``stop``), runs out of
   ``response_length`` (``length``), reaches ``max_assistant_turns``/``max_user_turns``
   (``max_turns``), or cannot run its tools at all (``tool_error``).

Token in, token out: the assistant tokens are exactly the ids the engine sampled, with their
log-probs; only tool and user turns are tokenized from text, and they are masked out of the
policy loss (``response_mask`` 0, attention 1). Everything the model did wrong (bad JSON, an
unknown tool, bad arguments, a tool that raised, hung or answered 10 MB) becomes an error
message in that tool's response and a count in the metrics; the run goes on.

Several processes can hold one engine (vLLM tensor parallelism): the loop runs on the engine's
first rank (the leader), which alone runs tools, and every rank generates the same requests; the
leader sends the requests of each turn to the others with ``exchange`` (see ``run``).

Boundaries: knows the tokenizer, the tool protocol (``base.py``) and a ``generate`` callable;
nothing of vLLM, Megatron, Ray or the trainer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf_megatron.agent.base import BaseInteraction, BaseTool
from rlhf_megatron.agent.calls import describe_exception, parse_hermes, quote, run_tool_call
from rlhf_megatron.agent.schemas import OpenAIFunctionCallSchema, ToolResponse

__all__ = ["AGENT_NAMES", "END_REASONS", "ToolAgentLoop", "TurnRequest", "Trajectory", "render_turn_ids"]

logger = logging.getLogger(__name__)

AGENT_NAMES = ("tool_agent", "single_turn_agent")
"""verl's ``agent_name`` column: ``tool_agent`` (the default) runs tools and interactions turn by
turn; ``single_turn_agent`` rows end after their first assistant turn."""

END_REASONS = ("stop", "length", "max_turns", "tool_error")
"""Why a trajectory ended (``Trajectory.end``)."""

TurnRequest = tuple[list[int], int, "int | None"]
"""(token ids so far, most new tokens, seed) of one assistant turn."""
TurnOutput = tuple[list[int], list[float], str]
"""(sampled ids, their log-probs, vLLM's finish reason: ``stop`` or ``length``)."""


@dataclass
class Trajectory:
    """One sample's conversation after the prompt: what was appended, and how it went."""

    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    """The chat so far (the prompt's messages, then each turn as text): what interactions read."""
    tools_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    interaction_kwargs: dict[str, Any] | None = None
    seed: int | None = None
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    """1 on the ids the engine sampled (trained on), 0 on tool and user turns."""
    log_probs: list[float] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_seconds: float = 0.0
    reward: float = 0.0
    """Tools' step rewards and ``calc_reward``, and interactions' turn scores, summed."""
    end: str | None = None
    instances: dict[str, str] = field(default_factory=dict)
    """Tool name -> this trajectory's instance id (created lazily, on the first call)."""
    interaction: tuple[BaseInteraction, str] | None = None
    single_turn: bool = False
    """``agent_name: single_turn_agent``: the first assistant turn is the whole response."""

    def append(self, ids: Sequence[int], mask: int, log_probs: Sequence[float] | None = None) -> None:
        self.response_ids += list(ids)
        self.response_mask += [mask] * len(ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)


def render_turn_ids(tokenizer, messages: list[dict[str, Any]], after_eos: bool = True) -> list[int]:
    """Token ids that append ``messages`` (tool or user turns) to a conversation whose last
    assistant turn ended with the EOS token, up to the next assistant turn's header.

    The chat template renders a conversation; the ids of a system message alone are a prefix of
    the ids of the system message followed by ``messages``, and the difference is the turn. The
    template's separator after an EOS (e.g. Qwen's newline after ``<|im_end|>``) is not sampled
    by the engine, so it is added first."""
    system = [{"role": "system", "content": "S"}]
    base = tokenizer.apply_chat_template(system, tokenize=True, add_generation_prompt=False)
    full = tokenizer.apply_chat_template(system + messages, tokenize=True, add_generation_prompt=True)
    base, full = list(_ids(base)), list(_ids(full))
    if full[: len(base)] != base:
        raise ValueError(
            "the tokenizer's chat template does not render a conversation as its earlier turns plus the new "
            "ones; multi-turn rollouts need one that does (e.g. Qwen2.5's)"
        )
    turn = full[len(base) :]
    eos = tokenizer.eos_token_id
    if after_eos and eos is not None and eos in base:
        separator = base[len(base) - base[::-1].index(eos) :]  # what the template puts after an EOS
        turn = separator + turn
    return turn


def _ids(rendered) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True).
    return rendered["input_ids"] if isinstance(rendered, Mapping) else rendered


class ToolAgentLoop:
    """Runs trajectories to their end; one instance per rollout process."""

    def __init__(
        self,
        tokenizer,
        tools: Sequence[BaseTool],
        interactions: Mapping[str, BaseInteraction],
        response_length: int,
        *,
        max_assistant_turns: int | None = None,
        max_user_turns: int | None = None,
        max_parallel_calls: int = 1,
        max_tool_response_length: int = 256,
        tool_response_truncate_side: str = "middle",
        tool_timeout_s: float = 30.0,
    ):
        self.tokenizer = tokenizer
        self.tools = {tool.name: tool for tool in tools}
        self.interactions = dict(interactions)
        self.response_length = response_length
        self.max_assistant_turns, self.max_user_turns = max_assistant_turns, max_user_turns
        self.max_parallel_calls = max_parallel_calls
        self.max_chars, self.truncate_side = max_tool_response_length, str(tool_response_truncate_side)
        self.tool_timeout_s = tool_timeout_s
        # One event loop for the life of the process: tools may keep loop-bound objects
        # (semaphores, clients) between calls.
        self.loop = asyncio.new_event_loop()

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools in the chat template's ``tools=`` format (OpenAI function schemas)."""
        return [
            tool.get_openai_tool_schema().model_dump(exclude_unset=True, exclude_none=True)
            for tool in self.tools.values()
        ]

    # ------------------------------------------------------------------ the loop
    def run(
        self, trajectories: list[Trajectory], generate: Callable[[list[TurnRequest]], list[TurnOutput]]
    ) -> list[Trajectory]:
        """Take every trajectory to its end (this process is the engine's leader). ``generate`` runs
        one assistant turn for each request, in order (``rollout/multi_turn.py`` has the engine's
        other processes run the same requests)."""
        self.loop.run_until_complete(self.start_interactions(trajectories))
        try:
            turn = 0
            while active := [t for t in trajectories if t.end is None]:
                requests = [self._request(t, turn) for t in active]
                outputs = generate(requests)
                self.loop.run_until_complete(self._after_turn(active, outputs))
                turn += 1
        finally:
            self.loop.run_until_complete(self._finish(trajectories))
        return trajectories

    def _request(self, t: Trajectory, turn: int) -> TurnRequest:
        seed = None if t.seed is None else (t.seed + 7919 * turn) % 2**31
        return t.prompt_ids + t.response_ids, self.response_length - len(t.response_ids), seed

    async def _after_turn(self, active: list[Trajectory], outputs: list[TurnOutput]) -> None:
        """Append each sample's sampled turn; run the tools and interactions it asked for."""
        pending = []
        for t, (ids, log_probs, finish) in zip(active, outputs):
            t.append(ids, 1, log_probs)
            t.assistant_turns += 1
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            content, calls, errors = _parse_turn(text)
            t.messages.append(_assistant_message(content, calls))
            if finish == "length" or len(t.response_ids) >= self.response_length:
                t.end = "length"
            elif t.single_turn:
                t.end = "stop"
            elif not calls and not errors:
                if t.interaction is None:
                    t.end = "stop"
                else:
                    pending.append(self._interact(t))
            elif self._out_of_turns(t):
                t.end = "max_turns"
            else:
                pending.append(self._call_tools(t, calls, errors))
        await asyncio.gather(*pending)

    def _out_of_turns(self, t: Trajectory) -> bool:
        return bool(
            (self.max_assistant_turns and t.assistant_turns >= self.max_assistant_turns)
            or (self.max_user_turns and t.user_turns >= self.max_user_turns)
        )

    async def _call_tools(self, t: Trajectory, calls, parse_errors: list[str]) -> None:
        """Run a turn's tool calls (concurrently) and append their responses as one turn."""
        jobs = [self._call_tool(t, call) for call in calls[: self.max_parallel_calls]]
        texts = list(parse_errors) + list(await asyncio.gather(*jobs))  # "Error: ..." messages
        t.tool_calls += len(parse_errors)  # a malformed call is a call that failed
        t.tool_errors += len(parse_errors)
        if t.end is not None:  # a tool's instance could not be made
            return
        self._append_turn(t, [{"role": "tool", "content": text} for text in texts])

    async def _call_tool(self, t: Trajectory, parsed) -> str:
        """One call's response text; whatever the call holds or the tool does, an ``Error: ...``
        text (counted in ``tool_errors``) rather than an exception that would end the batch."""
        t.tool_calls += 1
        try:
            return await self._run_call(t, parsed)
        except Exception as exc:
            logger.warning(
                "tool call %s failed in the loop", quote(getattr(parsed, "name", "?")), exc_info=True
            )
            t.tool_errors += 1
            return f"Error: the tool call could not be run: {describe_exception(exc, 500)}"

    async def _run_call(self, t: Trajectory, parsed) -> str:
        call, bad_json = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(parsed)
        tool = self.tools.get(call.name)
        if tool is None:
            t.tool_errors += 1
            known = ", ".join(sorted(self.tools)) or "none"
            return f"Error: unknown tool {quote(call.name)}; available tools: {known}"
        if bad_json:
            t.tool_errors += 1
            return f"Error: the arguments of {call.name!r} are not a JSON object"
        kwargs = t.tools_kwargs.get(call.name) or {}
        if call.name not in t.instances:
            try:
                instance, _ = await _as_pair(
                    tool.create(**_create_kwargs(tool, kwargs.get("create_kwargs") or {}))
                )
            except Exception as exc:  # the sample cannot use this tool at all
                t.tool_errors += 1
                t.end = "tool_error"
                return f"Error: tool {call.name!r} could not start: {describe_exception(exc, 500)}"
            t.instances[call.name] = instance
        start = time.perf_counter()
        response, step_reward, _, status = await run_tool_call(
            tool,
            t.instances[call.name],
            call,
            kwargs.get("execute_kwargs") or {},
            self.tool_timeout_s,
            self.max_chars,
            self.truncate_side,
        )
        t.tool_seconds += time.perf_counter() - start
        t.tool_errors += status == "error"
        t.tool_timeouts += status == "timeout"
        t.reward += float(step_reward or 0.0)
        return response.text or ""

    async def _interact(self, t: Trajectory) -> None:
        """The interaction's user turn after an answer without tool calls (or the end)."""
        interaction, instance = t.interaction
        if self.max_user_turns and t.user_turns >= self.max_user_turns:
            t.end = "max_turns"
            return
        try:
            done, content, score, _ = await interaction.generate_response(
                instance, t.messages, **(t.interaction_kwargs or {})
            )
        except Exception:  # an interaction that chokes on the model's text ends this sample only
            logger.warning("interaction failed", exc_info=True)
            t.tool_errors += 1
            t.end = "tool_error"
            return
        t.reward += float(score or 0.0)
        if done:
            t.end = "stop"
            return
        self._append_turn(t, [{"role": "user", "content": content}])

    def _append_turn(self, t: Trajectory, messages: list[dict[str, Any]]) -> None:
        # Text from tools may carry what the model wrote: lone surrogates would stop the tokenizer.
        messages = [{**m, "content": _valid_utf8(m["content"])} for m in messages]
        try:
            ids = render_turn_ids(self.tokenizer, messages)
        except Exception:  # the template cannot render this turn: this sample ends, the batch goes on
            logger.warning("a tool or user turn could not be rendered", exc_info=True)
            t.tool_errors += 1
            t.end = "tool_error"
            return
        if len(t.response_ids) + len(ids) >= self.response_length:
            t.end = "length"  # no room for the turn and an answer after it
            return
        t.append(ids, 0)
        t.messages += messages
        t.user_turns += 1

    async def _finish(self, trajectories: list[Trajectory]) -> None:
        """Each trajectory's tools: ``calc_reward`` into its reward, then ``release``."""

        async def close(t: Trajectory) -> None:
            for name, instance in t.instances.items():
                kwargs = t.tools_kwargs.get(name) or {}
                try:
                    t.reward += float(
                        await self.tools[name].calc_reward(
                            instance, **(kwargs.get("calc_reward_kwargs") or {})
                        )
                    )
                except Exception:  # a tool's reward bug scores 0, it does not stop the run
                    t.tool_errors += 1
                try:
                    await self.tools[name].release(instance, **(kwargs.get("release_kwargs") or {}))
                except Exception:
                    t.tool_errors += 1
            if t.interaction is not None:
                interaction, _ = t.interaction
                try:
                    t.reward += float(await interaction.calculate_score())
                    await interaction.finalize_interaction()
                except Exception:
                    t.tool_errors += 1
            if t.end is None:
                t.end = "length"

        await asyncio.gather(*(close(t) for t in trajectories))

    async def start_interactions(self, trajectories: list[Trajectory]) -> None:
        """Open each trajectory's interaction (``interaction_kwargs.name``), if any."""
        for t in trajectories:
            if not t.interaction_kwargs:
                continue
            name = t.interaction_kwargs.get("name")
            interaction = self.interactions.get(name)
            if interaction is None:
                known = ", ".join(sorted(self.interactions)) or "none configured"
                raise ValueError(f"interaction_kwargs names interaction {name!r}; known: {known}")
            instance = await interaction.start_interaction(**t.interaction_kwargs)
            t.interaction = (interaction, instance)


def _create_kwargs(tool: BaseTool, create_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """How ``create`` gets a row's ``create_kwargs``, for tools of either verl convention: verl's
    agent loop passes ``create(create_kwargs={...})``, its older rollout passes ``create(**{...})``
    (verl's own gsm8k tool reads both). Each form goes to a tool whose signature takes it."""
    import inspect

    params = inspect.signature(tool.create).parameters
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    out = {k: v for k, v in create_kwargs.items() if k != "create_kwargs" and (open_kwargs or k in params)}
    if open_kwargs or "create_kwargs" in params:
        out["create_kwargs"] = dict(create_kwargs)
    return out


async def _as_pair(created) -> tuple[str, ToolResponse | None]:
    """verl's ``create`` returns (instance_id, ToolResponse); older tools return the id alone."""
    result = await created
    return (result[0], result[1]) if isinstance(result, tuple) else (result, None)


def _parse_turn(text: str) -> tuple[str, list, list[str]]:
    """``parse_hermes``, with a last guard: a turn it cannot read is one malformed call."""
    try:
        return parse_hermes(text)
    except Exception as exc:  # parse_hermes answers malformed calls itself; this is a bug's net
        logger.warning("parse_hermes raised", exc_info=True)
        return text, [], [f"Error: the tool calls in this turn could not be read ({type(exc).__name__})."]


def _valid_utf8(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def _assistant_message(content: str, calls) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
        ]
    return message
