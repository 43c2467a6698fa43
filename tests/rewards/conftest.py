"""Fixtures for the reward tests: the tiny tokenizer, rollout batches and user reward files."""

from __future__ import annotations

import textwrap

import pytest
import torch

from rlhf_megatron.data.batch import Batch
from rlhf_megatron.data.tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def make_rollout(tokenizer):
    """make_rollout(rows, R=12) -> Batch; rows are (prompt, response, data_source, ground_truth).

    Mimics rollout output: left-padded prompts, right-padded responses ending in eos,
    attention_mask over both and response_mask over the response.
    """

    def build(rows, response_length: int = 12, with_response_mask: bool = True) -> Batch:
        prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p, *_ in rows]
        response_ids = [
            tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id] for _, r, *_ in rows
        ]
        P = max(map(len, prompt_ids))
        pad = tokenizer.pad_token_id
        prompts = torch.tensor([[pad] * (P - len(p)) + p for p in prompt_ids])
        responses = torch.tensor([(r + [pad] * response_length)[:response_length] for r in response_ids])
        response_mask = torch.tensor(
            [[1] * min(len(r), response_length) + [0] * (response_length - len(r)) for r in response_ids]
        )
        prompt_mask = (torch.arange(P) >= torch.tensor([P - len(p) for p in prompt_ids])[:, None]).long()
        tensors = {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        }
        if with_response_mask:
            tensors["response_mask"] = response_mask
        non_tensors = {
            "data_source": [row[2] for row in rows],
            "reward_model": [{"style": "rule", "ground_truth": row[3]} for row in rows],
            "extra_info": [{"index": i} for i in range(len(rows))],
        }
        return Batch.from_dict(tensors, non_tensors)

    return build


@pytest.fixture
def user_reward_file(tmp_path):
    """A reward file with well-behaved and misbehaving functions, for custom-function tests."""
    path = tmp_path / "my_reward.py"
    path.write_text(
        textwrap.dedent(
            """
            import math
            import os
            import time

            def length_reward(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
                return {"score": scale * len(solution_str), "chars": len(solution_str), "tag": "x"}

            def nan_on_wrong(data_source, solution_str, ground_truth, extra_info=None):
                return 1.0 if solution_str.strip() == ground_truth else math.nan

            def boom(data_source, solution_str, ground_truth, extra_info=None):
                if solution_str.strip() == "2":
                    raise RuntimeError("scorer exploded")
                return 1.0

            def not_a_number(data_source, solution_str, ground_truth, extra_info=None):
                return "high"

            def hang_on_wrong(data_source, solution_str, ground_truth, extra_info=None, pid_dir=None):
                if solution_str.strip() != ground_truth:
                    if pid_dir:
                        with open(os.path.join(pid_dir, f"{os.getpid()}.pid"), "w") as f:
                            f.write("hung")
                    while True:
                        time.sleep(1)
                return 1.0

            def die_on_wrong(data_source, solution_str, ground_truth, extra_info=None):
                if solution_str.strip() != ground_truth:
                    os._exit(7)
                return 1.0

            NOT_CALLABLE = 3
            """
        )
    )
    return str(path)
