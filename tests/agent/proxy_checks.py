"""The agent endpoint tests' scripted engine (``Engine``) and what they send; the fixtures ``tok``
and ``serve`` (a real ``ProxyServer`` over it) are in ``conftest.py``."""

import openai

from rlhf_megatron.agent.proxy_protocol import SamplingDefaults
from rlhf_megatron.agent.tools.calculator import CalculatorTool

TOOLS = [CalculatorTool.default_tool_schema]
FIRST = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "6*7?"}]
CALL_TEXT = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
DEFAULTS = SamplingDefaults(temperature=1.0, top_p=1.0, max_tokens=128)


class Engine:
    """Answers each turn with ``reply(prompt ids)``'s text as tokens (+ EOS), at most ``max_new``;
    counts its calls and the turns in each; ``fail`` makes the next call raise."""

    def __init__(self, tok, reply):
        self.tok, self.reply, self.batches, self.fail, self.version = tok, reply, [], False, 3
        self.requests = []

    def __call__(self, requests):
        self.batches.append(len(requests))
        self.requests.extend(requests)
        if self.fail:
            self.fail = False
            raise RuntimeError("engine on fire")
        out = []
        for ids, max_new, _seed in requests:
            sampled = [*self.tok.encode(self.reply(ids), add_special_tokens=False), self.tok.eos_token_id]
            cut = sampled[:max_new]
            out.append((cut, [-0.5] * len(cut), "stop" if len(cut) == len(sampled) else "length"))
        return out


def client_for(server, key):
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=30)
