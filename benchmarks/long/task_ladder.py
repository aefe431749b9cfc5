"""Downstream prediction on a CPU ladder: evaluate its runs on the in-domain Shakespeare tasks, predict a
larger held-out run's task scores (commit the prediction first), then train and evaluate it.

    flopwise scale sweep demo 'data.tokenizer="bpe:512"' model.vocab_size=512 data.seq_len=128 \\
        model.max_seq_len=128 train.global_batch=16 train.micro_batch=16 train.eval_batches=32 \\
        --budgets 1e11,2e11,4e11 --sizes 1 --spread 1 --law chinchilla-1 --out runs/task-ladder
    python benchmarks/long/task_ladder.py predict --flops 8e11     # tasks.csv, prediction.json, tasks.png: commit
    python benchmarks/long/task_ladder.py holdout                  # trains it, writes outcome.json
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

from flopwise.config.schema import load_config
from flopwise.data.tasks import load_task
from flopwise.eval.load import load_for_inference
from flopwise.eval.tasks import evaluate_task
from flopwise.flops import scaling_flops
from flopwise.scale.tasks import jaggedness, plot_tasks, predict_task, read_task_table
from flopwise.train.ladder import LADDER_PRESETS, plan_ladder, run_ladder

OUT = Path("benchmarks/scaling/tasks")
TASKS = ["shakespeare-cloze", "shakespeare-nextline", "shakespeare-speaker"]
BASE = list(LADDER_PRESETS["cpu-tiny"].overrides)  # the ladder setting `scale sweep --preset cpu-tiny` uses


def evaluate_run(run_dir: Path, flops: float) -> list[dict]:
    model, _, tok = load_for_inference(run_dir)
    rows = []
    for name in TASKS:
        _, ex = load_task(name)
        r = evaluate_task(model, tok, name, ex, batch=32)
        rows.append(
            {
                "name": run_dir.name,
                "flops": flops,
                "task": name,
                "acc": r["acc"],
                "nll": r["nll"],
                "chance": 1 / len(ex[0].choices) if ex[0].choices else 0.0,
                "brier": r["brier"] or "",
            }
        )
    return rows


def write_table(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=["predict", "holdout"])
    ap.add_argument("--runs", default="runs/task-ladder")
    ap.add_argument("--flops", type=float, default=8e11)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    base = load_config("demo", BASE)
    if args.step == "predict":
        rows = []
        with open(Path(args.runs) / "runs.csv") as f:
            for r in csv.DictReader(f):
                rows += evaluate_run(Path(args.runs) / r["name"], float(r["flops"]))
        write_table(rows, OUT / "tasks.csv")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "flopwise",
                "scale",
                "predict-task",
                str(OUT / "tasks.csv"),
                "--flops",
                str(args.flops),
                "--out",
                str(OUT),
            ],
            check=True,
        )
        record = json.loads((OUT / "prediction.json").read_text())
        record["made_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        (OUT / "prediction.json").write_text(json.dumps(record, indent=1))
    else:
        pred = json.loads((OUT / "prediction.json").read_text())
        runs = plan_ladder(base, [pred["flops"]], 1, 1.0, "chinchilla-1", "runs/task-ladder-holdout")
        run_ladder(base, runs, Path("runs/task-ladder-holdout"))
        run = runs[0]
        observed = evaluate_run(Path(run.config.run.dir), scaling_flops(run.params, run.tokens))
        outcome = {"run": run.name, "flops": scaling_flops(run.params, run.tokens), "tasks": {}}
        for o in observed:
            p = pred["tasks"][o["task"]]
            outcome["tasks"][o["task"]] = {
                "observed_acc": o["acc"],
                "predicted_acc": p["acc"],
                "acc_interval_95": p["acc_interval_95"],
                "acc_inside": p["acc_interval_95"][0] <= o["acc"] <= p["acc_interval_95"][1],
                "observed_nll": o["nll"],
                "predicted_nll": p["nll"],
                "nll_interval_95": p["nll_interval_95"],
                "nll_inside": p["nll_interval_95"][0] <= o["nll"] <= p["nll_interval_95"][1],
            }
        (OUT / "outcome.json").write_text(json.dumps(outcome, indent=1))
        tasks = read_task_table(OUT / "tasks.csv")
        laws = {n: predict_task(p, pred["flops"], bootstrap=10).law for n, p in tasks.items()}
        plot_tasks(tasks, laws, OUT, {o["task"]: (outcome["flops"], o["acc"], o["nll"]) for o in observed})
        print(json.dumps(outcome, indent=1))
        print({n: jaggedness(p) for n, p in tasks.items()})


if __name__ == "__main__":
    main()
