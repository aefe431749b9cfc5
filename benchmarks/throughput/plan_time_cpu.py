"""Predicted vs measured step time of the embedded demo on this CPU, per layout: the calibrate ->
plan -> measure loop, before (one GEMM efficiency, nominal streaming) and after (the
calibrated tables).

    python benchmarks/throughput/plan_time_cpu.py                         # calibrates first (~3 min), then measures
    python benchmarks/throughput/plan_time_cpu.py --hardware-file hw.toml # reuse a calibration

Layouts: 1 process, dp2 ZeRO-1, tp2, pp2 (the demo at global batch 16; micro-batch 8 where the
per-rank batch is 8). Measured: `flopwise plan measure` (flopwise.measure.step), median of the timed
steps of the slowest rank. "Before" is the same hardware entry with its calibration removed (the
measured peak at the catalogue's single 0.75 GEMM efficiency and 80% of the measured stream
bandwidth): what the planner did before calibration existed. Writes benchmarks/throughput/results/plan_time_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from flopwise.config.schema import load_tree, validate
from flopwise.hardware.catalogue import load_catalogue
from flopwise.measure.calibrate import save_hardware
from flopwise.measure.step import measure_plan, predicted_time
from flopwise.parallel.mesh import layout_of

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {
    "1 process": [],
    "dp2 zero1": ["parallel.dp=2", "parallel.zero=1", "train.micro_batch=8"],
    "tp2": ["parallel.tp=2"],
    "pp2": ["parallel.pp=2", "train.micro_batch=8"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hardware-file", type=Path)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "plan_time_cpu.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="plan-time-"))
    hw_file = args.hardware_file or tmp / "hw.toml"
    if not args.hardware_file:
        subprocess.run([sys.executable, "-m", "flopwise", "hardware", "calibrate", "--out", str(hw_file)], check=True)
    before_file = tmp / "uncalibrated.toml"
    save_hardware(replace(load_catalogue(hw_file)["cpu"], calibration=None), before_file)
    rows = []
    for name, overrides in LAYOUTS.items():
        over = [*overrides, f'cluster.hardware_file="{hw_file}"', f'run.dir="{tmp / "run"}"']
        r = measure_plan("demo", over, steps=args.steps)
        tree = load_tree("demo", [*overrides, f'cluster.hardware_file="{before_file}"'])
        cfg = validate(tree)
        before, _ = predicted_time(cfg, layout_of(cfg, r["world"]))
        st = r["step_time_s"]
        rows.append(
            {
                "layout": name,
                "measured_s": st["measured"],
                "predicted_s": st["predicted"],
                "ratio": st["measured"] / st["predicted"],
                "uncalibrated_predicted_s": before.step_time,
                "uncalibrated_ratio": st["measured"] / before.step_time,
                "components_s": r["step_time_components_s"],
            }
        )
        print(
            f"{name:10s} measured {st['measured']:.3f} s  predicted {st['predicted']:.3f} s "
            f"(measured/predicted {rows[-1]['ratio']:.2f}; uncalibrated {before.step_time:.3f} s, "
            f"{rows[-1]['uncalibrated_ratio']:.2f})",
            flush=True,
        )
    hw = load_catalogue(hw_file)["cpu"]
    args.out.write_text(
        json.dumps(
            {
                "hardware": hw.source,
                "calibration": hw.calibration.source,
                "threads_per_rank": hw.calibration.threads,
                "layouts": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
