"""`StatefulDataLoader`: seeded, epoch-aware batching whose position can be saved and restored.

The order of epoch ``e`` is a permutation drawn from ``seed + e`` alone, so it does not depend
on how many batches were read before, on other RNG users, or on the process. That makes a
resumed run (``load_state_dict(state_dict())``) see exactly the batches an uninterrupted run
would have seen.

Iterating the loader yields the remaining batches of the current epoch and then moves to the
next epoch, so ``for epoch in ...: for batch in loader: ...`` works as with torch's DataLoader.
Items are fetched and collated in the calling process: tokenizing a batch of prompts is cheap
next to a rollout, and it keeps the resume logic free of worker prefetch state.

Boundaries: ordering and batching only; it knows nothing of ranks (the driver feeds whole
batches to the worker groups, which split them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

__all__ = ["StatefulDataLoader"]


class StatefulDataLoader:
    """Batches of ``batch_size`` items from ``dataset``, in a per-epoch seeded order.

    ``state_dict()`` returns ``{"epoch", "position", "seed"}``: ``position`` counts the batches
    of ``epoch`` already handed out (a batch counts as consumed once it has been yielded).
    """

    def __init__(
        self,
        dataset: Sequence[Any],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ):
        if batch_size <= 0:
            raise ValueError(f"StatefulDataLoader: batch_size must be positive, got {batch_size}.")
        if drop_last and len(dataset) < batch_size:
            raise ValueError(
                f"StatefulDataLoader: the dataset has {len(dataset)} rows, fewer than batch_size={batch_size} "
                "with drop_last=True, so an epoch would have no batches. Lower the batch size or add data."
            )
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.collate_fn = collate_fn if collate_fn is not None else list
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row order of ``epoch``; a pure function of (seed, epoch, dataset size)."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng(self.seed + epoch).permutation(n)

    def __iter__(self) -> Iterator[Any]:
        if self.position >= len(self):
            # The previous epoch was fully consumed (e.g. state saved after its last batch).
            self.epoch, self.position = self.epoch + 1, 0
        order = self.epoch_order(self.epoch)
        while self.position < len(self):
            rows = order[self.position * self.batch_size : (self.position + 1) * self.batch_size]
            batch = self.collate_fn([self.dataset[int(i)] for i in rows])
            # Count the batch before yielding: a checkpoint taken while the caller holds it
            # must resume after it.
            self.position += 1
            yield batch
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise KeyError(
                f"StatefulDataLoader.load_state_dict: state lacks {sorted(missing)}; got {sorted(state)}."
            )
        if not 0 <= int(state["position"]) <= len(self):
            raise ValueError(
                f"StatefulDataLoader.load_state_dict: position {state['position']} is outside [0, {len(self)}] "
                "batches per epoch; was the state saved with another dataset or batch size?"
            )
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
