"""Run vLLM (CPU) on an HF directory: greedy tokens and prompt log-probs, as one JSON line.

Used by the tests in a fresh process:

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python tests/models/vllm_probe.py HF_DIR '[[5, 17, 42], ...]' MAX_TOKENS

``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's engine core in this process
(no extra engine process to start), ``enforce_eager`` skips graph capture, and
fp32 makes the numbers comparable with transformers.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    hf_dir, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    # On CPU, gpu_memory_utilization is the share of host memory vLLM reserves (weights + KV cache):
    # a tiny model needs little, and other processes share the machine.
    llm = LLM(
        model=hf_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        seed=0,
        gpu_memory_utilization=0.1,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    result = [
        {
            "tokens": list(o.outputs[0].token_ids),
            # prompt_logprobs[i] is {token: Logprob} for prompt token i (None for the first one).
            "prompt_logprobs": [
                None if x is None else x[tok].logprob for x, tok in zip(o.prompt_logprobs, p)
            ],
        }
        for o, p in zip(outs, prompts)
    ]
    print("VLLM_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
