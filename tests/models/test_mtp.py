"""``models/mtp.py``: a GLM-4.5 checkpoint's next-token-prediction layer is announced as untrained
on stderr, kept as stored beside a model checkpoint, and found there for the export. (The
conversion round trip that writes it back is in ``test_moe_convert.py``.)"""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.models.hf_io import HFCheckpoint
from rlhf_megatron.models.mtp import (
    MTP_DIR,
    mtp_tensor_names,
    save_mtp_tensors,
    saved_mtp,
    warn_untrained_mtp,
)
from rlhf_megatron.planning.model_arch import ModelArch

from . import tiny_moe


@pytest.fixture(scope="module")
def glm_with_mtp(tmp_path_factory):
    hf = tiny_moe.make_model_dir(tmp_path_factory.mktemp("mtp"), "glm4_moe", hidden_size=128, num_heads=2)
    return hf, tiny_moe.add_mtp_layer(hf)


def test_mtp_tensors_are_announced_as_untrained(glm_with_mtp, capsys):
    hf, mtp = glm_with_mtp
    arch = ModelArch.from_hf_dir(hf)
    assert arch.num_layers == 2 and arch.mtp_layers == 1
    names = warn_untrained_mtp(HFCheckpoint(hf), arch)
    assert names == sorted(mtp) == mtp_tensor_names(HFCheckpoint(hf), arch)
    err = capsys.readouterr().err
    assert f"{len(mtp)} tensor(s) of layer(s) [2]" in err and "NOT trained" in err and MTP_DIR in err


def test_mtp_tensors_are_kept_as_stored(glm_with_mtp, tmp_path):
    hf, mtp = glm_with_mtp
    arch = ModelArch.from_hf_dir(hf)
    assert save_mtp_tensors(hf, arch, tmp_path) == tmp_path / MTP_DIR
    kept = saved_mtp(tmp_path)
    assert sorted(kept.names()) == sorted(mtp)
    for name, t in mtp.items():
        assert kept.dtype(name) == t.dtype and torch.equal(kept.read(name), t), name  # bf16 stays bf16


def test_a_checkpoint_without_mtp_tensors_keeps_nothing(glm_with_mtp, tmp_path, capsys):
    hf, _ = glm_with_mtp
    arch = ModelArch.from_hf_dir(hf)
    deeper = ModelArch.from_dict({**arch.to_dict(), "num_layers": 3})  # layer 2 is a decoder layer now
    assert warn_untrained_mtp(HFCheckpoint(hf), deeper) == [] and capsys.readouterr().err == ""
    assert save_mtp_tensors(hf, deeper, tmp_path) is None and saved_mtp(tmp_path) is None
    (tmp_path / "config-only").mkdir()
    assert save_mtp_tensors(tmp_path / "config-only", arch, tmp_path) is None
