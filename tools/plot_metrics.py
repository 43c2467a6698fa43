"""Plot a run's metrics.jsonl: reward, KL, response length and phase timings, to one PNG.

python tools/plot_metrics.py RUN_DIR [--out RUN_DIR/metrics.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhf_megatron.trainer.plot import load_records, plot


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        out = plot(load_records(args.run_dir), args.out or args.run_dir / "metrics.png")
    except (FileNotFoundError, ValueError) as e:
        print(f"plot_metrics: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
