"""Train two runs of the CPU scaling ladder exactly as `flopwise scale sweep` configures them and
report their throughput and final validation loss, to compare code versions on the same machine;
or (--sweep) train whole rungs of the ladder as `flopwise scale sweep [--jobs N]` does and report
the sweep's wall time.

    python benchmarks/throughput/ladder_speed.py --out benchmarks/throughput/results/ladder_speed.json
    PYTHONPATH=/path/to/old/checkout/src python benchmarks/throughput/ladder_speed.py --out old.json   # before
    python benchmarks/throughput/ladder_speed.py --sweep 1e12,3e12 --jobs 2 \\
        --out benchmarks/throughput/results/ladder_sweep_jobs2.json

The runs: the ladder's smallest (C1e12-N0.053M, from the sweep in benchmarks/long/scaling_ladder.py)
and its held-out run (C2e13-N0.332M, from the fitted law). Their recorded losses are in
benchmarks/scaling/ladder/runs.csv and outcome.json; a faster engine must reproduce them within
run-to-run noise. Tokens/s is the median of the logged steps after the first tenth of the run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from flopwise.config.schema import load_config
from flopwise.train.ladder import LADDER_PRESETS, final_val_loss, plan_ladder, run_ladder

BASE = list(LADDER_PRESETS["cpu-tiny"].overrides)  # the ladder setting `scale sweep --preset cpu-tiny` uses
LAW = "benchmarks/scaling/ladder/law.json"


def ladder_runs(out: Path) -> tuple:
    base = load_config("demo", BASE)
    smallest = min(plan_ladder(base, [1e12], 5, 8.0, "chinchilla-1", out), key=lambda r: r.params)
    holdout = plan_ladder(base, [2e13], 1, 1.0, f"fitted:{LAW}", out)[0]
    return base, [smallest, holdout]


def sweep(out: Path, budgets: list[float], jobs: int, dest: str | None) -> None:
    """The rungs' wall time from data preparation to the collected table, and each run's loss."""
    base = load_config("demo", BASE)
    runs = plan_ladder(base, budgets, 5, 8.0, "chinchilla-1", out)
    t0 = time.perf_counter()
    run_ladder(base, runs, out, **({"jobs": jobs} if jobs > 1 else {}))  # older versions: no jobs
    rec = {
        "budgets": budgets,
        "jobs": jobs,
        "wall_s": time.perf_counter() - t0,
        "tokens": sum(r.tokens for r in runs),
        "runs": {r.name: {"steps": r.steps, "val_loss": final_val_loss(r)} for r in runs},
    }
    rec["tokens_per_s"] = rec["tokens"] / rec["wall_s"]
    print(json.dumps(rec), flush=True)
    if dest:
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        Path(dest).write_text(json.dumps(rec, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="runs/ladder-speed", help="where the runs train (removed first)")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--sweep",
        default=None,
        help="budgets of whole rungs (5 sizes, spread 8, chinchilla-1, "
        "as benchmarks/long/scaling_ladder.py) trained as one sweep",
    )
    ap.add_argument("--jobs", type=int, default=1, help="with --sweep: runs at once (`scale sweep --jobs`)")
    args = ap.parse_args()
    out = Path(args.runs)
    if out.exists():
        raise SystemExit(f"{out} exists; remove it so nothing resumes")
    if args.sweep:
        return sweep(out, [float(b) for b in args.sweep.split(",")], args.jobs, args.out)
    base, runs = ladder_runs(out)
    results = []
    for run in runs:  # one at a time, through the sweep's own runner (it prepares the shared data first)
        t0 = time.perf_counter()
        run_ladder(base, [run], out)
        wall = time.perf_counter() - t0
        rows = [json.loads(x) for x in (Path(run.config.run.dir) / "metrics.jsonl").read_text().splitlines()]
        logged = [r for r in rows if "tokens_per_s" in r and r["step"] > run.steps // 10]
        rec = {
            "run": run.name,
            "steps": run.steps,
            "tokens": run.tokens,
            "wall_s": wall,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in logged),
            "val_loss": final_val_loss(run),
        }
        results.append(rec)
        print(json.dumps(rec), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
