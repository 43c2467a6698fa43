"""The weight converter: Megatron TP×PP(×VPP)(×EP×ETP) shards → the rollout engine's layout, after every update.

plan (``plan.py``, pure) → execute (``execute.py``, gather/convert/broadcast per
bucket) → transport (``transport.py``, torch.distributed collectives).
"""

from rlhf_megatron.weights.execute import WeightSyncer, copy_sharded_weights
from rlhf_megatron.weights.plan import LOAD_FORMATS, SyncPlan, Target, TrainLayout, build_sync_plan
from rlhf_megatron.weights.transport import CollectiveTransport

__all__ = [
    "LOAD_FORMATS",
    "CollectiveTransport",
    "SyncPlan",
    "Target",
    "TrainLayout",
    "WeightSyncer",
    "build_sync_plan",
    "copy_sharded_weights",
]
