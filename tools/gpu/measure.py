"""The GPU path measured on one CUDA device, in one go; writes ONE JSON file (issue #20).

Run on the GPU machine through ``tools/gpu/run.sh`` (it installs the carried wheels
first). What it does, each section recorded under its own key (a section that fails
records its traceback and the rest still run):

- ``env``: torch, CUDA, the device, megatron-core.
- ``gpu_tests``: ``pytest -m gpu tests/gpu`` in a subprocess (the engine on CUDA with
  NCCL: log-probs against transformers, bf16 training with the distributed optimizer,
  clipping and the NaN check, offloading, the weight export).
- ``ceilings``: a device-to-device copy (bytes read + written per second) and a bf16
  8192^3 matrix product on random data, CUDA events, median of the repeats.
- ``model``: a random dense Llama-style model written as an HF checkpoint (bf16,
  safetensors): by default Llama-3.2-1B's shape (16 layers, hidden 2048, 32 query /
  8 KV heads, FFN 8192, vocabulary 128,256, tied embeddings; 1.24B parameters).
- ``export``: the weight converter on CUDA: ``build_sync_plan`` + ``WeightSyncer``
  (gather + convert) into HF-named tensors, bit-compared with the checkpoint, then
  timed, alone and with a copy into preallocated HF tensors (what a loader does), against
  the floor: the exported bytes read once and written once at the copy bandwidth.
- ``runs``: per activation-recompute mode (none, selective, full) a ``MegatronEngine``
  (TP 1, NCCL world size 1, bf16, distributed optimizer, grad clip 1.0, the NaN check
  in every step) built from that checkpoint, then one warm-up update, ``--steps``
  old-log-prob passes and ``--steps`` updates of one mini-batch (the actor's own
  loss functions: GRPO policy loss, KL loss, entropy metric). Per phase: seconds,
  tokens/s, MFU and ``torch.cuda.max_memory_allocated``; the memory after the build
  and after the first optimizer step (Adam's moments are allocated lazily).
- ``planner``: ``rlhf-megatron plan``'s actor numbers for the same model, batch and
  sequence length, per phase against the measured peaks (ratio = planned / measured).

MFU counts model FLOPs (no recomputation) against the device's dense bf16 peak
(``--peak-tflops``, 989 for an H100 SXM): per token, a forward pass is 2 x the matrix
parameters (every layer's projections and MLP, and the LM head) + 2 x layers x sequence x
attention width (causal attention: QK^T and AV over half the square); an update is 3 x
that. ``mfu_6n`` is the trainer's ``perf/mfu`` rule (6 N per trained token, 2 N per
forward token, all parameters, no attention term).

    bash tools/gpu/run.sh                 # on the GPU machine (see that file)
    .venv/bin/python tools/gpu/measure.py --tiny --out /tmp/m.json   # CPU smoke run

It is also the GPU tools' one measuring module: ``mfu.py`` imports it (``tools/gpu`` on
``sys.path``) for the sections above and for the pieces of a measurement, which live here once:
``Timer``, ``section``, ``write_json``, the random checkpoint (``write_model``), the run config
(``load_config_with``), one engine's step (``build_engine``, ``actor_step``, ``timed``,
``phase_stats``), the planner's side (``actor_plan``, ``add_measured``) and the summary's lines.

Boundaries: measuring only; the engine, the planner and the weight syncer are the package's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Llama-3.2-1B's shape (random weights); --tiny: a model a CPU runs in seconds.
MODELS = {
    "llama-1b": dict(
        layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256, tied=True
    ),
    # Llama-3.2-3B's shape (3.21B parameters).
    "llama-3b": dict(
        layers=28, hidden=3072, heads=24, kv_heads=8, head_dim=128, ffn=8192, vocab=128256, tied=True
    ),
    "tiny": dict(layers=2, hidden=128, heads=2, kv_heads=1, head_dim=64, ffn=256, vocab=1024, tied=True),
    # DeepSeek-V3's layers at a size one GPU trains (issue #54): its multi-latent attention (16
    # heads, V3's query and KV latents 1536 and 512, 128 + 64 query/key and 128 value dimensions),
    # one leading dense layer, then sparse layers of 32 routed experts (top-4, sigmoid router with
    # its score-correction bias) of V2-Lite's width 1408 plus 2 shared; 2.05B parameters, 0.84B
    # of them active per token (0.63B in the matrices it goes through, the LM head's included).
    "deepseek-v3-small": dict(
        family="deepseek_v3",
        layers=6,
        hidden=2048,
        heads=16,
        ffn=10944,
        vocab=102400,
        q_lora=1536,
        kv_lora=512,
        qk_nope=128,
        qk_rope=64,
        v_head=128,
        experts=32,
        top_k=4,
        expert_ffn=1408,
        shared=2,
        dense_layers=1,
    ),
    # Its CPU smoke-run size (``--tiny``): the tiny DeepSeek-V3's attention (``models.tiny.TINY_MLA``).
    "tiny-deepseek-v3": dict(
        family="deepseek_v3",
        layers=2,
        hidden=128,
        heads=4,
        ffn=256,
        vocab=1024,
        q_lora=64,
        kv_lora=32,
        qk_nope=32,
        qk_rope=16,
        v_head=32,
        experts=4,
        top_k=2,
        expert_ffn=64,
        shared=1,
        dense_layers=1,
    ),
}
RECOMPUTE = {  # mode -> MegatronConfig overrides
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


class Timer:
    """Wall-clock seconds of a block, the device synchronised on both sides."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __enter__(self):
        self._sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.seconds = time.perf_counter() - self.start

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()


@contextlib.contextmanager
def section(results: dict, name: str, tag: str = "measure"):
    """Record the block's failure (traceback) under ``results[name]`` instead of stopping the run;
    ``tag`` names the tool in the progress lines."""
    start = time.perf_counter()
    try:
        yield
    except Exception:
        results.setdefault(name, {})
        if not isinstance(results[name], dict):
            results[name] = {"value": results[name]}
        results[name]["error"] = traceback.format_exc()
        print(f"[{tag}] {name} FAILED:\n{results[name]['error']}", file=sys.stderr, flush=True)
    finally:
        print(f"[{tag}] {name}: {time.perf_counter() - start:.1f} s", flush=True)


def gib(x: float) -> float:
    return round(x / 2**30, 3)


def new_results(args) -> dict:
    """The JSON's opening: the arguments (all but ``--out``) and when the run started."""
    return {
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_json(path: Path, results: dict, default=str) -> None:
    """``results`` into ``path`` through a temporary sibling: a run killed mid-write (a long
    measurement on a lent machine) leaves the previous complete file, never half of one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=default))
    os.replace(tmp, path)


def init_one_rank() -> None:
    """torch.distributed and megatron's parallel state for this one process (world size 1)."""
    from rlhf_megatron.platform import init_distributed, init_model_parallel
    from rlhf_megatron.platform.multiproc import find_free_port

    init_distributed(0, 1, "127.0.0.1", find_free_port())
    init_model_parallel(1, 1, seed=1)


def free_memory(cuda: bool) -> None:
    """Collect what the last engine left, so the next one's peak memory is its own."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------- sections
def env_info(cuda: bool) -> dict:
    import megatron.core

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": getattr(megatron.core, "__version__", "?"),
        "transformer_engine": _installed("transformer_engine"),
        "apex": _installed("apex"),
    }
    if cuda:
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, multiprocessors=p.multi_processor_count, memory_gib=gib(p.total_memory))
        with contextlib.suppress(Exception):
            info["nvidia_smi"] = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,clocks.max.sm,power.limit",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
    return info


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def gpu_tests(out_dir: Path) -> dict:
    """``pytest -m gpu tests/gpu`` in its own process; per-test outcomes from its JUnit XML."""
    import xml.etree.ElementTree as ET

    xml = out_dir / "gpu_tests.xml"
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "tests/gpu",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tests = {}
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            failed = case.find("failure") if case.find("failure") is not None else case.find("error")
            skipped = case.find("skipped")
            outcome = "failed" if failed is not None else "skipped" if skipped is not None else "passed"
            tests[case.get("name")] = {"outcome": outcome, "seconds": float(case.get("time", 0))}
            if failed is not None:
                tests[case.get("name")]["message"] = (failed.get("message") or "")[:2000]
    return {
        "returncode": proc.returncode,
        "seconds": round(time.perf_counter() - start, 1),
        "summary": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "",
        "tests": tests,
        "output_tail": (proc.stdout + proc.stderr)[-4000:] if proc.returncode else "",
    }


def ceilings(cuda: bool, repeats: int) -> dict:
    """Copy bandwidth (read + write bytes per second) and bf16 matmul rate, on random data."""
    if not cuda:
        return {"copy_gb_per_s": None, "matmul_tflops": None}
    n = 2**30 // 2  # 1 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = event_median(lambda: dst.copy_(src), repeats)
    size = 8192
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    mm_ms = event_median(lambda: a @ b, repeats)
    return {
        "copy_bytes": 2 * 2 * n,
        "copy_ms": round(copy_ms, 4),
        "copy_gb_per_s": round(2 * 2 * n / copy_ms / 1e6, 1),
        "matmul_shape": [size, size, size],
        "matmul_ms": round(mm_ms, 4),
        "matmul_tflops": round(2 * size**3 / mm_ms / 1e9, 1),
    }


def event_median(fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` on the device (CUDA events), after three unmeasured calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def llama_config(shape: dict, max_positions: int = 8192):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=max_positions,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=shape["tied"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def deepseek_v3_config(shape: dict, max_positions: int = 8192) -> dict:
    """The ``config.json`` of a DeepSeek-V3-family model of ``shape``'s sizes (a ``MODELS`` entry
    with ``family="deepseek_v3"``): DeepSeek-V3's keys, one expert group, no YaRN, no MTP layer."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": shape["vocab"],
        "hidden_size": shape["hidden"],
        "intermediate_size": shape["ffn"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["heads"],
        "q_lora_rank": shape["q_lora"],
        "kv_lora_rank": shape["kv_lora"],
        "qk_nope_head_dim": shape["qk_nope"],
        "qk_rope_head_dim": shape["qk_rope"],
        "v_head_dim": shape["v_head"],
        "head_dim": shape["qk_rope"],
        "n_routed_experts": shape["experts"],
        "num_experts_per_tok": shape["top_k"],
        "moe_intermediate_size": shape["expert_ffn"],
        "n_shared_experts": shape["shared"],
        "first_k_dense_replace": shape["dense_layers"],
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": max_positions,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def write_config(path: Path, shape: dict, max_positions: int = 8192) -> None:
    """``config.json`` alone of a ``MODELS`` entry (the planner needs no weights)."""
    if shape.get("family") == "deepseek_v3":
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(deepseek_v3_config(shape, max_positions), indent=2))
    else:
        llama_config(shape, max_positions).save_pretrained(path)


def write_random_checkpoint(path: Path, config: dict, cuda: bool) -> int:
    """An HF checkpoint of ``config`` with random weights, written tensor by tensor from the
    package's own list of the family's tensors (``models.spec.expected_hf_shapes``), so no
    transformers model class is needed: matrices N(0, 0.02) drawn on the device, norms 1, the
    router's score-correction bias 0. Returns the parameter count."""
    from rlhf_megatron.models.hf_io import SafetensorsShardWriter
    from rlhf_megatron.models.spec import expected_hf_shapes
    from rlhf_megatron.planning.model_arch import ModelArch

    shapes = expected_hf_shapes(ModelArch.from_hf_config(config, source=f"{path}/config.json"))
    dtype = torch.bfloat16 if cuda else torch.float32
    device = "cuda" if cuda else "cpu"
    path.mkdir(parents=True, exist_ok=True)
    writer = SafetensorsShardWriter(path, [(name, shape, dtype) for name, shape in shapes.items()])
    g = torch.Generator(device=device).manual_seed(0)
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=dtype)
        elif len(shape) == 1:
            tensor = torch.zeros(shape, dtype=dtype)
        else:
            tensor = (torch.randn(shape, generator=g, device=device) * 0.02).to(dtype).cpu()
        writer.write(name, tensor)
    writer.close()
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": str(dtype)[6:]}, indent=2))
    return sum(math.prod(shape) for shape in shapes.values())


def write_model(path: Path, shape: dict, cuda: bool, max_positions: int = 8192) -> dict:
    """A random HF checkpoint of a ``MODELS`` entry (bf16 on GPU, fp32 on CPU), std 0.02 as in
    Llama's init: Llama-style through transformers, DeepSeek-V3's family through
    ``write_random_checkpoint``."""
    dtype = torch.bfloat16 if cuda else torch.float32
    with Timer(cuda) as t:
        if shape.get("family") == "deepseek_v3":
            n = write_random_checkpoint(path, deepseek_v3_config(shape, max_positions), cuda)
        else:
            n = _write_llama(path, llama_config(shape, max_positions), dtype, cuda)
    return {
        "path": str(path),
        "shape": shape,
        "parameters": n,
        "dtype": str(dtype),
        "write_s": round(t.seconds, 1),
    }


def _write_llama(path: Path, config, dtype: torch.dtype, cuda: bool) -> int:
    """transformers' Llama of ``config`` with its own random init, saved; returns its parameters."""
    import transformers

    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    del model
    if cuda:
        torch.cuda.empty_cache()
    return n


def flops_per_token(arch, seq: int) -> dict:
    """Forward FLOPs per token: the matrix parameters a token goes through (every layer's
    projections and MLP, and the LM head; of a sparse layer its router, shared experts and top-k
    routed experts) and causal attention (QK^T over the query/key width, AV over the value
    width, half the square each). ``matmul_parameters`` counts those matrices;
    ``forward_6n_rule`` is 2 x the parameters a token activates (all of a dense model's)."""
    from rlhf_megatron.planning.arch import count_parameters

    c = count_parameters(arch)
    h, heads = arch.hidden_size, arch.num_attention_heads
    mla = arch.mla
    if mla is None:
        q, kv = heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        attention = h * (2 * q + 2 * kv)
        qk_width = v_width = arch.head_dim
    else:
        query = heads * mla.q_head_dim
        attention = (h * mla.q_lora_rank + mla.q_lora_rank * query) if mla.q_lora_rank else h * query
        attention += h * (mla.kv_lora_rank + mla.qk_rope_head_dim)  # the latent and the rotary key
        attention += mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        attention += heads * mla.v_head_dim * h  # output projection
        qk_width, v_width = mla.q_head_dim, mla.v_head_dim
    matmul = arch.vocab_size * h
    for layer in range(arch.num_layers):
        matmul += attention
        if arch.is_moe_layer(layer):
            moe = arch.moe
            matmul += moe.num_experts * h + moe.top_k * 3 * h * moe.ffn_hidden_size
            matmul += 3 * h * (moe.shared_expert_ffn_hidden_size or 0)
        else:
            matmul += 3 * h * arch.ffn_hidden_size
    return {
        "parameters": c.total,
        "matmul_parameters": matmul,
        "forward": 2 * matmul + arch.num_layers * seq * heads * (qk_width + v_width),
        "forward_6n_rule": 2 * c.active,
    }


def run_config(args, model_dir: str) -> list[str]:
    """The overrides that describe this measurement as a run config (for the planner)."""
    rows = args.mini_batch
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.max_prompt_length={args.prompt}",
        f"data.max_response_length={args.response}",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        f"trainer.device={'cuda' if args.cuda else 'cpu'}",
        f"trainer.gpu_memory_gb={args.gpu_memory_gb}",
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"data.train_batch_size={rows // args.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={rows // args.n}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={args.micro}",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.optim.clip_grad=1.0",
        "actor_rollout_ref.actor.megatron.params_dtype=bfloat16",
        "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true",
        # what the measured machine builds (and so what the planner should plan): TE where installed
        f"actor_rollout_ref.actor.megatron.transformer_impl={args.transformer_impl}",
        # the measured layers' attention; runs recorded before the key had a default of auto were local
        f"actor_rollout_ref.actor.megatron.attention_backend={getattr(args, 'attention_backend', 'local')}",
    ]


def recompute_overrides(mode: str) -> list[str]:
    """The actor's activation-recompute keys of ``mode`` (``RECOMPUTE``) as config overrides."""
    return [f"actor_rollout_ref.actor.megatron.{key}={value}" for key, value in RECOMPUTE[mode].items()]


def load_config_with(args, model_dir: str, extra: list[str]):
    """The run config of this measurement, with ``extra`` overrides after ``run_config``'s."""
    from rlhf_megatron.planning import load_config

    return load_config(None, [*run_config(args, model_dir), *extra], world_size=1)


def synthetic_batch(args, vocab: int, seed: int) -> dict:
    """``mini_batch`` rows of full length (prompt + response, no padding): the planner's worst
    case, and every token counts for throughput."""
    g = torch.Generator().manual_seed(seed)
    rows, seq = args.mini_batch, args.prompt + args.response
    ids = torch.randint(3, vocab, (rows, seq), generator=g)
    mask = torch.ones(rows, seq, dtype=torch.long)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": torch.arange(seq).expand(rows, seq).contiguous(),
        "responses": ids[:, args.prompt :],
        "response_mask": torch.ones(rows, args.response),
        "old_log_probs": -torch.rand(rows, args.response, generator=g) * 5,
        "ref_log_probs": -torch.rand(rows, args.response, generator=g) * 5,
        "advantages": torch.randn(rows, 1, generator=g).expand(-1, args.response).contiguous(),
    }


def memory_state(cuda: bool) -> dict:
    if not cuda:
        return {}
    return {
        "allocated_gib": gib(torch.cuda.memory_allocated()),
        "reserved_gib": gib(torch.cuda.memory_reserved()),
    }


# ---------------------------------------------------------------------- one engine's step
@dataclasses.dataclass
class ActorStep:
    """One optimizer step's work with the actor's own loss functions (the worker's methods read only
    ``section`` and ``arch``): its micro-batches for the update and for the log-prob pass, the
    tokens they hold and the model's FLOPs per token (``flops_per_token``)."""

    policy_loss: Callable
    log_prob_fn: Callable
    update_micros: list
    forward_micros: list
    tokens: int
    flops: dict


def engine_inputs(args, model_dir: str, overrides: list[str]) -> tuple:
    """(the run config's ``actor_rollout_ref`` section as dataclasses, the checkpoint's arch):
    this measurement's config (``load_config_with``) with ``overrides``."""
    from omegaconf import OmegaConf

    from rlhf_megatron.planning.model_arch import ModelArch

    cfg = load_config_with(args, model_dir, overrides)
    return OmegaConf.to_object(cfg.actor_rollout_ref), ModelArch.from_hf_dir(model_dir)


def build_engine(section_cfg, arch, model_dir: str, cuda: bool) -> tuple:
    """(a ``MegatronEngine`` at TP 1 from the actor's megatron and optim sections, the seconds its
    build took); the device's peak memory counter starts again with it."""
    from rlhf_megatron.models.builder import ParallelConfig
    from rlhf_megatron.workers.megatron_engine import MegatronEngine

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with Timer(cuda) as t:
        engine = MegatronEngine(
            arch,
            ParallelConfig(1),
            model_dir,
            section_cfg.actor.megatron,
            section_cfg.actor.optim,
            total_steps=100,
        )
    return engine, t.seconds


def actor_step(args, section_cfg, arch, batch: dict) -> ActorStep:
    """``batch`` (a ``synthetic_batch``) split into ``args.micro``-row micro-batches, with the actor's
    loss functions."""
    from rlhf_megatron.config.context import RunContext, Seeds
    from rlhf_megatron.data.batch import Batch
    from rlhf_megatron.workers.actor import UPDATE_KEYS, ActorRolloutRefWorker
    from rlhf_megatron.workers.megatron_engine import MODEL_KEYS, split_micro_batches

    # What the loss functions read of a worker: the run context a plain PPO run has (no rollout
    # correction, no distillation), so a new run-level option reaches this script too.
    context = RunContext(seeds=Seeds(0), nan_policy="stop", rollout_n=1, total_steps=1)
    worker = types.SimpleNamespace(section=section_cfg, arch=arch, context=context)
    rows = Batch.from_dict(batch)
    return ActorStep(
        policy_loss=ActorRolloutRefWorker._policy_loss_fn(worker),
        log_prob_fn=ActorRolloutRefWorker._log_prob_fn(worker),
        update_micros=split_micro_batches(rows, (*MODEL_KEYS, *UPDATE_KEYS, "ref_log_probs"), args.micro),
        forward_micros=split_micro_batches(rows, (*MODEL_KEYS, "responses"), args.micro),
        tokens=int(rows["attention_mask"].sum()),
        flops=flops_per_token(arch, args.prompt + args.response),
    )


def timed(fn, n: int, cuda: bool) -> tuple[list[float], list[int], list]:
    """``n`` calls of ``fn``: (seconds, peak allocated bytes on the device, results) per call."""
    seconds, peaks, results = [], [], []
    for _ in range(n):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with Timer(cuda) as t:
            results.append(fn())
        seconds.append(t.seconds)
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated())
    return seconds, peaks, results


def phase_stats(
    seconds: list[float],
    peaks: list[int],
    step: ActorStep,
    passes: int,
    peak_tflops: float,
    six_n: bool = True,
) -> dict:
    """Median seconds, tokens/s, MFU (``passes`` forward passes' FLOPs per token against
    ``peak_tflops``; with ``six_n`` also the trainer's 6N rule) and peak memory of a phase."""
    s = statistics.median(seconds)
    peak = peak_tflops * 1e12
    out = {
        "seconds": [round(x, 4) for x in seconds],
        "median_s": round(s, 4),
        "tokens": step.tokens,
        "tokens_per_s": round(step.tokens / s, 1),
        "mfu": round(passes * step.flops["forward"] * step.tokens / s / peak, 4),
    }
    if six_n:
        out["mfu_6n"] = round(passes * step.flops["forward_6n_rule"] * step.tokens / s / peak, 4)
    out["peak_allocated_bytes"] = max(peaks) if peaks else None
    out["peak_allocated_gib"] = gib(max(peaks)) if peaks else None
    return out


def measure_recompute(args, model_dir: str, mode: str) -> dict:
    """One engine in ``mode``: build, warm-up update, log-prob passes, updates."""
    cuda = args.cuda
    section_cfg, arch = engine_inputs(args, model_dir, recompute_overrides(mode))
    out: dict = {"megatron": {k: v for k, v in RECOMPUTE[mode].items()}}
    engine, build_s = build_engine(section_cfg, arch, model_dir, cuda)
    out["build_s"] = round(build_s, 2)
    out["after_build"] = memory_state(cuda)
    step = actor_step(args, section_cfg, arch, synthetic_batch(args, arch.vocab_size, seed=0))

    def forward_loss(output, micro):
        step.log_prob_fn(output, micro)
        return output.new_zeros(()), {}

    first = engine.train_step(step.update_micros, step.policy_loss, "stop", "[measure] warm-up")
    out["warmup_update_ok"] = bool(first["update_ok"])
    out["after_first_step"] = memory_state(cuda)
    if cuda:
        out["probe"] = probe_memory(
            engine, step.update_micros[:1], step.forward_micros[:1], step.policy_loss, step.log_prob_fn
        )
    seconds, peaks, _ = timed(
        lambda: engine.run(step.forward_micros, forward_loss, forward_only=True), args.steps, cuda
    )
    out["log_prob"] = phase_stats(seconds, peaks, step, passes=1, peak_tflops=args.peak_tflops)
    seconds, peaks, results = timed(
        lambda: engine.train_step(step.update_micros, step.policy_loss, "stop", "[measure]"), args.steps, cuda
    )
    # forward + backward: 3x a forward pass
    out["update"] = phase_stats(seconds, peaks, step, passes=3, peak_tflops=args.peak_tflops)
    out["update"].update(
        micro_batches=len(step.update_micros),
        grad_norms=[round(r["grad_norm"], 4) for r in results],
        update_ok=all(r["update_ok"] for r in results),
    )
    engine = first = results = None  # free the model before the next one is built
    free_memory(cuda)
    if cuda:
        out["after_teardown"] = memory_state(cuda)
    return out


def probe_memory(engine, update_micro, forward_micro, policy_loss, log_prob_fn) -> dict:
    """Where one micro-batch's memory goes (GiB): allocated when the model's output reaches the loss
    (the stored activations + the logits), after the loss, the peak up to there (forward
    transients) and the peak of the whole step (backward); the same for a log-prob pass."""
    probe: dict = {}

    def at_loss(prefix, fn):
        def wrapped(output, micro):
            probe[f"{prefix}_at_output"] = gib(torch.cuda.memory_allocated())
            probe[f"{prefix}_peak_to_output"] = gib(torch.cuda.max_memory_allocated())
            result = fn(output, micro)
            probe[f"{prefix}_after_loss"] = gib(torch.cuda.memory_allocated())
            probe[f"{prefix}_peak_to_loss"] = gib(torch.cuda.max_memory_allocated())
            return result if isinstance(result, tuple) else (output.new_zeros(()), {})

        return wrapped

    torch.cuda.synchronize()
    probe["static"] = gib(torch.cuda.memory_allocated())
    torch.cuda.reset_peak_memory_stats()
    engine.train_step(update_micro, at_loss("update", policy_loss), "stop", "[measure] probe")
    probe["update_peak"] = gib(torch.cuda.max_memory_allocated())
    torch.cuda.reset_peak_memory_stats()
    engine.run(forward_micro, at_loss("log_prob", log_prob_fn), forward_only=True)
    probe["log_prob_peak"] = gib(torch.cuda.max_memory_allocated())
    return probe


# ---------------------------------------------------------------------- the planner's side
def actor_plan(args, model_dir: str, overrides: list[str]) -> tuple:
    """(``rlhf-megatron plan``'s memory plan of this measurement's config with ``overrides`` at
    world size 1, its actor role)."""
    from rlhf_megatron.planning.memory import plan_memory

    plan = plan_memory(load_config_with(args, model_dir, overrides), world_size=1)
    return plan, next(r for r in plan.roles if r.role == "actor")


def add_measured(entry: dict, run: dict, planned: dict[str, int]) -> None:
    """Per phase the run measured (``planned``: phase -> planned bytes, in the JSON's order), the
    measured peak and planned / measured into ``entry``."""
    for phase, nbytes in planned.items():
        measured = run.get(phase, {}).get("peak_allocated_bytes")
        if measured:
            entry[f"{phase}_measured_gib"] = gib(measured)
            entry[f"{phase}_ratio"] = round(nbytes / measured, 3)


def planner(args, model_dir: str, runs: dict) -> dict:
    """The planner's actor numbers per recompute mode, against the measured peaks."""
    from rlhf_megatron.planning.memory import format_plan

    out = {}
    for mode, run in runs.items():
        plan, actor = actor_plan(args, model_dir, recompute_overrides(mode))
        entry = {
            "weights_gib": gib(actor.weights),
            "grads_gib": gib(actor.grads),
            "optimizer_gib": gib(actor.optimizer),
            "activations_gib": gib(actor.activations),
            "logits_gib": gib(actor.logits),
            "forward_activations_gib": gib(actor.forward_activations),
            "forward_logits_gib": gib(actor.forward_logits),
            "log_prob_planned_gib": gib(actor.forward_phase()),
            "update_planned_gib": gib(actor.training_phase()),
        }
        add_measured(entry, run, {"log_prob": actor.forward_phase(), "update": actor.training_phase()})
        out[mode] = entry
        if mode == "none":
            out["plan_text"] = format_plan(plan, title="tools/gpu/measure.py (recompute none)")
    ratios = [v for m in out.values() if isinstance(m, dict) for k, v in m.items() if k.endswith("_ratio")]
    if ratios:
        out["worst_ratio"] = max(ratios, key=lambda r: abs(r - 1))
        out["within_15_percent"] = all(0.85 <= r <= 1.15 for r in ratios)
    return out


def weight_export(args, model_dir: str) -> dict:
    """Plan + gather + convert into HF-named tensors on the device: checked against the checkpoint,
    then timed (alone, and with a copy into preallocated HF tensors) against the copy floor."""
    from rlhf_megatron.config.schema import MegatronConfig
    from rlhf_megatron.models.builder import ParallelConfig
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import ParallelGroups, ParallelInfo
    from rlhf_megatron.weights import TrainLayout, WeightSyncer, build_sync_plan
    from rlhf_megatron.workers.megatron_engine import MegatronEngine

    cuda = args.cuda
    arch = ModelArch.from_hf_dir(model_dir)
    engine = MegatronEngine(arch, ParallelConfig(1), model_dir, MegatronConfig(params_dtype="bfloat16"))
    info = ParallelInfo.current()
    with Timer(cuda) as t_plan:
        plan = build_sync_plan(arch, TrainLayout.of(info), 1, "hf", args.bucket_mb * 2**20, dtype_bytes=2)
    syncer = WeightSyncer.of(plan, engine.chunks, info, ParallelGroups.current())
    out = {"plan_s": round(t_plan.seconds, 4), "buckets": len(plan.buckets), "bucket_mb": args.bucket_mb}
    out.update(check_export(syncer, model_dir, cuda))

    def export():
        for _ in syncer.iter_weights():
            pass

    dest = {}
    for name, tensor in syncer.iter_weights():
        dest[name] = torch.empty_like(tensor)

    def export_and_copy():
        for name, tensor in syncer.iter_weights():
            dest[name].copy_(tensor, non_blocking=True)

    for label, fn in (("export", export), ("export_and_copy", export_and_copy)):
        fn()  # warm-up
        times, _, _ = timed(fn, args.steps, cuda)
        out[f"{label}_s"] = round(statistics.median(times), 5)
        out[f"{label}_phases"] = {k: round(v, 5) for k, v in syncer.stats.items() if k.endswith("_s")}
    engine = syncer = dest = None
    free_memory(cuda)
    return out


def check_export(syncer, model_dir: str, cuda: bool) -> dict:
    """Correctness: every exported tensor equals the checkpoint's, bit for bit, on the device."""
    from safetensors import safe_open

    mismatched, names, nbytes, off_device = [], [], 0, []
    files = sorted(Path(model_dir).glob("*.safetensors"))
    handles = [safe_open(str(f), "pt", device="cuda" if cuda else "cpu") for f in files]
    index = {k: h for h in handles for k in h.keys()}  # noqa: SIM118 (a safetensors handle is not iterable)
    for name, tensor in syncer.iter_weights():
        names.append(name)
        nbytes += tensor.numel() * tensor.element_size()
        if tensor.device.type != ("cuda" if cuda else "cpu"):
            off_device.append(name)
        expected = index[name].get_tensor(name).to(tensor.device, tensor.dtype) if name in index else None
        if expected is None or not torch.equal(tensor, expected):
            mismatched.append(name)
    return {
        "tensors": len(names),
        "bytes": nbytes,
        "gib": gib(nbytes),
        "mismatched": mismatched,
        "missing": sorted(set(index) - set(names)),
        "off_device": off_device,
    }


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, with ``--tiny``'s or the 1B model's defaults filled in (``--replan`` needs none)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch (CPU smoke run)")
    parser.add_argument("--model", default=None, choices=sorted(MODELS))
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens per row")
    parser.add_argument("--response", type=int, default=None, help="response tokens per row")
    parser.add_argument("--mini-batch", type=int, default=None, help="rows per optimizer step")
    parser.add_argument("--micro", type=int, default=None, help="rows per micro-batch")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (rollout.n)")
    parser.add_argument("--steps", type=int, default=3, help="timed repeats per phase")
    parser.add_argument("--recompute", nargs="*", default=list(RECOMPUTE), choices=list(RECOMPUTE))
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the device")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=("auto", "local", "sdpa"),
        help="megatron.attention_backend",
    )
    parser.add_argument(
        "--replan",
        action="store_true",
        help="recompute only the planner section of an existing --out JSON (CPU is enough: the planner is "
        "arithmetic on the config) against the memory measured in it, e.g. after a planner change",
    )
    args = parser.parse_args(argv)
    if args.replan:
        return args
    defaults = (
        dict(model="tiny", prompt=32, response=32, mini_batch=8, micro=2)
        if args.tiny
        else dict(model="llama-1b", prompt=1024, response=1024, mini_batch=16, micro=2)
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.cuda = torch.cuda.is_available()
    args.transformer_impl = "transformer_engine" if _installed("transformer_engine") else "local"
    if not args.cuda and not args.tiny:
        parser.error("no CUDA device here: run on the GPU machine (tools/gpu/run.sh), or pass --tiny")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replan:
        return replan(Path(args.out))
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results = new_results(args)

    def save():
        write_json(out_path, results)

    with section(results, "env"):
        results["env"] = env_info(args.cuda)
    if not args.skip_tests:
        with section(results, "gpu_tests"):
            results["gpu_tests"] = gpu_tests(out_path.parent)
        save()
    with section(results, "ceilings"):
        results["ceilings"] = ceilings(args.cuda, repeats=20)

    from rlhf_megatron.platform import destroy_distributed

    init_one_rank()
    results["env"]["backend"] = torch.distributed.get_backend()
    results["env"]["deterministic_algorithms"] = torch.are_deterministic_algorithms_enabled()
    with tempfile.TemporaryDirectory(prefix="measure_model_") as tmp:
        measure_model(args, str(Path(tmp) / "model"), results, save)
    destroy_distributed()
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    print(summary(results), flush=True)
    return 0


def measure_model(args, model_dir: str, results: dict, save) -> None:
    """The sections on one random checkpoint in ``model_dir``: model, export, runs and planner,
    ``save()``-d as they complete."""
    from rlhf_megatron.planning.model_arch import ModelArch

    with section(results, "model"):
        results["model"] = write_model(Path(model_dir), MODELS[args.model], args.cuda)
        results["model"]["flops_per_token"] = flops_per_token(
            ModelArch.from_hf_dir(model_dir), args.prompt + args.response
        )
    save()
    with section(results, "export"):
        results["export"] = weight_export(args, model_dir)
        # The floor: the exported bytes read once and written once at the measured copy bandwidth.
        floor = (
            results["export"]["bytes"] * 2 / (results["ceilings"].get("copy_gb_per_s") or float("nan")) / 1e9
        )
        results["export"]["floor_s"] = round(floor, 5)
        for label in ("export", "export_and_copy"):
            results["export"][f"{label}_over_floor"] = round(results["export"][f"{label}_s"] / floor, 2)
    save()
    results["runs"] = {}
    for mode in args.recompute:
        with section(results["runs"], mode):
            results["runs"][mode] = measure_recompute(args, model_dir, mode)
        save()
    with section(results, "planner"):
        results["planner"] = planner(args, model_dir, results["runs"])


def replan(path: Path) -> int:
    """The planner section of ``path`` recomputed by this checkout's planner, against the peaks
    measured in the same file; the section records when and that it was recomputed."""
    results = json.loads(path.read_text())
    args = argparse.Namespace(**results["args"])
    args.cuda = results["args"].get("cuda", True)
    args.transformer_impl = "transformer_engine" if results["env"].get("transformer_engine") else "local"
    with tempfile.TemporaryDirectory(prefix="replan_") as tmp:
        write_config(Path(tmp), results["model"]["shape"])  # config.json only: no weights
        results["planner"] = planner(args, tmp, results["runs"])
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    results["planner"]["recomputed"] = {
        "at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "commit": commit,
        "how": "tools/gpu/measure.py --replan: this checkout's planner against the memory measured in this file",
    }
    write_json(path, results)
    print(summary(results), flush=True)
    return 0


# ---------------------------------------------------------------------- the summary
def device_line(results: dict) -> str:
    env = results.get("env", {})
    return f"device {env.get('device', 'cpu')}  torch {env.get('torch')}  megatron-core {env.get('megatron_core')}"


def ceilings_line(results: dict) -> str:
    c = results.get("ceilings", {})
    return f"ceilings: copy {c.get('copy_gb_per_s')} GB/s, bf16 matmul {c.get('matmul_tflops')} TFLOP/s"


def phase_line(stats: dict) -> str:
    """A phase's ``phase_stats`` in a summary line."""
    return (
        f"{stats['median_s']:.3f} s {stats['tokens_per_s']:.0f} tok/s MFU {stats['mfu']:.3f} "
        f"peak {stats['peak_allocated_gib']} GiB"
    )


def summary(results: dict) -> str:
    lines = ["", "== summary ==", device_line(results)]
    tests = results.get("gpu_tests", {})
    if tests:
        lines.append(f"gpu tests: {tests.get('summary')}")
    lines.append(ceilings_line(results))
    e = results.get("export", {})
    if "export_s" in e:
        lines.append(
            f"export: {e['gib']} GiB, {e['export_s']} s ({e['export_over_floor']}x floor), with copy "
            f"{e['export_and_copy_s']} s ({e['export_and_copy_over_floor']}x), mismatched {len(e['mismatched'])}"
        )
    plan = results.get("planner", {})
    for mode, run in results.get("runs", {}).items():
        if "update" not in run:
            lines.append(f"{mode}: {run.get('error', '?')[-300:]}")
            continue
        u, f, p = run["update"], run["log_prob"], plan.get(mode, {})
        lines.append(
            f"{mode:9s} update {phase_line(u)} (plan {p.get('update_planned_gib')}, ratio {p.get('update_ratio')}) | "
            f"log-prob {phase_line(f)} (plan {p.get('log_prob_planned_gib')}, ratio {p.get('log_prob_ratio')})"
        )
    errors = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    if errors:
        lines.append(f"sections with errors: {errors}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
