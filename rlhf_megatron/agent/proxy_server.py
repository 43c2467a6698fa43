"""The policy's OpenAI-compatible endpoint: agent programs call it, the rollout engine answers, every
call is recorded token for token.

Three parts, each in its own thread of the rollout process:

- ``GenerationQueue`` hands turns from the endpoint to the engine. The engine's thread (the one
  that owns vLLM) runs ``GenerationQueue.serve``: it takes every turn waiting (after a short
  gather window, so concurrent episodes share an engine call), generates them in one
  ``generate_turn`` call and answers each with its output and the weight version that sampled it.
- ``ProxyEndpoint`` serves one rollout's episodes. ``open_episode`` gives each its API key (the
  key names the episode; any other key gets 401) and response budget; a chat completion is checked
  (``proxy_protocol``), rendered token-exact where it continues an earlier reply
  (``proxy_render``), generated through the queue and recorded as a ``CallRecord``;
  ``close_episode`` returns the episode with its calls for ``proxy_records.assemble_samples``.
- ``ProxyServer`` serves ``/v1/chat/completions`` (plain and streaming) and ``/v1/models`` over
  HTTP (Starlette on uvicorn, in a thread with its own event loop), bound to loopback unless told
  otherwise.

Whatever an agent sends (a bad key, a body that is not JSON, a conversation the chat template
cannot render or that does not fit the context, a request while the engine fails), the answer
is an OpenAI-style error body the ``openai`` SDK raises as its own exception, never an exception
in the rollout.

Boundaries: the tokenizer and a ``generate_turn`` callable (``agent/loop.py``'s ``TurnRequest`` in,
``TurnOutput`` out); nothing of vLLM, Megatron, Ray or the trainer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlhf_megatron.agent.loop import TurnOutput, TurnRequest
from rlhf_megatron.agent.proxy_protocol import (
    MAX_BODY_BYTES,
    OpenAIError,
    SamplingDefaults,
    chat_completion,
    models_list,
    parse_chat_request,
    stream_chunks,
)
from rlhf_megatron.agent.proxy_records import CallRecord
from rlhf_megatron.agent.proxy_render import PromptRenderer, ServedCall

__all__ = ["Episode", "GenerationQueue", "ProxyEndpoint", "ProxyServer"]


class GenerationQueue:
    """Turns waiting for the engine, handed between the endpoint's event loop and the engine's thread."""

    def __init__(self, gather_s: float = 0.02, max_batch: int = 256, max_wait_s: float = 1.0):
        self.gather_s = gather_s
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.expected: Callable[[], int] | None = None
        """How many turns could be waiting at most (the episodes running); once that many are,
        the batch goes at once (``ProxyEndpoint`` sets it)."""
        self._cond = threading.Condition()
        self._waiting: list[tuple[TurnRequest, concurrent.futures.Future]] = []
        self._closed = False

    async def generate(self, request: TurnRequest) -> tuple[TurnOutput, int]:
        """``(output, weight version)`` of one turn, once the engine's thread has generated it."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the rollout's engine has stopped serving")
            self._waiting.append((request, future))
            self._cond.notify_all()
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """Ends ``serve``; turns still waiting fail."""
        with self._cond:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            self._cond.notify_all()
        for _, future in waiting:
            future.set_exception(RuntimeError("the rollout's engine stopped serving before this turn"))

    def _take(self, poll_s: float) -> list[tuple[TurnRequest, concurrent.futures.Future]]:
        with self._cond:
            if not self._waiting:
                self._cond.wait(poll_s)
            if self._waiting and not self._closed:
                # The turns of episodes answered together come back one by one (each agent's
                # own code runs between): wait while they keep arriving, a pause of gather_s at
                # most between two, until every running episode waits (nothing more can come)
                # or max_wait_s has passed.
                start = time.monotonic()
                while len(self._waiting) < self.max_batch and not self._closed:
                    if self.expected is not None and len(self._waiting) >= self.expected():
                        break
                    before = len(self._waiting)
                    left = min(self.gather_s, start + self.max_wait_s - time.monotonic())
                    if left <= 0:
                        break
                    self._cond.wait(left)
                    if len(self._waiting) == before:  # a quiet gap: the wave is in
                        break
            batch, self._waiting = self._waiting[: self.max_batch], self._waiting[self.max_batch :]
            return batch

    def serve(
        self,
        generate_turn: Callable[[list[TurnRequest]], list[TurnOutput]],
        version: Callable[[], int],
        until: Callable[[], bool],
        poll_s: float = 0.05,
    ) -> int:
        """Generate waiting turns in this thread (the engine's) until ``until()`` or ``close``;
        returns the engine calls made. An engine call that raises fails its turns, not the loop."""
        calls = 0
        while not until():
            with self._cond:
                if self._closed:
                    break
            # A turn whose agent gave up waiting (its episode timed out) is not generated.
            batch = [
                (turn, future) for turn, future in self._take(poll_s) if future.set_running_or_notify_cancel()
            ]
            if not batch:
                continue
            calls += 1
            try:
                outputs = generate_turn([request for request, _ in batch])
                if len(outputs) != len(batch):
                    raise RuntimeError(f"the engine answered {len(outputs)} of {len(batch)} turns")
            except Exception as exc:  # noqa: BLE001 - each waiting agent gets the error as a 500
                for _, future in batch:
                    future.set_exception(exc)
                continue
            stamp = version()
            for (_, future), output in zip(batch, outputs):
                future.set_result((output, stamp))
        return calls


@dataclass
class Episode:
    """One agent run: its key, what it has left and what it did."""

    key: str
    row: int
    """The dataset row (or any index the caller gives)."""
    budget_left: int
    """Response tokens the episode may still sample (``data.max_response_length`` in all)."""
    seed: int | None = None
    """The rollout's seed for this episode: its k-th call samples with ``seed + k`` whatever the
    agent sends, so a rollout is a function of (weights, rows, seed). None: the agent's seed."""
    asked: int = 0
    """Calls that reached the engine."""
    calls: list[CallRecord] = field(default_factory=list)
    served: list[ServedCall] = field(default_factory=list)
    overridden: Counter = field(default_factory=Counter)
    """Sampling settings the agent sent that the trainer's replaced, by key."""
    errors: Counter = field(default_factory=Counter)
    """Requests answered with an error, by HTTP status."""
    continued: int = 0
    """Calls whose prompt continued an earlier reply in tokens (``proxy_render``)."""
    started: float = field(default_factory=time.monotonic)
    closed: bool = False
    """Set by ``close_episode``: a call still in flight then is answered 401 and not recorded."""


def _text_of(tokenizer, ids: list[int]) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return text.encode("utf-8", "replace").decode("utf-8")


class ProxyEndpoint:
    """The episodes of one rollout and the handling of their requests (no HTTP: ``ProxyServer``)."""

    def __init__(
        self,
        tokenizer,
        queue: GenerationQueue,
        defaults: SamplingDefaults,
        max_model_len: int,
        model_name: str = "policy",
        prompt_limit: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.queue = queue
        self.defaults = defaults
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.prompt_limit = prompt_limit
        """Most tokens of a prompt that starts a sample (``data.max_prompt_length``); None: no limit."""
        self.renderer = PromptRenderer(tokenizer)
        self._episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()
        queue.expected = self.running

    def open_episode(self, row: int, budget: int, seed: int | None = None) -> Episode:
        episode = Episode(key=f"ep-{secrets.token_urlsafe(24)}", row=row, budget_left=budget, seed=seed)
        with self._lock:
            self._episodes[episode.key] = episode
        return episode

    def running(self) -> int:
        """Episodes open now."""
        return len(self._episodes)

    def close_episode(self, key: str) -> Episode:
        """The episode, no longer served: a later call with its key gets 401."""
        with self._lock:
            episode = self._episodes.pop(key)
            episode.closed = True
        return episode

    def episode(self, authorization: str | None) -> Episode | None:
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        with self._lock:
            return self._episodes.get(key.strip())

    @staticmethod
    def unauthorized() -> OpenAIError:
        return OpenAIError(
            401,
            "Incorrect API key: each episode has its own (OPENAI_API_KEY, given to the agent with its "
            "row); this one names no running episode",
            type="invalid_request_error",
            code="invalid_api_key",
        )

    async def chat(self, episode: Episode, raw: bytes) -> tuple[int, dict[str, Any] | list[str]]:
        """``(status, body)``: a completion object, a list of server-sent events, or an error body."""
        answer = await self._chat(episode, raw)
        if isinstance(answer, OpenAIError):
            episode.errors[answer.status] += 1
            return answer.status, answer.body()
        return 200, answer

    async def _chat(self, episode: Episode, raw: bytes) -> dict[str, Any] | list[str] | OpenAIError:
        request = parse_chat_request(raw, self.defaults, episode.budget_left)
        if isinstance(request, OpenAIError):
            return request
        episode.overridden.update(request.overridden.keys())
        if request.model != self.model_name:
            episode.overridden["model"] += 1  # agents name the model they were written for; one is served
        if request.stop:
            episode.overridden["stop"] += 1  # the sampled tokens must be the engine's own, uncut
        try:
            prompt_ids, how = self.renderer.render(request.messages, request.tools, episode.served)
        except Exception as exc:  # noqa: BLE001 - a template error is the request's, told to the agent
            return OpenAIError(
                400, f"the chat template could not render these messages: {type(exc).__name__}: {exc}"[:2000]
            )
        if how == "rendered" and self.prompt_limit is not None and len(prompt_ids) > self.prompt_limit:
            return OpenAIError(
                400,
                f"this conversation is {len(prompt_ids)} tokens and starts a new sample, whose prompt may be at "
                f"most {self.prompt_limit} (data.max_prompt_length); a call that continues an earlier reply "
                "(its messages plus that reply plus tool or user turns) may be longer",
                param="messages",
                code="context_length_exceeded",
            )
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            return OpenAIError(
                400,
                f"this conversation is {len(prompt_ids)} tokens, past the context of {self.max_model_len} "
                "(data.max_prompt_length + data.max_response_length)",
                param="messages",
                code="context_length_exceeded",
            )
        max_new = min(request.max_tokens, room)
        seed = request.seed
        if episode.seed is not None:
            if request.seed is not None:
                episode.overridden["seed"] += 1
            seed = episode.seed + episode.asked
        episode.asked += 1
        try:
            (output_ids, log_probs, reason), version = await self.queue.generate((prompt_ids, max_new, seed))
        except Exception as exc:  # noqa: BLE001 - the engine's failure, answered as a server error
            return OpenAIError(
                500, f"the policy's engine failed: {type(exc).__name__}: {exc}"[:2000], "server_error"
            )
        if episode.closed:  # the episode ended (timed out) while this call was generated
            return self.unauthorized()
        text = _text_of(self.tokenizer, output_ids)
        reply = chat_completion(request, text, prompt_ids, output_ids, reason)
        episode.calls.append(
            CallRecord(reply["id"], tuple(prompt_ids), tuple(output_ids), tuple(log_probs), version)
        )
        episode.served.append(
            ServedCall.of(
                request.messages, request.tools, reply["choices"][0]["message"], prompt_ids, output_ids
            )
        )
        episode.budget_left -= len(output_ids)
        episode.continued += how == "continued"
        if request.stream:
            return list(stream_chunks(request, text, prompt_ids, output_ids, reason, completion=reply))
        return reply

    def models(self) -> dict[str, Any]:
        return models_list(self.model_name)


def _app(endpoint: ProxyEndpoint):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def error(err: OpenAIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    async def read_body(request: Request) -> bytes | None:
        """The body, or None past ``MAX_BODY_BYTES`` (read no further)."""
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def chat(request: Request):
        episode = endpoint.episode(request.headers.get("authorization"))
        if episode is None:
            return error(endpoint.unauthorized())
        raw = await read_body(request)
        if raw is None:
            episode.errors[413] += 1
            return error(OpenAIError(413, f"the request body is over {MAX_BODY_BYTES} bytes"))
        status, body = await endpoint.chat(episode, raw)
        if isinstance(body, list):

            async def events():
                for event in body:
                    yield event

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse(body, status_code=status)

    async def models(request: Request):
        if endpoint.episode(request.headers.get("authorization")) is None:
            return error(endpoint.unauthorized())
        return JSONResponse(endpoint.models())

    async def not_found(request: Request, exc):
        return error(
            OpenAIError(
                404,
                f"no route {request.method} {request.url.path}: this endpoint serves "
                "POST /v1/chat/completions and GET /v1/models",
                code="not_found",
            )
        )

    async def method_not_allowed(request: Request, exc):
        return error(OpenAIError(405, f"{request.method} is not allowed on {request.url.path}"))

    async def server_error(request: Request, exc):
        return error(
            OpenAIError(500, f"the endpoint failed: {type(exc).__name__}: {exc}"[:2000], "server_error")
        )

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ],
        exception_handlers={404: not_found, 405: method_not_allowed, Exception: server_error},
    )


class ProxyServer:
    """``endpoint`` over HTTP in a thread of its own; ``base_url`` is what agents are given."""

    def __init__(self, endpoint: ProxyEndpoint, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.endpoint = endpoint
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = host, self._socket.getsockname()[1]
        config = uvicorn.Config(
            _app(endpoint), log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="openai-proxy", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {host}:{self.port}")
            time.sleep(0.01)

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._socket]))

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()

    def __enter__(self) -> ProxyServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
