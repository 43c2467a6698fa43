"""Routing replay for mixture-of-experts policies (verl's ``actor.router_replay.mode``: R2, R3).

A router's top-k choice is discrete, so two passes over the same tokens with (almost) the
same weights can send a token to different experts: the rollout engine and the trainer
differ in kernels, and the update passes see weights that moved since the old-policy pass.
A flipped choice changes the token's log-prob by far more than the weights did, which
inflates importance ratios and clipping. Replay fixes the *selection* to a recorded one;
the routing weights are still the live router's probabilities of the chosen experts, so
gradients reach the router.

- ``R2`` (vanilla routing replay): the actor's old-log-prob pass records its choices and
  every update pass replays them.
- ``R3`` (rollout routing replay): the rollout engine's choices (vLLM's
  ``routed_experts``) are replayed in the old-log-prob pass and every update pass.

Routes travel per row as ``routed_experts`` ``[B, S, L, k]`` int16, aligned with the
``input_ids`` columns, for every layer ``L`` of the model; ``-1`` marks "no route" (a
padding column, a dense layer, a layer on another pipeline stage, the last sampled
token, which the rollout engine never fed back). A replayed token without a route gets
experts ``0..k-1``: only padding and the final token, whose outputs no log-prob uses.

Inside a micro-batch megatron's routers see tokens in ``[s, b]`` order over the
micro-batch's (trimmed) columns, and with sequence parallelism only this TP rank's
contiguous ``s / tp`` share of them; ``_columns`` (from ``trim_padding``) says which
columns the model saw.

Built on megatron-core's ``RouterReplay`` (``TransformerConfig.moe_enable_routing_replay``):
each router's forward asks its replay object for the top-k, which records
(``RECORD``) or returns the target indices (``REPLAY_FORWARD``). Full activation
recomputation reruns the routers during backward from a separate queue that megatron
leaves to the caller, so replay is refused with it, as with context parallelism (whose
load-balanced sequence split this does not map): ``config.validate.check_router_replay``.

Boundaries: megatron-core only; knows nothing of the Batch or the roles.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ROUTES_KEY", "RoutingReplay"]

ROUTES_KEY = "routed_experts"


class RoutingReplay:
    """Records or replays the top-k choices of every router in ``chunks`` (a model built with
    ``moe_enable_routing_replay=True``), micro-batch by micro-batch.

    ``before_forward(chunk, micro)``: replay ``micro["routed_experts"]`` if present, else
    record while ``recording`` is set (else route freely).
    ``after_forward(chunk, micro)``: keep what was recorded, per row and column.
    ``take_recorded(rows)``: the recorded routes ``[rows, S, L, k]`` since the last call.
    """

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        num_layers: int,
        top_k: int,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group=None,
        sequence_parallel: bool = False,
    ):
        from megatron.core.transformer.moe.router import TopKRouter

        self.num_layers, self.top_k = num_layers, top_k
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.routers: dict[int, list[tuple[int, torch.nn.Module]]] = {}
        for chunk in chunks:
            routers = [(m.layer_number - 1, m) for m in chunk.modules() if isinstance(m, TopKRouter)]
            for layer, router in routers:
                if router.router_replay is None:
                    raise ValueError(
                        f"layer {layer}'s router has no replay object; build the model with "
                        "moe_enable_routing_replay=True"
                    )
            self.routers[id(chunk)] = routers
        self._recorded: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        self.recording = False

    # ------------------------------------------------------------------ per micro-batch
    def _columns(self, micro: dict[str, torch.Tensor]) -> tuple[int, int, int]:
        if "_columns" in micro:
            left, right, width = (int(v) for v in micro["_columns"])
            return left, right, width
        width = micro["input_ids"].shape[1]
        return 0, width, width

    def _local_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[s * b, ...]`` tokens in [s, b] order → this TP rank's share under sequence parallelism."""
        if not self.sequence_parallel:
            return tokens
        share = tokens.shape[0] // self.tp_size
        return tokens[self.tp_rank * share : (self.tp_rank + 1) * share]

    def before_forward(self, chunk: torch.nn.Module, micro: dict[str, torch.Tensor]) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routes = micro.get(ROUTES_KEY)
        left, right, _ = self._columns(micro)
        for layer, router in self.routers[id(chunk)]:
            replay = router.router_replay
            replay.clear_indices()
            if routes is None:
                if self.recording:
                    replay.set_router_replay_action(RouterReplayAction.RECORD)
                continue
            target = routes[:, left:right, layer].to(torch.long)  # [b, s, k]
            missing = (target < 0).any(-1)
            if missing.any():
                target[missing] = torch.arange(self.top_k, dtype=torch.long)
            target = target.transpose(0, 1).reshape(-1, self.top_k)  # [s * b, k]
            replay.target_topk_idx = self._local_tokens(target)
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after_forward(self, chunk: torch.nn.Module, micro: dict[str, torch.Tensor]) -> None:
        recording = self.recording and ROUTES_KEY not in micro
        left, right, width = self._columns(micro)
        b = micro["input_ids"].shape[0]
        for layer, router in self.routers[id(chunk)]:
            replay = router.router_replay
            if recording:
                tokens = replay.get_recorded_indices()
                if tokens is None:
                    raise RuntimeError(f"layer {layer}'s router recorded nothing in this forward pass")
                if self.sequence_parallel:
                    parts = [torch.empty_like(tokens) for _ in range(self.tp_size)]
                    torch.distributed.all_gather(parts, tokens.contiguous(), group=self.tp_group)
                    tokens = torch.cat(parts)
                full = torch.full((b, width, self.top_k), -1, dtype=torch.int16)
                full[:, left:right] = tokens.view(right - left, b, self.top_k).transpose(0, 1).to(torch.int16)
                self._recorded.append((micro["_rows"], layer, full))
            replay.clear_indices()
            replay.clear_router_replay_action()

    # ------------------------------------------------------------------ per pass
    def take_recorded(self, rows: int) -> torch.Tensor:
        """The routes recorded since the last call, ``[rows, S, L, k]`` int16 by row index."""
        if not self._recorded:
            raise RuntimeError("routing replay: nothing was recorded (no forward pass since the last take)")
        width = self._recorded[0][2].shape[1]
        out = torch.full((rows, width, self.num_layers, self.top_k), -1, dtype=torch.int16)
        for index, layer, routes in self._recorded:
            out[index, :, layer] = routes
        self._recorded = []
        return out

    def discard_recorded(self) -> None:
        self._recorded = []
