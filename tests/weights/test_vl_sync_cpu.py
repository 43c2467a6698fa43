"""Weight sync of a vision-language actor on real megatron-core (gloo): the ``hf``-format stream.

Qwen2.5-VL at TP2 x PP2 and at PP2 x VPP2 (the tower on the first virtual chunk of stage 0):
every rank receives every HF tensor (vision tower, merger, language model) exactly once, and
each is bit-identical to the checkpoint the actor was loaded from (fp32), whatever stage or
TP rank held it.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlhf_megatron.models.tiny import make_tiny_qwen2_5_vl
from rlhf_megatron.platform.multiproc import run_on_ranks

pytestmark = pytest.mark.slow


def _stream(rank, world_size, hf_dir, layouts, rollout_tp):
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import ParallelGroups, init_model_parallel
    from rlhf_megatron.weights import CollectiveTransport, TrainLayout, WeightSyncer, build_sync_plan

    arch = ModelArch.from_hf_dir(hf_dir)
    reference = load_file(f"{hf_dir}/model.safetensors")
    out = {}
    for tp, pp, vpp in layouts:
        info = init_model_parallel(tp, pp, vpp)
        chunks = build_gpt_model(arch, ParallelConfig(tp, pp, vpp), init_weights=False)
        load_hf_weights(chunks, hf_dir, arch)
        groups = ParallelGroups.current()
        plan = build_sync_plan(
            arch, TrainLayout(tp, pp, vpp), rollout_tp, "hf", bucket_bytes=1 << 16, dtype_bytes=4
        )
        transport = CollectiveTransport(groups.tp_group, tp, groups.pp_group, groups.pp_ranks)
        syncer = WeightSyncer(
            plan, chunks, info.tp_rank, info.pp_rank, transport, rollout_rank=rank % rollout_tp
        )
        names, mismatch = [], []
        for name, tensor in syncer.iter_weights():
            names.append(name)
            if name not in reference or not torch.equal(tensor, reference[name]):
                mismatch.append(name)
        out[(tp, pp, vpp)] = {
            "missing": sorted(set(reference) - set(names)),
            "duplicates": len(names) - len(set(names)),
            "mismatch": mismatch,
            "vision": sum(n.startswith("visual.") for n in names),
        }
    return out


def test_hf_stream_equals_the_checkpoint_at_tp2pp2_and_with_vpp(tmp_path):
    hf_dir = make_tiny_qwen2_5_vl(tmp_path / "vl", num_layers=4)
    layouts = [(2, 2, None), (1, 2, 2)]
    results = run_on_ranks(_stream, 4, str(hf_dir), layouts, 2, timeout_s=600)
    vision = len([n for n in load_file(f"{hf_dir}/model.safetensors") if n.startswith("visual.")])
    for rank, per_layout in enumerate(results):
        assert set(per_layout) == set(layouts)
        for layout, r in per_layout.items():
            assert r["missing"] == [] and r["duplicates"] == 0 and r["mismatch"] == [], (rank, layout, r)
            assert r["vision"] == vision > 20, (rank, layout)
