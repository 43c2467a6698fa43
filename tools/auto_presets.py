"""What ``parallelism: auto`` picks for each cluster preset, beside the preset's hand-written layout.

    .venv/bin/python tools/auto_presets.py [--only qwen2.5_7b ...] [--out docs/auto_presets.json] [--markdown]

For every ``configs/models/<name>_auto.yaml`` (``<name>.yaml`` with ``configs/overlays/auto.yaml``
layered last) it runs the layout search as ``rlhf-megatron train`` would at start-up and records the
chosen layout, its predicted step time and memory peak, and the same two numbers for the
hand-written ``<name>.yaml`` under the same cost model. Prints one JSON object (``--markdown``: the
README's table instead).

The step times are the cost model's predictions (``configs/cost_model/gpu.json``): its update and
log-prob rates come from one H200, its collective, vLLM-iteration and sync prices are nominal until
a multi-GPU calibration runs. They rank layouts; they are not measurements.

Boundaries: no processes, no GPU; reads the presets.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rlhf_megatron.config.presets import CONFIGS_DIR  # noqa: E402
from rlhf_megatron.config.roles import world_size  # noqa: E402
from rlhf_megatron.planning import load_config  # noqa: E402
from rlhf_megatron.planning.auto_layout import describe_values  # noqa: E402
from rlhf_megatron.planning.cost_model import load_constants, predict_step  # noqa: E402
from rlhf_megatron.planning.memory import GIB, plan_memory  # noqa: E402

MODELS = CONFIGS_DIR / "models"
SUFFIX = "_auto"


def variants() -> list[str]:
    """``<name>`` of every ``configs/models/<name>_auto.yaml``, sorted."""
    return sorted(p.stem[: -len(SUFFIX)] for p in MODELS.glob(f"*{SUFFIX}.yaml"))


def compare(name: str) -> dict:
    """The search's choice for ``<name>_auto`` and the hand-written ``<name>``'s numbers."""
    searches = []
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto_cfg = load_config(f"models/{name}{SUFFIX}", [], on_search=searches.append)
        hand_cfg = load_config(f"models/{name}", [])
    seconds = time.perf_counter() - start
    [search] = searches
    chosen = search.ranked[0]
    constants = load_constants("cuda")
    hand_cost = predict_step(hand_cfg, constants)
    hand_plan = plan_memory(hand_cfg)
    return {
        "preset": f"models/{name}{SUFFIX}",
        "gpus": world_size(auto_cfg),
        "gpu_memory_gb": auto_cfg.trainer.gpu_memory_gb,
        "chosen": describe_values(chosen.values),
        "predicted_step_s": round(chosen.cost.total, 1),
        "peak_gib": round(chosen.peak_gib, 1),
        "layouts_fit": len(search.ranked),
        "layouts_too_big": len(search.too_big),
        "hand_predicted_step_s": round(hand_cost.total, 1),
        "hand_peak_gib": round(hand_plan.peak.total / GIB, 1),
        "search_s": round(seconds, 1),
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| preset | GPUs | `auto` picks | predicted s/step (hand-written preset) | peak GiB (hand) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['preset']}` | {r['gpus']} × {r['gpu_memory_gb']:g} GB | {r['chosen']} | "
            f"{r['predicted_step_s']:g} ({r['hand_predicted_step_s']:g}) | {r['peak_gib']:g} ({r['hand_peak_gib']:g}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="preset names (without _auto)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--markdown", action="store_true", help="print the README's table")
    args = parser.parse_args(argv)
    names = args.only or variants()
    rows = []
    for name in names:
        rows.append(compare(name))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    report = {"cost_model": load_constants("cuda").source, "rows": rows}
    if args.out is not None:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(args.out)
    print(markdown(rows) if args.markdown else json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
