"""Data layer: the `Batch` container, the prompt dataset (verl's and EasyR1's layouts, text and
images, from parquet/JSON files and local HF dataset directories), the resumable loader and
sequence balancing. No Megatron, Ray or vLLM imports here (see docs/concepts/architecture.md).

`rlhf_megatron.data.tokenizer` (tiny test tokenizers and processor), `.synthetic` (arith/countdown
tasks), `.preprocess` (verl-row builders) and `.rope_index` (M-RoPE positions) are imported
explicitly by the code that needs them.
"""

from rlhf_megatron.data.balance import balance_batch, balance_partitions, sequence_costs
from rlhf_megatron.data.batch import Batch
from rlhf_megatron.data.dataloader import StatefulDataLoader
from rlhf_megatron.data.dataset import DatasetFormatError, RLHFDataset, collate_fn
from rlhf_megatron.data.multimodal import VisionProcessor, load_vision_processor

__all__ = [
    "Batch",
    "DatasetFormatError",
    "RLHFDataset",
    "StatefulDataLoader",
    "VisionProcessor",
    "balance_batch",
    "balance_partitions",
    "collate_fn",
    "load_vision_processor",
    "sequence_costs",
]
