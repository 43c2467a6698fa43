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
    assert set(runs) == {"base", "after_rows"}
    for run in runs.values():
        assert "error" not in run, run.get("error")
        assert run["warmup_update_ok"] and run["update"]["update_ok"] and run["update"]["tokens"] == 8 * 64
    assert runs["base"]["deterministic"] is True  # the baseline asks for deterministic algorithms
    assert runs["after_rows"]["fused_adam_optimizers"] == 1
    assert result["env"]["deterministic_after_init"] is True  # the CPU default
    assert set(result["planner"]) == {"base", "after_rows"}
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
    assert json.loads(out.read_text())["planner"]["base"]["update_planned_gib"] > 0
