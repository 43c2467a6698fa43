"""``ParallelConfig``: the model-parallel sizes a model is built for.

Apart from ``builder`` so that the worker classes, which name it in their signatures, import
without megatron-core: the driver imports them only to start them as Ray actors."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParallelConfig"]


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel sizes a model is built for (data parallelism is whatever remains)."""

    tensor_model_parallel_size: int = 1
    """Ranks that split each layer's weights (attention heads, MLP columns, vocabulary)."""
    pipeline_model_parallel_size: int = 1
    """Ranks that split the layers into consecutive stages."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (interleaved schedule); None = one chunk."""
    context_parallel_size: int = 1
    """Ranks that split the sequence for attention (needs transformer-engine, GPU only)."""
    sequence_parallel: bool = False
    """Split activations outside attention/MLP along the sequence over TP ranks (on CPU with
    ``norms.SequenceParallelTorchNorm``)."""
    expert_model_parallel_size: int = 1
    """Ranks that split a mixture-of-experts layer's experts (EP); 1 for dense models."""
    expert_tensor_parallel_size: int | None = None
    """Ranks that split each expert's matrices (ETP); None means the TP size (megatron's default)."""

    def __post_init__(self):
        if self.expert_tensor_parallel_size is None:  # resolved, so equal layouts compare equal
            object.__setattr__(self, "expert_tensor_parallel_size", self.tensor_model_parallel_size)

    @classmethod
    def current(cls, sequence_parallel: bool = False) -> ParallelConfig:
        """The sizes of megatron's initialised parallel state."""
        from megatron.core import parallel_state as ps

        return cls(
            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
            virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
            context_parallel_size=ps.get_context_parallel_world_size(),
            sequence_parallel=sequence_parallel,
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        )
