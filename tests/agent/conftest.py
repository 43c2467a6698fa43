"""Fixtures of the agent endpoint's tests: ``tok`` (the tiny tokenizer with its hermes template) and
``serve(reply)``: a real ``ProxyServer`` whose turns ``proxy_checks.Engine`` answers on a thread of
its own, as the rollout worker's engine thread does."""

import threading

import pytest
from proxy_checks import DEFAULTS, Engine

from rlhf_megatron.agent.proxy_server import GenerationQueue, ProxyEndpoint, ProxyServer


@pytest.fixture(scope="session")
def tok():
    from rlhf_megatron.data.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture
def serve(tok):
    """``serve(reply, max_model_len=4096)`` -> (endpoint, server, engine): the engine runs in its own
    thread (the rollout's engine thread) until the test ends."""
    running = []

    def start(reply, max_model_len=4096, gather_s=0.2):
        queue = GenerationQueue(gather_s=gather_s)
        engine = Engine(tok, reply)
        stop = threading.Event()
        thread = threading.Thread(target=queue.serve, args=(engine, lambda: engine.version, stop.is_set))
        thread.start()
        endpoint = ProxyEndpoint(tok, queue, DEFAULTS, max_model_len=max_model_len)
        server = ProxyServer(endpoint)
        running.append((server, queue, stop, thread))
        return endpoint, server, engine

    yield start
    for server, queue, stop, thread in running:
        server.close()
        stop.set()
        queue.close()
        thread.join(timeout=10)
