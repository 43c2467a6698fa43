"""Data layer: the `Batch` container, the parquet prompt dataset, the resumable loader and
sequence balancing. No Megatron, Ray or vLLM imports here (see ARCHITECTURE.md).

`rlhf_megatron.data.tokenizer` (tiny test tokenizer), `.synthetic` (arith/countdown tasks) and
`.preprocess` (verl-row builders) are imported explicitly by the tools that need them.
"""

from rlhf_megatron.data.balance import balance_batch, balance_partitions
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.data.dataloader import StatefulDataLoader
from rlhf_megatron.data.dataset import DatasetFormatError, RLHFDataset, collate_fn

__all__ = [
    "Batch",
    "DatasetFormatError",
    "RLHFDataset",
    "StatefulDataLoader",
    "balance_batch",
    "balance_partitions",
    "collate_fn",
]
