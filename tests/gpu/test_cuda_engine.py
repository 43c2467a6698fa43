"""The engine's GPU path on one CUDA device: NCCL (world size 1), megatron-core without vLLM.

Marked ``gpu``: skipped where CUDA is absent (CI), run on a GPU machine by
``tools/gpu/run.sh`` (issue #20). Covers what the CPU suite cannot: batches from
the driver (host memory) reaching the model's device, bf16 training with the
distributed optimizer, grad clipping and the NaN check over NCCL, offloading
that really frees GPU memory, and the weight converter's HF export on CUDA.
"""

import pytest
import torch

from rlhf_megatron.models.forward import position_ids_from_mask

pytestmark = pytest.mark.gpu

P, R = 12, 8  # prompt and response widths


@pytest.fixture(scope="module")
def nccl():
    from rlhf_megatron.platform import destroy_distributed, init_distributed, init_model_parallel
    from rlhf_megatron.platform.multiproc import find_free_port

    init_distributed(0, 1, "127.0.0.1", find_free_port())
    assert torch.distributed.get_backend() == "nccl"
    init_model_parallel(1, 1, seed=1)
    yield
    destroy_distributed()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlhf_megatron.models.tiny import make_tiny_hf_model

    return str(
        make_tiny_hf_model(
            tmp_path_factory.mktemp("tiny"),
            "llama",
            num_layers=4,
            hidden_size=256,
            num_heads=4,
            num_kv_heads=2,
            ffn_hidden_size=512,
        )
    )


def _engine(model_dir, dtype="bfloat16", lr=None, distributed_optimizer=True):
    from rlhf_megatron.config.schema import MegatronConfig, OptimConfig
    from rlhf_megatron.models.builder import ParallelConfig
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.workers.megatron_engine import MegatronEngine

    return MegatronEngine(
        ModelArch.from_hf_dir(model_dir),
        ParallelConfig(1),
        model_dir,
        MegatronConfig(params_dtype=dtype, use_distributed_optimizer=distributed_optimizer),
        OptimConfig(lr=lr, clip_grad=1.0, weight_decay=0.0) if lr else None,
        total_steps=100,
    )


def _batch(rows=6, seed=0):
    """Rollout-shaped rows in host memory, as a worker receives them: left-padded prompts,
    right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (rows, P + R), generator=g)  # the tiny tokenizer has 110 ids
    mask = torch.ones(rows, P + R, dtype=torch.long)
    for i in range(rows):
        mask[i, : i % 4] = 0
        mask[i, P + R - (i % 3) :] = 0
    ids = ids * mask
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": position_ids_from_mask(mask),
        "responses": ids[:, P:],
        "response_mask": mask[:, P:].float(),
    }


def _micros(batch, size=3):
    from rlhf_megatron.data.batch import Batch
    from rlhf_megatron.workers.megatron_engine import split_micro_batches

    return split_micro_batches(Batch.from_dict(batch), tuple(batch), micro_batch_size=size)


def _response_log_probs(engine, logits, micro):
    """The responses' log-probs ``[b, R]``, as the actor's loss functions compute them."""
    from rlhf_megatron.models.forward import vocab_parallel_log_probs
    from rlhf_megatron.workers.megatron_engine import pad_responses, response_outputs

    out = response_outputs(logits, micro)
    labels = micro["responses"][:, : out.shape[1]]
    return pad_responses(vocab_parallel_log_probs(out, labels, engine.arch.vocab_size), micro)


def _log_probs(engine, batch):
    def fn(logits, micro):
        lp = _response_log_probs(engine, logits, micro)
        return logits.new_zeros(()), {"lp": lp, "rows": micro["_rows"]}

    collected = engine.run(_micros(batch), fn, forward_only=True)
    rows = torch.cat([c["rows"] for c in collected])
    return torch.cat([c["lp"] for c in collected])[torch.argsort(rows)]


def _nll(engine, scale=1.0):
    """Mean negative log-likelihood of the responses (an SFT loss), ``scale`` to poison it."""

    def fn(logits, micro):
        lp = _response_log_probs(engine, logits, micro)
        mask = micro["response_mask"]
        loss = -(lp * mask).sum() / mask.sum() * scale
        return loss * micro["_weight"], {"loss": float(loss)}

    return fn


def _reference_log_probs(model_dir, batch):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    ids, mask = batch["input_ids"].cuda(), batch["attention_mask"].cuda()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=batch["position_ids"].cuda()).logits
    lp = torch.log_softmax(logits[:, P - 1 : -1].float(), -1)
    return lp.gather(-1, ids[:, P:, None]).squeeze(-1).cpu() * batch["response_mask"]


def test_log_probs_on_cuda_match_transformers(nccl, model_dir):
    batch = _batch()
    ref = _reference_log_probs(model_dir, batch)
    for dtype, tol in (("float32", 2e-3), ("bfloat16", 0.15)):
        engine = _engine(model_dir, dtype)
        assert next(engine.chunks[0].parameters()).is_cuda
        lp = _log_probs(engine, batch).cpu() * batch["response_mask"]
        err = (lp - ref).abs().max().item()
        assert err < tol, f"{dtype}: max |megatron - transformers| = {err}"
        del engine


def test_bf16_training_with_distributed_optimizer_clip_and_nan_check(nccl, model_dir):
    engine = _engine(model_dir, lr=2e-3)
    assert {type(o).__name__ for o in engine._sub_optimizers()} == {"DistributedOptimizer"}
    micros = _micros(_batch())
    losses, norms = [], []
    for _ in range(6):
        out = engine.train_step(micros, _nll(engine))
        assert out["update_ok"] and not out["nan_skipped"]
        losses.append(sum(m["loss"] for m in out["metrics"]) / len(out["metrics"]))
        norms.append(out["grad_norm"])
    assert all(0 < n < float("inf") for n in norms)
    assert losses[-1] < losses[0] - 0.5, losses  # memorises the fixed batch
    # A NaN loss: the NCCL-reduced check stops before the optimizer touches the weights.
    from rlhf_megatron.workers.megatron_engine import NonFiniteGradientError

    before = {n: p.detach().clone() for n, p in engine.chunks[0].named_parameters()}
    with pytest.raises(NonFiniteGradientError, match="rank"):
        engine.train_step(micros, _nll(engine, scale=float("nan")), where="[actor] rank 0 step 7")
    skipped = engine.train_step(micros, _nll(engine, scale=float("nan")), nan_policy="skip")
    assert skipped["nan_skipped"] and not skipped["update_ok"]
    for n, p in engine.chunks[0].named_parameters():
        assert torch.equal(p.detach(), before[n]), f"{n} changed after a NaN step"


def test_offload_frees_gpu_memory_and_restores_state(nccl, model_dir):
    engine = _engine(model_dir, lr=1e-3)
    micros = _micros(_batch())
    engine.train_step(micros, _nll(engine))  # Adam moments exist from here on
    n_params = sum(p.numel() for p in engine.chunks[0].parameters())
    batch = _batch(seed=1)
    lp_before = _log_probs(engine, batch)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    with engine.offloaded(params=True, grads=True, optimizer=True):
        freed = held - torch.cuda.memory_allocated()
        # bf16 weights + fp32 grads + fp32 main params and Adam m, v: 2 + 4 + 12 bytes a parameter
        assert freed >= 0.95 * 18 * n_params, (freed, n_params)
    assert torch.cuda.memory_allocated() == held
    assert torch.equal(_log_probs(engine, batch), lp_before)
    out = engine.train_step(micros, _nll(engine))
    assert out["update_ok"]


def test_weight_export_on_cuda_equals_the_checkpoint(nccl, model_dir):
    from safetensors.torch import load_file

    from rlhf_megatron.platform import ParallelGroups, ParallelInfo
    from rlhf_megatron.weights import TrainLayout, WeightSyncer, build_sync_plan

    engine = _engine(model_dir, "bfloat16")
    info = ParallelInfo.current()
    plan = build_sync_plan(engine.arch, TrainLayout.of(info), 1, "hf", bucket_bytes=2**20)
    assert len(plan.buckets) > 1
    syncer = WeightSyncer.of(plan, engine.chunks, info, ParallelGroups.current())
    exported = dict(syncer.iter_weights())
    expected = load_file(f"{model_dir}/model.safetensors")
    assert set(exported) == set(expected)
    for name, tensor in exported.items():
        assert tensor.is_cuda and tensor.dtype == torch.bfloat16
        assert torch.equal(tensor.cpu(), expected[name].to(torch.bfloat16)), name
