"""The cluster presets' ``parallelism: auto`` variants (``configs/models/<name>_auto.yaml``): each
is its preset with ``configs/overlays/auto.yaml`` layered last, one of them loads through the search
to a layout that fits, and the README's table is the one ``tools/auto_presets.py`` printed."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

from omegaconf import OmegaConf

from rlhf_megatron.config.auto_keys import LAYOUT_KEYS
from rlhf_megatron.config.presets import CONFIGS_DIR, read_preset_layers
from rlhf_megatron.planning import load_config
from rlhf_megatron.planning.auto_layout import describe_values

ROOT = CONFIGS_DIR.parent
MODELS = CONFIGS_DIR / "models"
OVERLAY = CONFIGS_DIR / "overlays" / "auto.yaml"


def _tool():
    spec = importlib.util.spec_from_file_location("auto_presets", ROOT / "tools" / "auto_presets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_cluster_preset_has_an_auto_variant_of_its_own_layers_and_the_overlay():
    hand = sorted(p.stem for p in MODELS.glob("*.yaml") if not p.stem.endswith("_auto"))
    assert _tool().variants() == hand
    for name in hand:
        layers = [Path(source) for source, _ in read_preset_layers(f"models/{name}_auto")]
        own = [Path(source) for source, _ in read_preset_layers(f"models/{name}")]
        assert layers == [*own, OVERLAY, MODELS / f"{name}_auto.yaml"], name
        assert read_preset_layers(f"models/{name}_auto")[-1][1] == {}, f"{name}_auto adds nothing of its own"


def test_an_auto_variant_searches_the_layout_and_loads_without_warnings():
    searches = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config("models/qwen2.5_7b_auto", [], on_search=searches.append)
    [search] = searches
    actor_tp = "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"
    assert actor_tp in search.keys and "actor_rollout_ref.rollout.tensor_model_parallel_size" in search.keys
    # GRPO-less PPO without a KL term: no reference model, so its micro-batch is not searched.
    assert "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu" not in search.keys
    chosen = search.ranked[0]
    assert chosen.fits and chosen.peak_gib <= cfg.trainer.gpu_memory_gb
    for key in LAYOUT_KEYS:
        if key in chosen.values:
            assert OmegaConf.select(cfg, key) == chosen.values[key]
    # Tensor parallelism stays inside a node.
    assert all(c.values[actor_tp] <= cfg.trainer.n_gpus_per_node for c in search.ranked + search.too_big)
    # The choice the committed table shows is what the search picks today.
    rows = {r["preset"]: r for r in json.loads((ROOT / "docs" / "auto_presets.json").read_text())["rows"]}
    assert rows["models/qwen2.5_7b_auto"]["chosen"] == describe_values(chosen.values)


def test_the_readme_shows_the_committed_choices_of_every_variant():
    tool = _tool()
    report = json.loads((ROOT / "docs" / "auto_presets.json").read_text())
    assert [r["preset"] for r in report["rows"]] == [f"models/{n}_auto" for n in tool.variants()]
    assert tool.markdown(report["rows"]) in (ROOT / "docs" / "guides" / "models.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for row in report["rows"]:
        assert f"`{row['preset']}`" in readme, row["preset"]
