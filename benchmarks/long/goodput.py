"""Goodput under injected failures: measured on 2 ranks here, predicted by the planner.

    python benchmarks/long/goodput.py --mtbf 60 120 --failures 10 --save benchmarks/long/results/goodput.json
                                        # the table in benchmarks/long/goodput.md: ~50 min on a quiet machine
    python benchmarks/long/goodput.py --json # a JSON list of rows: mtbf_s, interval_s, predicted, measured, ...
    python benchmarks/long/goodput.py --mtbf 20 --productive 10    # a smoke run (about 4 minutes)

1. Calibrate (one run, one failure just after step 75): the step time, the checkpoint stall δ (what a
   save blocks the loop) and the restart time R (from the SIGKILL to the next step, less a step),
   by plan.reliability.account.
2. For each MTBF M: `flopwise plan` fed M (cluster.gpu_mtbf_hours), δ (as the storage bandwidth
   that writes this model's checkpoint in δ) and R (cluster.restart_minutes) proposes the Daly
   interval; at the first MTBF half and twice it run too.
3. Each interval is run (flopwise.train.chaos): `torchrun --max-restarts` on 2 ranks of
   demo-tiny, a random rank SIGKILLed at exponentially distributed times (a randomly shifted van
   der Corput sequence through the inverse CDF: the failure schedule is the same for the intervals
   of one MTBF), torchrun restarting the workers, which resume from the newest checkpoint. A run
   stops once it has done --productive seconds of new steps (default: enough for --failures
   expected failures at the planner's goodput), timed by its own median step, so a machine whose
   speed drifts still gives each run the work it was asked for.
4. Each run is accounted by plan.reliability.account: measured goodput = new steps × the run's
   median step / wall time; lost work, restarts (timed from each failure) and checkpoint stalls;
   what the parts leave unaccounted is step-time jitter. Predicted = plan.reliability.goodput (Daly
   2006's exact expectation) fed the nominal M and the run's OWN step, δ and R: planner and run
   compared on the same costs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])  # the workers too

from flopwise.plan.reliability import CHECKPOINT_BYTES_PER_PARAM, Account, daly_interval, measured_account  # noqa: E402
from flopwise.train.chaos import Timeline, exponential_gaps, run_under_failures  # noqa: E402

MODEL = ["model.preset=demo-tiny", "data.seq_len=32", "train.global_batch=8"]


def prepare(tmp: Path) -> Path:
    """Alice tokenized with a 512-token BPE (demo-tiny's vocabulary), once."""
    from flopwise.data.prepare import prepare_data as prep
    from flopwise.data.shards import resolve_input

    docs = tmp / "alice_docs"
    docs.mkdir()
    for i, chapter in enumerate(resolve_input("builtin:alice").read_text().split("CHAPTER")):
        (docs / f"part_{i:02d}.txt").write_text(chapter)
    out = tmp / "alice"
    prep([str(docs)], out, tokenizer="bpe:512", val_fraction=0.1, seed=0)
    return out


def overrides(run_dir: Path, data: Path, steps: int, interval: int) -> list[str]:
    """Eager (train.compile=false: `auto` compiles runs of 1,000 steps or more, and every restart
    would then compile again), every step logged (the account needs each step's time)."""
    return [
        *MODEL,
        f'run.dir="{run_dir}"',
        f'data.path="{data}"',
        "train.micro_batch=4",
        'train.dtype="fp32"',
        "train.compile=false",
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        "optim.warmup_steps=2",
        "log.every=1",
        f"checkpoint.interval={interval}",
        "checkpoint.keep=2",
    ]


def calibrate(tmp: Path, data: Path) -> Account:
    """Step time, write stall and restart time of this machine now, from one run with one failure
    (just after step 75, so that a checkpoint exists whatever the machine's speed)."""
    t = run_under_failures(overrides(tmp / "calibrate", data, 150, 10), [0.1], from_step=75, timeout_s=900)
    return measured_account(t.lines, t.kills, 10)


def plan(cal: Account, mtbf: float, params: float) -> dict:
    """`flopwise plan`'s reliability account for 2 devices fed the measured δ, R and this MTBF."""
    assert cal.restart_s is not None  # the calibration's one failure was followed by a restart
    gbps = CHECKPOINT_BYTES_PER_PARAM * params / 2 / max(cal.stall_s, 1e-6) / 1e9
    cmd = [
        sys.executable,
        "-m",
        "flopwise",
        "plan",
        *MODEL,
        "cluster.hardware=h100-sxm",
        "cluster.gpus=2",
        f"cluster.gpu_mtbf_hours={mtbf * 2 / 3600!r}",
        f"cluster.restart_minutes={cal.restart_s / 60!r}",
        f"cluster.storage_gbps_per_gpu={gbps!r}",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out)["reliability"]


def enough(productive_s: float):
    """`until` for a run: stop once its new steps × its recent median step reach `productive_s`
    (asked every 20 lines, in time independent of the run's length: a 1,200 s run logs 50,000 steps)."""
    reached = 0

    def done(t: Timeline) -> bool:
        nonlocal reached
        reached = max(reached, t.lines[-1][1])
        if len(t.lines) % 20:
            return False
        recent = [t1 - t0 for (t0, a), (t1, b) in pairwise(t.lines[-200:]) if b == a + 1]
        return bool(recent) and (reached - t.lines[0][1] + 1) * statistics.median(recent) >= productive_s

    return done


def measure(tmp: Path, data: Path, mtbf: float, interval: int, productive_s: float, step_s: float, seed: int) -> dict:
    """One run at MTBF `mtbf`, saving every `interval` steps, until `productive_s` of new work."""
    steps = max(4 * interval, math.ceil(5 * productive_s / step_s))  # 5x the calibrated need: room for drift
    t = run_under_failures(
        overrides(tmp / f"m{mtbf:g}-i{interval}", data, steps, interval),
        exponential_gaps(mtbf, seed),
        seed=seed,
        until=enough(productive_s),
        timeout_s=20 * productive_s + 900,
    )
    a = measured_account(t.lines, t.kills, interval)
    tau = interval * a.step_s
    return {
        "interval_s": tau,
        "interval_steps": interval,
        "run_of_daly": tau / daly_interval(a.stall_s, mtbf),
        "predicted": a.predicted(interval, mtbf) if a.restart_s is not None else None,
        "predicted_at_realized_mtbf": a.predicted(interval, a.wall_s / a.failures) if a.failures else None,
        "measured": a.goodput,
        "lost": a.lost_s / a.wall_s,
        "restarts": a.restarts_s / a.wall_s,
        "checkpoint_stalls": a.stalls_s / a.wall_s,
        "unaccounted": a.unaccounted_s / a.wall_s,
        "failures": a.failures,
        "failures_expected": a.wall_s / mtbf,
        "steps": t.lines[-1][1],
        "wall_s": a.wall_s,
        "step_s": a.step_s,
        "stall_s": a.stall_s,
        "restart_s": a.restart_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print a JSON list of rows")
    ap.add_argument("--save", type=Path, help="also write the rows to this JSON file")
    ap.add_argument("--mtbf", type=float, nargs="+", default=[60.0, 120.0], help="job MTBFs in seconds")
    ap.add_argument(
        "--productive", type=float, help="seconds of new steps per run (default: --failures expected failures)"
    )
    ap.add_argument("--failures", type=float, default=10.0, help="failures expected per run, to size it")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from flopwise.config.schema import load_config
    from flopwise.flops import count_params

    params = count_params(load_config(None, MODEL).model).total
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = prepare(tmp)
        cal = calibrate(tmp, data)
        for i, mtbf in enumerate(a.mtbf):
            rel = plan(cal, mtbf, params)
            daly = max(1, round(rel["interval_daly_s"] / cal.step_s))
            productive = a.productive or a.failures * mtbf * rel["goodput"]
            for f in (0.5, 1, 2) if i == 0 else (1,):  # half and twice Daly's at the first MTBF
                interval = max(1, round(daly * f))
                m = measure(tmp, data, mtbf, interval, productive, cal.step_s, a.seed + i)
                rows.append(
                    {
                        "mtbf_s": mtbf,
                        "of_daly": f,
                        **m,
                        "plan_goodput": rel["goodput"],
                        "plan_interval_s": rel["interval_daly_s"],
                        **{f"cal_{k}": getattr(cal, k) for k in ("step_s", "stall_s", "restart_s")},
                    }
                )
    if a.save:
        a.save.write_text(json.dumps(rows, indent=1) + "\n")
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"calibration: step {cal.step_s:.3f} s, write stall {cal.stall_s:.3f} s, restart {cal.restart_s:.1f} s")
    print(
        "| MTBF s | interval s (steps, × Daly) | predicted | measured | lost | restarts | ckpt stalls | unaccounted "
        "| failures (expected) | wall s | step s | δ s | R s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pred = f"{r['predicted']:.3f}" if r["predicted"] is not None else "–"
        restart = f"{r['restart_s']:.1f}" if r["restart_s"] is not None else "–"
        print(
            f"| {r['mtbf_s']:g} | {r['interval_s']:.2f} ({r['interval_steps']}, ×{r['run_of_daly']:.2g}) | {pred} | "
            f"{r['measured']:.3f} | {r['lost']:.3f} | {r['restarts']:.3f} | {r['checkpoint_stalls']:.3f} | "
            f"{r['unaccounted']:+.3f} | {r['failures']} ({r['failures_expected']:.1f}) | {r['wall_s']:.0f} | "
            f"{r['step_s']:.3f} | {r['stall_s']:.3f} | {restart} |"
        )


if __name__ == "__main__":
    main()
