"""torchvision's Python parts beside CPU torch: define its operator schemas when its kernels cannot load.

Why: vLLM's Qwen2.5-VL and transformers' Qwen2-VL processors import torchvision (for
the video processor and its transforms), and the only torchvision on PyPI that matches
torch 2.13 (0.28.0) is built against CUDA torch. On a CPU-only torch its ``_C`` library
fails to load, its kernels are never registered, and ``import torchvision`` then dies in
``torchvision/_meta_registrations.py`` with "operator torchvision::nms does not exist",
because that module registers fake (meta) kernels for ops whose schemas nobody defined.

What: ``define_torchvision_ops()`` defines those schemas (the strings torchvision's C++
registers) with ``torch.library`` when torchvision's own library does not load, so the
import succeeds. Nothing here implements a kernel: calling ``torchvision.ops.nms`` on CPU
still fails, loudly. The image processing this project relies on (resizing, rescaling,
patchifying in transformers' Qwen2-VL image processor) uses PIL and numpy, none of these ops.

How it reaches every process: ``scripts/setup_env.sh`` writes a ``.pth`` file into the
virtual environment that runs ``rlhf_megatron._startup.install()`` at interpreter start.
That installs an import hook which calls ``define_torchvision_ops()`` the first time any
process (the driver, Ray workers, vLLM's model-inspection subprocess) imports torchvision,
so the fix does not depend on who imports it first. On a GPU image, where torchvision's
library loads, it does nothing.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

logger = logging.getLogger(__name__)

# torchvision 0.28's operator schemas (torchvision/csrc/ops/*.cpp, TORCH_LIBRARY_FRAGMENT).
TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float input_scale, int input_zero_point, float rois_scale, "
    "int rois_zero_point, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, "
    "SymInt width) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
    "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, "
    "SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, "
    "Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, "
    "SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor)",
    "box_iou_rotated(Tensor boxes1, Tensor boxes2) -> Tensor",
)

_library: torch.library.Library | None = None  # kept alive: the schemas live as long as it does


def _torchvision_kernels_load() -> bool:
    """Whether torchvision's compiled library loads beside this torch (it then defines the ops)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    for directory in spec.submodule_search_locations:
        for name in os.listdir(directory):
            if name.startswith("_C") and name.endswith((".so", ".pyd")):
                try:
                    torch.ops.load_library(os.path.join(directory, name))
                    return True
                except (OSError, RuntimeError):
                    return False
    return False


def define_torchvision_ops() -> bool:
    """Define torchvision's operator schemas unless its own library provides them.

    Returns True when the schemas were defined here. Idempotent.
    """
    global _library
    if _library is not None or hasattr(torch.ops.torchvision, "nms"):
        return False
    if _torchvision_kernels_load():
        return False
    _library = torch.library.Library("torchvision", "DEF")
    for schema in TORCHVISION_SCHEMAS:
        _library.define(schema)
    logger.debug(
        "torchvision's kernels do not load beside this torch; defined its %d op schemas",
        len(TORCHVISION_SCHEMAS),
    )
    return True
