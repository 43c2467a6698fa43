"""A run's checkpoints share one copy of the next-token-prediction layers and still export them.

A tiny GLM-4.5 with an MTP layer is saved twice the way a trainer saves (``save_model_checkpoint``
with the run's ``mtp_store``, as ``MegatronRoleWorker`` passes it): both checkpoints' ``mtp_layers/``
files are the store's (hard links) and are read to be hashed only at the first save, the first
checkpoint is pruned, and the second still holds the
MTP tensors bit-exact (what ``mcore-to-hf`` writes back: ``saved_mtp``, tested through the converter
in ``test_moe_convert.py``).
"""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch

from rlhf_megatron.models.checkpoint import read_checkpoint_metadata
from rlhf_megatron.models.mtp import MTP_DIR, MTP_STORE, saved_mtp
from rlhf_megatron.platform.multiproc import run_on_ranks

from . import tiny_moe

pytestmark = pytest.mark.slow


def _save_twice(rank, world, hf, root):
    from pathlib import Path

    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.checkpoint import save_model_checkpoint
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import init_model_parallel

    init_model_parallel(1, 1, seed=1)
    arch, parallel = ModelArch.from_hf_dir(hf), ParallelConfig()
    chunks = build_gpt_model(arch, parallel, params_dtype=torch.float32, init_weights=False)
    load_hf_weights(chunks, hf, arch)
    store = Path(root) / MTP_STORE / "actor.actor"
    from rlhf_megatron.platform import digests

    read, real = [], digests.file_sha256
    digests.file_sha256 = lambda path: (read.append(str(path)), real(path))[1]
    mtp_files_read = []
    for step in (1, 2):
        read.clear()
        save_model_checkpoint(
            chunks,
            Path(root) / f"global_step_{step}" / "actor" / "model",
            arch,
            parallel,
            hf_dir=hf,
            mtp_store=store,
        )
        mtp_files_read.append(sum(f"/{MTP_DIR}/" in path for path in read))
    return mtp_files_read


def test_a_trainers_checkpoints_link_one_mtp_copy_that_outlives_pruning(tmp_path):
    hf = tiny_moe.make_model_dir(tmp_path, "glm4_moe", hidden_size=128, num_heads=2)
    mtp = tiny_moe.add_mtp_layer(hf)
    root = tmp_path / "ckpts"
    (mtp_files_read,) = run_on_ranks(_save_twice, 1, str(hf), str(root), timeout_s=300)
    store = root / MTP_STORE / "actor.actor"
    kept = [root / f"global_step_{s}" / "actor" / "model" / MTP_DIR for s in (1, 2)]
    for directory in kept:
        assert {p.name: p.stat().st_ino for p in directory.iterdir()} == {
            p.name: p.stat().st_ino for p in store.iterdir()
        }
    # The linked files are read to hash them once, at the first save; the second reuses the digests,
    # which are the files' own.
    assert mtp_files_read == [len(list(store.iterdir())), 0]
    meta = read_checkpoint_metadata(kept[1].parent)
    for f in kept[1].iterdir():
        assert meta.files[f"{MTP_DIR}/{f.name}"] == hashlib.sha256(f.read_bytes()).hexdigest()
    shutil.rmtree(root / "global_step_1")  # pruned
    # What mcore-to-hf writes back (its MTP path is tested in test_moe_convert.py) is saved_mtp's.
    out = saved_mtp(kept[1].parent)
    assert sorted(out.names()) == sorted(mtp)
    for name, t in mtp.items():
        assert out.dtype(name) == t.dtype and torch.equal(out.read(name), t), name
