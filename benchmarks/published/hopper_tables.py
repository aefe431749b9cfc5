"""Prints the built-in H100/H200 efficiency tables, derived from the one H200 profile this project recorded,
and the planner's step time beside every recorded H200 run, before and after them.

    python benchmarks/published/hopper_tables.py

How the tables are derived from that profile, and the published ceilings they agree with:
flopwise.measure.hopper_tables's docstring (one account of it).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from flopwise.hardware.catalogue import get_hardware
from flopwise.measure.hopper_tables import derive, predict, run_config

RESULTS = Path(__file__).parent / "results"
RUNS_DIR = Path(__file__).parents[1] / "gpu" / "results"  # the recorded H200 runs
PROFILED = RUNS_DIR / "gpu_llama1b_z3_b8.json"
RUNS = ["gpu_llama1b_z3_b8", "gpu_llama1b_z3_b16", "gpu_llama1b_z0_b8", "gpu_llama1b_z0_b8_eager"]


def main() -> None:
    print("derived H200 table:", derive(json.loads(PROFILED.read_text())))
    print("built-in H200:      ", get_hardware("h200").calibration)
    print("run: measured step | predicted before (A100's 0.75, nominal HBM) | after (built-in tables)")
    before_hw = replace(get_hardware("h200"), calibration=None, matmul_efficiency=0.75)
    rows = []
    for name in RUNS:
        run = json.loads((RUNS_DIR / f"{name}.json").read_text())
        zero = 3 if "fsdp2" in run["layout"] else 0
        cfg = run_config(run["batch"], zero, run["compile"])
        before, after = predict(cfg, before_hw)[0], predict(cfg, get_hardware("h200"))[0]
        m = run["median_step_s"]
        rows.append({"run": name, "measured_s": m, "before_s": before, "after_s": after})
        print(
            f"  {name:26s} {1e3 * m:6.1f} ms | {1e3 * before:6.1f} ({m / before:.3f}) | {1e3 * after:6.1f} "
            f"({m / after:.3f})   measured/predicted"
        )
    (RESULTS / "hopper_tables.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
