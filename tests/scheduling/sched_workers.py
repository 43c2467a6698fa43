"""Worker roles used by the scheduling tests (importable by Ray workers via PYTHONPATH)."""

import os
import signal
import time

import torch

from rlhf_megatron.data.batch import Batch
from rlhf_megatron.scheduling.dispatch import Dispatch, dispatch
from rlhf_megatron.workers.base import Worker


class EchoWorker(Worker):
    """Builds real megatron parallel groups, then reports what each rank received."""

    def init_model(self, tp: int, pp: int = 1):
        from rlhf_megatron.platform import init_model_parallel

        self.parallel = init_model_parallel(tp, pp)

    @dispatch(Dispatch.DP_COMPUTE)
    def tag_rows(self, batch: Batch) -> Batch:
        out = Batch.from_dict(
            {
                "x": batch["x"],
                "dp_rank": torch.full((len(batch),), self.parallel.dp_rank),
                "tp_sum": torch.full((len(batch),), self.all_reduce_sum(float(batch["x"].sum()))),
            }
        )
        return out

    def fail(self, on_rank: int):
        if self.rank == on_rank:
            raise ValueError(f"deliberate failure in rank {self.rank}")
        time.sleep(60)  # the other ranks would block in a collective

    def die(self, on_rank: int):
        if self.rank == on_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

    def die_then_peer_fails(self, on_rank: int):
        """``on_rank`` dies a moment after the others' collective failed: the peers' errors reach
        the driver before Ray reports the death, as when gloo sees the connection reset first."""
        if self.rank == on_rank:
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("Connection reset by peer (the collective lost its partner)")

    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    def hang_one(self, rank: int):
        """``rank`` stops; the others wait for it in a collective."""
        if self.rank == rank:
            time.sleep(3600)
        return self.all_reduce_sum(1.0)
