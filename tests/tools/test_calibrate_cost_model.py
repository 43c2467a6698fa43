"""tools/calibrate_cost_model.py's fit: the probe prices the hardware features, least squares the rest;
from phase times made with known constants it recovers them (where the layouts tell them apart), the
phase times and the layouts' order (no runs)."""

import importlib.util
import warnings
from pathlib import Path

import pytest

from rlhf_megatron.config import load_config
from rlhf_megatron.config.cost_model import phase_features

TOOL = Path(__file__).resolve().parents[2] / "tools" / "calibrate_cost_model.py"


def _tool():
    spec = importlib.util.spec_from_file_location("calibrate_cost_model", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fit_recovers_known_constants_and_the_order():
    tool = _tool()
    probe = {"matmul_flops_per_s": 2e10, "allreduce_latency_s": 2e-4, "allreduce_bytes_per_s": 1e9}
    truth = {
        "forward": {"layer_passes": 1e-3, "collectives": 5e-4, "fixed": 0.01},
        "update": {"layer_passes": 3e-3, "collectives": 1e-3, "fixed": 0.02},
        "gen": {"engine_steps": 0.01, "engine_collectives": 4e-4, "fixed": 0.1},
        "sync_weights": {"reshards": 0.05, "fixed": 0.01},
    }
    runs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, overrides in tool.LAYOUTS.items():
            feats = phase_features(load_config("quickstart_cpu", ["parallelism=manual", *overrides]))
            seconds = {
                g: {
                    **c,
                    **{k: v for k, v in tool.fit(probe, {}).get(g, {}).items() if k in tool.FIXED_BY_PROBE},
                }
                for g, c in truth.items()
            }
            measured = tool.predict(seconds, feats)
            measured["step"] = sum(measured.values()) + 0.05
            runs[name] = (measured, feats)
    fitted = tool.fit(probe, runs)
    assert fitted["update"]["flops"] == pytest.approx(5e-11)  # the probe's, not fitted
    assert fitted["update"]["layer_passes"] == pytest.approx(3e-3, rel=1e-3)
    assert fitted["forward"]["collectives"] == pytest.approx(5e-4, rel=1e-3)
    # Two rollout layouts cannot separate vLLM's three constants; the fit must still reproduce them.
    for measured, feats in runs.values():
        assert tool.predict(fitted, feats)["gen"] == pytest.approx(measured["gen"], rel=1e-6)
    assert fitted["step"]["fixed"] == pytest.approx(0.05)
    totals = {n: sum(tool.predict(fitted, f).values()) for n, (_, f) in runs.items()}
    measured = {n: m["step"] for n, (m, _) in runs.items()}
    assert sorted(totals, key=totals.get) == sorted(measured, key=measured.get)
