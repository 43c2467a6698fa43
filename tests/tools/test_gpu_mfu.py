"""tools/gpu/mfu.py on CPU: the kernel categories of its profile table, and its --tiny smoke run
(real megatron-core over gloo) with --replan."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "gpu"))

import mfu  # noqa: E402


def test_kernel_categories_and_table():
    names = {
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7": "attention (fused)",
        "void at::native::elementwise_kernel<128, 2, gpu_kernel_impl_nocast<CUDAFunctor_add<float>>>": "elementwise",
        "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda>": "copy / fill",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "copy / fill",
        "multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>": "optimizer",
        "triton_poi_fused_add_cat_mul_rsub_sigmoid_silu_split_0": "compiled (triton)",
        "cunn_SoftMaxBackwardSmem<4, float, float, float>": "softmax",
        "ncclDevKernel_AllReduce_Sum_f32": "nccl",
    }
    for name, category in names.items():
        assert mfu.kernel_category(name) == category, name
    table = mfu.kernel_table(
        [("nvjet_a", 300.0), ("nvjet_a", 100.0), ("FillFunctor<float>", 100.0)], wall_s=0.001
    )
    assert table["kernel_ms"] == 0.5 and table["gpu_busy"] == 0.5
    assert table["categories"]["matmul"] == {"ms": 0.4, "share": 0.8}
    assert table["top_kernels"][0] == {"name": "nvjet_a", "category": "matmul", "calls": 2, "ms": 0.4}


def test_mfu_script_tiny_on_cpu(tmp_path):
    out = tmp_path / "mfu.json"
    proc = subprocess.run(
        [
            sys.executable,
            "tools/gpu/mfu.py",
            "--tiny",
            "--steps",
            "1",
            "--only",
            "base",
            "after_rows",
            "mla_moe",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["variants"]
    assert set(runs) == {"base", "after_rows", "mla_moe"}
    for run in runs.values():
        assert "error" not in run, run.get("error")
        assert run["warmup_update_ok"] and run["update"]["update_ok"] and run["update"]["tokens"] == 8 * 64
    # DeepSeek-V3's layers ran on their CPU stand-in, a checkpoint written without transformers.
    assert set(result["models"]) == {"tiny", "tiny-deepseek-v3"}
    assert result["models"]["tiny-deepseek-v3"]["parameters"] == 587_076
    assert runs["base"]["deterministic"] is True  # the baseline asks for deterministic algorithms
    assert runs["after_rows"]["fused_adam_optimizers"] == 1
    assert result["env"]["deterministic_after_init"] is True  # the CPU default
    assert set(result["planner"]) == {"base", "after_rows", "mla_moe"}
    result["planner"] = {}
    out.write_text(json.dumps(result))
    replan = subprocess.run(
        [sys.executable, "tools/gpu/mfu.py", "--replan", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert replan.returncode == 0, replan.stderr[-3000:]
    planned = json.loads(out.read_text())["planner"]
    assert planned["base"]["update_planned_gib"] > 0 and planned["mla_moe"]["update_planned_gib"] > 0


def test_flops_per_token_counts_mla_and_the_experts_a_token_goes_through():
    """By hand: the 1.24B Llama as every earlier GPU JSON counted it, and the tiny DeepSeek-V3
    (query latent 64, KV latent 32 + rotary 16, 4 heads of 32 + 16 / 32, layer 0 dense, layer 1
    of 4 experts of 64, top 2, one shared)."""
    from rlhf_megatron.planning.model_arch import ModelArch

    measure = mfu.measure
    llama = ModelArch.from_hf_config(measure.llama_config(measure.MODELS["llama-1b"]).to_dict())
    per_layer = 2048 * (2 * 2048 + 2 * 512) + 3 * 2048 * 8192
    matmul = 16 * per_layer + 128256 * 2048
    assert measure.flops_per_token(llama, 2048)["forward"] == 2 * matmul + 2 * 16 * 2048 * 2048

    arch = ModelArch.from_hf_config(measure.deepseek_v3_config(measure.MODELS["tiny-deepseek-v3"]))
    attention = 128 * 64 + 64 * 4 * 48 + 128 * (32 + 16) + 32 * 4 * (32 + 32) + 4 * 32 * 128
    dense, sparse = 3 * 128 * 256, 4 * 128 + 2 * 3 * 128 * 64 + 3 * 128 * 64
    flops = measure.flops_per_token(arch, 2048)
    assert flops["matmul_parameters"] == 2 * attention + dense + sparse + 1024 * 128
    # QK^T over 48 dimensions a head, AV over 32, half the square each, in both layers.
    assert flops["forward"] == 2 * flops["matmul_parameters"] + 2 * 2048 * 4 * (48 + 32)
    assert flops["forward_6n_rule"] < 2 * flops["parameters"]  # 2 of the 4 experts active
