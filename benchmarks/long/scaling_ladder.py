"""The CPU IsoFLOP ladder: fit it, predict a larger held-out run before training it, then train it.

    flopwise scale sweep demo 'data.tokenizer="bpe:512"' model.vocab_size=512 data.seq_len=128 \\
        model.max_seq_len=128 train.global_batch=16 train.micro_batch=16 train.eval_batches=32 \\
        --budgets 1e12,3e12,1e13 --sizes 5 --spread 8 --law chinchilla-1 --out runs/ladder
    python benchmarks/long/scaling_ladder.py predict --budget 3e13   # writes prediction.json (commit it first)
    python benchmarks/long/scaling_ladder.py holdout --budget 3e13   # trains the held-out run, writes outcome.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from flopwise.config.schema import load_config
from flopwise.scale.fit import fit_approach2, fit_approach3, fit_kaplan, plot_fits, read_points, save_law
from flopwise.train.ladder import LADDER_PRESETS, final_val_loss, plan_ladder, run_ladder

OUT = Path("benchmarks/scaling/ladder")
BASE = list(LADDER_PRESETS["cpu-tiny"].overrides)  # the ladder setting `scale sweep --preset cpu-tiny` uses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=["predict", "holdout"])
    ap.add_argument("--runs", default="runs/ladder")
    ap.add_argument("--budget", type=float, default=3e13)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    base = load_config("demo", BASE)
    if args.step == "predict":
        table = Path(args.runs) / "runs.csv"
        (OUT / "runs.csv").write_text(table.read_text())
        pts = read_points(table)
        fit = fit_approach3(pts, bootstrap=1000, seed=0)
        save_law(fit, OUT / "law.json")
        try:
            iso = fit_approach2(pts)
        except Exception:
            iso = None
        plot_fits(pts, fit, iso, OUT)
        run = plan_ladder(base, [args.budget], 1, 1.0, f"fitted:{OUT / 'law.json'}", "runs/ladder-holdout")[0]
        loss, interval = fit.predict(run.params, run.tokens)
        record = {
            "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "budget": args.budget,
            "run": run.name,
            "params": run.params,
            "tokens": run.tokens,
            "predicted_loss": loss,
            "interval_95": interval,
            "fit": fit.to_json(),
            "approach2": iso.to_json() if iso else None,
            "kaplan": fit_kaplan(pts).to_json(),
            "n_points": len(pts),
        }
        (OUT / "prediction.json").write_text(json.dumps(record, indent=1))
        print(json.dumps({k: record[k] for k in ("run", "params", "tokens", "predicted_loss", "interval_95")}))
    else:
        pred = json.loads((OUT / "prediction.json").read_text())
        runs = plan_ladder(base, [pred["budget"]], 1, 1.0, f"fitted:{OUT / 'law.json'}", "runs/ladder-holdout")
        run_ladder(base, runs, Path("runs/ladder-holdout"))
        outcome = {
            "run": runs[0].name,
            "observed_loss": final_val_loss(runs[0]),
            "predicted_loss": pred["predicted_loss"],
            "interval_95": pred["interval_95"],
        }
        outcome["error"] = outcome["observed_loss"] - outcome["predicted_loss"]
        (OUT / "outcome.json").write_text(json.dumps(outcome, indent=1))
        print(json.dumps(outcome))


if __name__ == "__main__":
    main()
