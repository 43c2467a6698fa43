"""Multi-turn rollouts on the vLLM engine: prompts in, the trainer's usual ``Batch`` out.

``generate_multi_turn(engine, agent, prompts, sampling)`` runs ``agent/loop.py``'s tool agent
over ``n`` samples per prompt and lays the trajectories out as ``rollout/base.py`` describes,
with one difference: a response holds every turn after the prompt (assistant, tool and user
turns), ``attention_mask`` covers all of them, and ``response_mask`` only the tokens the engine
sampled, so the policy loss, KL, entropy and the critic's targets see assistant tokens alone.
Per-sample columns add what happened: ``agent_num_turns``, ``agent_tool_calls``,
``agent_tool_errors``, ``agent_tool_timeouts``, ``agent_tool_seconds``, ``tool_rewards`` (the
tools' and interactions' rewards, added to the score) and ``agent_end`` (why it ended).

An engine spread over several processes (vLLM tensor parallelism) has one leader, which runs the
loop and the tools; the others generate the leader's requests turn by turn (``engine.share``),
and every rank returns the leader's batch.

Boundaries: the engine's ``generate_turn``/``share``/``is_leader`` and the agent loop; nothing of
Megatron or Ray.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from rlhf_megatron.config.schema import MultiTurnConfig
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.data.dataset import left_pad
from rlhf_megatron.data.rope_index import extend_positions
from rlhf_megatron.rollout.base import RolloutSampling, prompt_token_lists

__all__ = ["AGENT_COLUMNS", "build_agent_loop", "generate_multi_turn", "lay_out_rows"]

AGENT_COLUMNS = (
    "agent_num_turns",
    "agent_tool_calls",
    "agent_tool_errors",
    "agent_tool_timeouts",
    "agent_tool_seconds",
)
"""Per-sample tensor columns of a multi-turn batch the trainer turns into metrics and drops."""


def build_agent_loop(cfg: MultiTurnConfig, tokenizer, response_length: int):
    """The process's ``ToolAgentLoop`` from ``multi_turn``'s tool and interaction configs."""
    from rlhf_megatron.agent.config import load_interactions, load_tools
    from rlhf_megatron.agent.loop import ToolAgentLoop

    tools = load_tools(os.path.expanduser(cfg.tool_config_path)) if cfg.tool_config_path else []
    interactions = (
        load_interactions(os.path.expanduser(cfg.interaction_config_path))
        if cfg.interaction_config_path
        else {}
    )
    return ToolAgentLoop(
        tokenizer,
        tools,
        interactions,
        response_length,
        max_assistant_turns=cfg.max_assistant_turns,
        max_user_turns=cfg.max_user_turns,
        max_parallel_calls=cfg.max_parallel_calls,
        max_tool_response_length=cfg.max_tool_response_length,
        tool_response_truncate_side=str(cfg.tool_response_truncate_side),
        tool_timeout_s=cfg.tool_timeout_s,
    )


def generate_multi_turn(
    engine, agent, prompts: Batch, sampling: RolloutSampling, prompt_length: int
) -> Batch:
    """``sampling.n`` trajectories per prompt (see the module docstring); every rank of the engine
    calls it with the same ``prompts`` and gets the same batch."""
    if not engine.is_leader():
        while (requests := engine.share(None)) is not None:
            engine.generate_turn(requests, sampling)
        return engine.share(None)

    def generate(requests):
        engine.share(requests)  # the followers run the same turn
        return engine.generate_turn(requests, sampling)

    try:
        trajectories = _trajectories(agent, prompts, sampling, prompt_length)
        agent.run(trajectories, generate)
    finally:
        engine.share(None)  # the followers stop asking for turns, whatever happened here
    batch = _assemble(
        prompts, trajectories, sampling.n, prompt_length, sampling.response_length, engine.pad_token_id
    )
    return engine.share(batch)


def _trajectories(agent, prompts: Batch, sampling: RolloutSampling, prompt_length: int):
    """``n`` trajectories per prompt row (interleaved), each from its prompt's chat with the tools'
    schemas in the chat template (``data.return_raw_chat``), or from the prompt ids as they are."""
    from rlhf_megatron.agent.config import check_tools_kwargs
    from rlhf_megatron.agent.loop import Trajectory

    tokenizer = agent.tokenizer
    raw = prompts["raw_prompt"] if "raw_prompt" in prompts.non_tensor_keys else None
    token_lists = prompt_token_lists(prompts)
    extra = prompts["extra_info"] if "extra_info" in prompts.non_tensor_keys else [None] * len(prompts)
    agents = prompts["agent_name"] if "agent_name" in prompts.non_tensor_keys else [None] * len(prompts)
    out = []
    for row in range(len(prompts)):
        messages = [dict(m) for m in raw[row]] if raw is not None else []
        if raw is not None:
            kwargs = {"tools": agent.tool_schemas} if agent.tools else {}
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = token_lists[row]
        if len(ids) > prompt_length:
            raise ValueError(
                f"multi-turn prompt row {row} has {len(ids)} tokens with the tools' schemas in the chat template, "
                f"more than data.max_prompt_length={prompt_length}; raise data.max_prompt_length"
            )
        info = extra[row] if isinstance(extra[row], dict) else {}
        # A parquet struct column fills the keys other rows have with None: treat those as absent.
        tools_kwargs = {k: v for k, v in (info.get("tools_kwargs") or {}).items() if v is not None}
        if info.get("need_tools_kwargs") and not tools_kwargs:
            raise ValueError(
                f"prompt row {row}: extra_info.need_tools_kwargs is true but extra_info.tools_kwargs is empty; "
                "give each tool's create/execute/calc_reward/release kwargs, or set need_tools_kwargs false"
            )
        check_tools_kwargs(tools_kwargs, agent.tools, f"prompt row {row} (extra_info.tools_kwargs)")
        for k in range(sampling.n):
            seed = None if sampling.seed is None else sampling.seed + row * sampling.n + k
            out.append(
                Trajectory(
                    prompt_ids=list(ids),
                    messages=[dict(m) for m in messages],
                    tools_kwargs=tools_kwargs,
                    interaction_kwargs=info.get("interaction_kwargs") or None,
                    seed=seed,
                    single_turn=agents[row] == "single_turn_agent",
                )
            )
    return out


def lay_out_rows(
    expanded: Batch,
    prompt_ids: list[list[int]],
    responses: list[tuple[list[int], list[int], list[float]] | None],
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Rows of turns laid out as a multi-turn batch (the module docstring): each prompt left-padded
    to ``prompt_length``, each response's ``(ids, response_mask, log_probs)`` (None: no response)
    cut at ``response_length``, and the other columns of ``expanded`` (one prompt row per row).
    Returns the tensors and non-tensors; callers add their own columns."""
    rows = len(prompt_ids)
    padded = [left_pad(ids, prompt_length, pad_token_id) for ids in prompt_ids]
    prompts = torch.stack([p[0] for p in padded])
    prompt_mask = torch.stack([p[1] for p in padded])
    prompt_positions = torch.stack([p[2] for p in padded])
    out = torch.full((rows, response_length), pad_token_id, dtype=torch.long)
    valid = torch.zeros(rows, response_length, dtype=torch.long)
    mask = torch.zeros(rows, response_length, dtype=torch.long)
    log_probs = torch.zeros(rows, response_length, dtype=torch.float32)
    for i, response in enumerate(responses):
        if response is None:
            continue
        ids, sampled, lps = response
        length = min(len(ids), response_length)
        out[i, :length] = torch.as_tensor(ids[:length], dtype=torch.long)
        valid[i, :length] = 1
        mask[i, :length] = torch.as_tensor(sampled[:length], dtype=torch.long)
        log_probs[i, :length] = torch.as_tensor(lps[:length], dtype=torch.float32)
    tensors: dict[str, torch.Tensor] = {
        key: expanded[key]
        for key in expanded.tensor_keys
        if key not in ("input_ids", "attention_mask", "position_ids")
    }
    tensors.update(
        {
            "prompts": prompts,
            "responses": out,
            "response_mask": mask,
            "input_ids": torch.cat([prompts, out], dim=1),
            "attention_mask": torch.cat([prompt_mask, valid], dim=1),
            "position_ids": extend_positions(prompt_positions, response_length),
            "rollout_log_probs": log_probs,
        }
    )
    return tensors, {k: expanded.non_tensors[k] for k in expanded.non_tensor_keys}


def _assemble(
    prompts: Batch, trajectories, n: int, prompt_length: int, response_length: int, pad_token_id: int
) -> Batch:
    tensors, non_tensors = lay_out_rows(
        prompts.repeat(n, interleave=True),
        [t.prompt_ids for t in trajectories],
        [(t.response_ids, t.response_mask, t.log_probs) for t in trajectories],
        prompt_length,
        response_length,
        pad_token_id,
    )
    tensors.update(
        {
            "tool_rewards": torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
            "agent_num_turns": torch.tensor([t.assistant_turns + t.user_turns for t in trajectories]),
            "agent_tool_calls": torch.tensor([t.tool_calls for t in trajectories]),
            "agent_tool_errors": torch.tensor([t.tool_errors for t in trajectories]),
            "agent_tool_timeouts": torch.tensor([t.tool_timeouts for t in trajectories]),
            "agent_tool_seconds": torch.tensor([t.tool_seconds for t in trajectories], dtype=torch.float32),
        }
    )
    non_tensors["agent_end"] = np.array([t.end for t in trajectories], dtype=object)
    return Batch(tensors, non_tensors, dict(prompts.meta_info))
