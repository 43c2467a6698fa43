"""Smoke job: train a tiny megatron-core GPT at TP=2 on 2 gloo processes and print the losses.

Proves the CPU platform layer end to end (real megatron-core, DDP, optimizer,
pipeline schedule) in ~20 s. Prints one JSON line per step and exits non-zero
if the loss does not fall.

    .venv/bin/python tools/smoke_megatron_cpu.py [--steps 5] [--tp 2]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from rlhf_megatron.platform import init_model_parallel
from rlhf_megatron.platform.multiproc import run_on_ranks

VOCAB, SEQ, BATCH = 256, 32, 8


def _train(rank, world_size, tp, steps):
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    init_model_parallel(tensor_model_parallel_size=tp, seed=0)
    config = TransformerConfig(
        num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        params_dtype=torch.float32, use_cpu_initialization=True,
    )  # fmt: skip
    model = GPTModel(
        config, get_gpt_layer_local_spec(normalization="RMSNorm"), VOCAB, SEQ, position_embedding_type="rope"
    )
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0), [ddp])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    pos = torch.arange(SEQ).expand(BATCH, -1)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None].expand(BATCH, 1, -1, -1)

    def step(_, m):
        out = m(tokens, pos, mask, labels=labels)
        return out, lambda o: (o.mean(), {"loss": o.mean().detach()})

    losses = []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([None]), model=[ddp], num_microbatches=1,
            seq_length=SEQ, micro_batch_size=BATCH,
        )  # fmt: skip
        _, grad_norm, _ = opt.step()
        losses.append({"loss": float(out[0]["loss"]), "grad_norm": float(grad_norm)})
    return losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args(argv)
    losses = run_on_ranks(_train, args.tp, args.tp, args.steps, timeout_s=600)[0]
    for i, rec in enumerate(losses):
        print(json.dumps({"step": i + 1, **rec}))
    ok = losses[-1]["loss"] < losses[0]["loss"]
    print(json.dumps({"smoke": "ok" if ok else "loss did not fall", "tp": args.tp}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
