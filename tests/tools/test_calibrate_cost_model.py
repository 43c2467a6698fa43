"""tools/calibrate_cost_model.py's fit: the probe prices the hardware features, least squares the rest;
from phase times made with known constants it recovers them (where the layouts tell them apart), the
phase times and the layouts' order (no runs)."""

import importlib.util
import warnings
from pathlib import Path

import pytest

from rlhf_megatron.planning import load_config
from rlhf_megatron.planning.cost_model import phase_features

TOOL = Path(__file__).resolve().parents[2] / "tools" / "calibrate_cost_model.py"


def _tool():
    spec = importlib.util.spec_from_file_location("calibrate_cost_model", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fit_recovers_known_constants_and_the_order():
    tool = _tool()
    probe = {
        "matmul_flops_per_s": 2e10,
        "allreduce_latency_s": 2e-4,
        "allreduce_bytes_per_s": 1e9,
        "sharded_bytes_per_s": 5e8,
    }
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


def test_check_compares_fresh_runs_with_the_stored_predictions(tmp_path, monkeypatch):
    """``--check``: no fit; each layout's fastest round against what the stored constants
    predict for its config, both orders and the pairs ordered alike."""
    import json

    tool = _tool()
    layouts = ["tp1_dp2_vllm_tp1", "tp2_sp_vllm_tp2", "tp1_dp2_vllm_tp1_micro8"]
    steps = {
        "tp1_dp2_vllm_tp1": [0.40, 0.44],
        "tp2_sp_vllm_tp2": [0.90, 0.80],
        "tp1_dp2_vllm_tp1_micro8": [0.50, 0.70],
    }

    def fake_run(name, overrides, steps_, out):
        run_dir = out / name
        run_dir.mkdir(parents=True)
        (run_dir / "overrides.json").write_text(json.dumps(overrides))
        return run_dir

    monkeypatch.setattr(tool, "run_layout", fake_run)
    monkeypatch.setattr(
        tool,
        "measured_phases",
        lambda run_dir, warmup: {"step": steps[run_dir.name][int(run_dir.parent.name[-1])]},
    )
    constants = tmp_path / "cpu.json"
    constants.write_text(
        json.dumps(
            {
                "device": "cpu",
                "source": "test",
                "seconds": {"update": {"layer_passes": 1e-3, "collectives": 1e-2}},
            }
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = tool.check(constants, layouts, 15, 3, 2, tmp_path / "runs")
    assert result["layouts"]["tp1_dp2_vllm_tp1"]["measured_rounds_s"] == [0.40, 0.44]
    assert result["layouts"]["tp2_sp_vllm_tp2"]["measured_step_s"] == pytest.approx(0.80)  # the faster round
    assert result["measured_order"] == ["tp1_dp2_vllm_tp1", "tp1_dp2_vllm_tp1_micro8", "tp2_sp_vllm_tp2"]
    # Priced by layer passes and TP collectives only: small micro-batches cost 4x the passes, and
    # TP 2's collectives cost more still.
    assert result["predicted_order"] == result["measured_order"] and result["order_matches"]
    assert result["pairs_ordered_as_measured"] == "3/3"


def test_round_dirs_reads_the_rounds_just_run_not_an_earlier_calls_extra_ones(tmp_path):
    tool = _tool()
    for k in (0, 1, 2, 10):  # an earlier call ran 11 rounds, this one 2
        (tmp_path / f"round{k}" / "tp1").mkdir(parents=True)
    assert [d.parent.name for d in tool.round_dirs(tmp_path, "tp1", 2)] == ["round0", "round1"]
    assert [d.parent.name for d in tool.round_dirs(tmp_path, "tp1")] == [
        "round0",
        "round1",
        "round2",
        "round10",
    ]
    with pytest.raises(SystemExit, match="no run of tp2"):
        tool.round_dirs(tmp_path, "tp2")
