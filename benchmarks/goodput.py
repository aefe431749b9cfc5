"""Goodput under injected failures: measured on 2 ranks here, predicted by `flopwise plan`.

    python benchmarks/goodput.py            # the table (benchmarks/RESULTS.md holds a recorded one)
    python benchmarks/goodput.py --json     # a JSON list of rows: mtbf_s, interval_s, predicted, measured, ...

1. Calibrate (one run, one injected failure): the step time, the checkpoint write time δ (what a
   save blocks the loop) and the restart time R (from the SIGKILL to the next step, less a step).
2. For each MTBF M: `flopwise plan` fed M (cluster.gpu_mtbf_hours), δ (as the storage bandwidth
   that writes this model's checkpoint in δ) and R (cluster.restart_minutes) proposes the Daly
   interval and predicts its goodput; the same formula (plan/reliability.goodput) predicts half
   and twice that interval.
3. Each interval is run: `torchrun --max-restarts` on 2 ranks of demo-tiny, and a thread here
   SIGKILLs a random rank at exponentially distributed times (a randomly shifted van der Corput
   sequence through the exponential's inverse CDF: each gap is exponential, and the gaps' running
   mean stays near M even over the few failures a short run has). torchrun restarts the workers,
   which resume from the newest checkpoint.
   Measured goodput = productive step time (steps × the run's own median step time) / wall time
   (first step to last); the rest is broken into lost steps (steps run more than once), checkpoint
   stalls (saves × the run's own median stall) and restarts (what remains: detection, restart,
   reload).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from flopwise.plan.reliability import CHECKPOINT_BYTES_PER_PARAM, goodput  # noqa: E402  (after the path)

STEP = re.compile(r"^step (\d+)/(\d+) ")
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
}
MODEL = ["model.preset=demo-tiny", "data.seq_len=32", "train.global_batch=8"]


def prepare(tmp: Path) -> Path:
    """Alice tokenized with a 512-token BPE (demo-tiny's vocabulary), once."""
    from flopwise.data.pipeline import prepare as prep
    from flopwise.data.shards import resolve_input

    docs = tmp / "alice_docs"
    docs.mkdir()
    for i, chapter in enumerate(resolve_input("builtin:alice").read_text().split("CHAPTER")):
        (docs / f"part_{i:02d}.txt").write_text(chapter)
    out = tmp / "alice"
    prep([str(docs)], out, tokenizer="bpe:512", val_fraction=0.1, seed=0)
    return out


def overrides(run_dir: Path, data: Path, steps: int, interval: int) -> list[str]:
    return [
        *MODEL,
        f'run.dir="{run_dir}"',
        f'data.path="{data}"',
        "train.micro_batch=4",
        'train.dtype="fp32"',
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        "optim.warmup_steps=2",
        "log.every=1",
        f"checkpoint.interval={interval}",
        "checkpoint.keep=2",
    ]


def gaps(mtbf: float, seed: int):
    """Exponential gaps of mean `mtbf`: a randomly shifted van der Corput sequence, inverted."""
    shift = random.Random(seed).random()
    i = 1
    while True:
        q, f, n = 0.0, 0.5, i
        while n:
            q, n, f = q + f * (n & 1), n >> 1, f / 2
        yield -mtbf * math.log(1 - (q + shift) % 1.0)
        i += 1


def workers(agent: int) -> list[int]:
    children = Path(f"/proc/{agent}/task/{agent}/children")
    return [int(c) for c in children.read_text().split()] if children.exists() else []


def run(
    run_dir: Path, data: Path, steps: int, interval: int, mtbf: float | None, seed: int, kill_at_step: int | None = None
) -> dict:
    """One training run under failures; the time of every step line and of every kill."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1000",
        "-m",
        "flopwise",
        "train",
        *overrides(run_dir, data, steps, interval),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
    lines: list[tuple[float, int]] = []
    kills: list[float] = []
    started, done = threading.Event(), threading.Event()
    rng = random.Random(seed)

    def kill() -> None:
        victims = workers(proc.pid)
        if victims:
            os.kill(rng.choice(victims), signal.SIGKILL)
            kills.append(time.monotonic())

    def killer() -> None:
        started.wait()
        due = time.monotonic()
        for gap in gaps(mtbf or math.inf, seed):
            due += gap
            if done.wait(max(0.0, due - time.monotonic())):
                return
            kill()

    if mtbf is not None:
        threading.Thread(target=killer, daemon=True).start()
    assert proc.stdout is not None
    for line in proc.stdout:
        m = STEP.match(line)
        if not m:
            continue
        lines.append((time.monotonic(), int(m[1])))
        started.set()
        if int(m[1]) == kill_at_step and not kills:
            kill()
        if int(m[1]) == steps:
            done.set()
    done.set()
    if proc.wait() != 0:
        raise SystemExit(f"training failed (exit {proc.returncode}): {' '.join(cmd)}")
    return {"lines": lines, "kills": kills}


def timings(r: dict, interval: int) -> tuple[float, float]:
    """(median step time, median checkpoint stall) from consecutive step lines of one attempt."""
    plain, saved = [], []
    for (t0, a), (t1, b) in pairwise(r["lines"]):
        if b == a + 1 and not any(t0 < k < t1 for k in r["kills"]):
            (saved if a % interval == 0 else plain).append(t1 - t0)
    step = statistics.median(plain)
    return step, max(0.0, statistics.median(saved) - step) if saved else 0.0


def calibrate(tmp: Path, data: Path) -> dict:
    """Step time, write stall and restart time of this machine, from one run with one kill."""
    r = run(tmp / "calibrate", data, steps=60, interval=10, mtbf=None, seed=0, kill_at_step=25)
    step, write = timings(r, 10)
    kill = r["kills"][0]
    after = next(t for t, _ in r["lines"] if t > kill)
    return {"step_s": step, "write_s": write, "restart_s": max(0.0, after - kill - step)}


def plan(cal: dict, mtbf: float, params: float) -> dict:
    """`flopwise plan`'s reliability account for 2 devices fed the measured δ, R and this MTBF."""
    gbps = CHECKPOINT_BYTES_PER_PARAM * params / 2 / max(cal["write_s"], 1e-6) / 1e9
    cmd = [
        sys.executable,
        "-m",
        "flopwise",
        "plan",
        *MODEL,
        "cluster.hardware=h100-sxm",
        "cluster.gpus=2",
        f"cluster.gpu_mtbf_hours={mtbf * 2 / 3600!r}",
        f"cluster.restart_minutes={cal['restart_s'] / 60!r}",
        f"cluster.storage_gbps_per_gpu={gbps!r}",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, check=True).stdout
    return json.loads(out)["reliability"]


def measure(tmp: Path, data: Path, cal: dict, mtbf: float, interval: int, productive_s: float, seed: int) -> dict:
    steps = max(4 * interval, round(productive_s / cal["step_s"]))
    r = run(tmp / f"m{mtbf:g}-i{interval}", data, steps, interval, mtbf, seed)
    step, stall = timings(r, interval)
    first = next(t for t, k in r["lines"] if k == 1)
    wall = r["lines"][-1][0] - first + step
    saves = sum(1 for _, k in r["lines"] if k % interval == 0 and k < steps)
    redone = len(r["lines"]) - steps
    productive, lost, stalls = steps * step / wall, redone * step / wall, saves * stall / wall
    return {
        "steps": steps,
        "failures": len(r["kills"]),
        "wall_s": wall,
        "step_s": step,
        "stall_s": stall,
        "measured": productive,
        "lost_steps": lost,
        "checkpoint_stalls": stalls,
        "restarts": max(0.0, 1 - productive - lost - stalls),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print a JSON list of rows")
    ap.add_argument("--mtbf", type=float, nargs="+", default=[30.0, 60.0], help="job MTBFs in seconds")
    ap.add_argument("--productive", type=float, default=60.0, help="failure-free seconds of training per run")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from flopwise.config import load_config
    from flopwise.flops import count_params

    params = count_params(load_config(None, MODEL).model).total
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = prepare(tmp)
        cal = calibrate(tmp, data)
        for i, mtbf in enumerate(a.mtbf):
            rel = plan(cal, mtbf, params)
            daly = max(1, round(rel["interval_daly_s"] / cal["step_s"]))
            factors = (0.5, 1, 2) if i == 0 else (1,)  # half and twice Daly's at the first MTBF
            for f in factors:
                interval = max(1, round(daly * f))
                tau = interval * cal["step_s"]
                m = measure(tmp, data, cal, mtbf, interval, a.productive, a.seed + i)
                rows.append(
                    {
                        "mtbf_s": mtbf,
                        "interval_s": tau,
                        "interval_steps": interval,
                        "of_daly": f,
                        "predicted": goodput(tau, cal["write_s"], cal["restart_s"], mtbf),
                        "plan_goodput": rel["goodput"],
                        "plan_interval_s": rel["interval_daly_s"],
                        **m,
                        **{f"cal_{k}": v for k, v in cal.items()},
                    }
                )
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"calibration: step {cal['step_s']:.3f} s, write {cal['write_s']:.3f} s, restart {cal['restart_s']:.1f} s")
    print(
        "| MTBF s | interval s (steps, × Daly) | predicted | measured | lost steps | restarts | ckpt stalls "
        "| failures |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mtbf_s']:g} | {r['interval_s']:.2f} ({r['interval_steps']}, ×{r['of_daly']:g}) | "
            f"{r['predicted']:.3f} | {r['measured']:.3f} | {r['lost_steps']:.3f} | {r['restarts']:.3f} | "
            f"{r['checkpoint_stalls']:.3f} | {r['failures']} |"
        )


if __name__ == "__main__":
    main()
