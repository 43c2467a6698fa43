"""``tools/compare_dapo.py``'s comparison: validation reward averaged over the responses generated."""

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "compare_dapo.py"


def _tool():
    spec = importlib.util.spec_from_file_location("compare_dapo", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_curves_are_compared_over_the_same_number_of_generated_responses():
    over = _tool()._over
    curve = [{"generated": 0, "val": 0.0}, {"generated": 100, "val": 1.0}, {"generated": 300, "val": 1.0}]
    # A linear rise to 1.0 over the first 100 responses, then flat: mean 0.5 over [0, 100] ...
    assert over(curve, 100) == pytest.approx((0.5, 1.0))
    # ... and (50 + 100) / 200 over [0, 200]; points past the range's end do not count.
    assert over(curve, 200) == pytest.approx((0.75, 1.0))
    assert over(curve[:2] + [{"generated": 300, "val": -5.0}], 100) == pytest.approx((0.5, 1.0))
