"""Soak: a long run on several ranks that meets a fault every ~20 steps, ended equal to a clean run.

    python benchmarks/soak.py [--steps 200] [--ranks 4] [--every 20] [--seed 0] [--out /tmp/soak]

The run is driven as a cluster scheduler would: one `torchrun` launch per segment of `--every`
steps (`train.stop_after`), each resuming from the newest checkpoint, with one fault drawn from the
seed at a random step and rank of the segment:

  kill, hang   torchrun restarts the job once (a hang is ended by the watchdog's collective timeout)
  sigterm      the job checkpoints and exits 0 (preemption); the driver relaunches the segment
  enospc       the checkpoint write fails and every rank stops; the driver relaunches the segment
  slow         a straggler: nothing to recover
  nan_grad     the update is skipped on every rank
  poison       random tokens: a loss spike, rolled back to the last checkpoint and the data skipped

Infrastructure faults (the first five) must leave no trace; data faults change the run, but
deterministically. So the reference is one uninterrupted launch with the same data faults, and the
soak passes when its final checkpoint's tensor files, data position and RNG are bit-identical to
the reference's. Prints faults injected and survived, steps recomputed and the wall-time overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from flopwise.data.shards import prepare, read_index, resolve_input
from flopwise.errors import DataError
from flopwise.train import checkpoint

INFRA = ("kill", "hang", "sigterm", "enospc", "slow")
DATA = ("nan_grad", "poison")
CKPT_EVERY = 10


def overrides(run_dir: Path, data: Path, steps: int) -> list[str]:
    kw = {"run.dir": f'"{run_dir}"', "data.path": f'"{data}"', "model.preset": '"demo-tiny"', "data.seq_len": 32,
          "train.global_batch": 8, "train.micro_batch": 2, "train.dtype": '"fp32"', "train.steps": steps,
          "train.eval_every": 0, "train.eval_batches": 1, "train.sample_tokens": 0, "optim.warmup_steps": 2,
          "log.every": 5, "checkpoint.interval": CKPT_EVERY, "checkpoint.keep": 3, "parallel.zero": 3,
          "guard.window": 10, "guard.min_window": 5, "guard.skip_batches": 2,
          "watchdog.collective_timeout_s": 15, "watchdog.min_s": 2, "watchdog.hang_factor": 3}
    return [f"{k}={v}" for k, v in kw.items()]


def launch(args, run_dir: Path, data: Path, faults: str, stop_after: int | None, restarts: int) -> subprocess.CompletedProcess:
    """One torchrun job; each on its own port (a killed or hung job's port may not be free at once)."""
    args.port += 1
    ov = overrides(run_dir, data, args.steps) + ([f"train.stop_after={stop_after}"] if stop_after else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLOPWISE_FAULTS": faults, "COLUMNS": "400"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--max-restarts",
           str(restarts), "--master-port", str(args.port), "-m", "flopwise", "train", *ov]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)


def schedule(args) -> list[dict]:
    """One fault per segment after the first (the guard needs a window of losses first)."""
    rng = random.Random(args.seed)
    kinds = list(INFRA + DATA)
    out = []
    for start in range(args.every, args.steps, args.every):
        kind = kinds[len(out) % len(kinds)] if len(out) < len(kinds) else rng.choice(kinds)  # each kind once first
        step = rng.randrange(start + 2, start + args.every - 1)
        fault = {"kind": kind, "segment_end": start + args.every, "step": step, "rank": rng.randrange(args.ranks)}
        if kind == "enospc":  # the n-th save of the launch: the segment writes at start+10 and start+20
            fault["save"] = rng.randrange(1, args.every // CKPT_EVERY + 1)
        out.append(fault)
    return out


def spec(f: dict) -> str:
    where = f"save={f['save']}" if f["kind"] == "enospc" else f"step={f['step']}"
    extra = ":seconds=1.5" if f["kind"] == "slow" else ""
    return f"{f['kind']}:{where}:rank={f['rank']}{extra}"


def steps_recomputed(log: list[dict]) -> int:
    """Steps run twice: from each point a restart or relaunch resumed at up to where the fault hit.
    A SIGTERM is acted on at the next sync point, after the fault's step, so it costs none."""
    return sum(max(0, f["failed_at"] - back) for f in log for back in f["resumed_from"])


def hashes(ckpt: Path) -> dict[str, str]:
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    return {k: v["sha256"] for k, v in files.items() if k.endswith(".distcp")}


def state(ckpt: Path) -> tuple:
    s = checkpoint.read_state(ckpt)
    return s["step"], s["loader"], s["rng"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=29810)
    p.add_argument("--out", type=Path, default=Path("/tmp/soak"))
    args = p.parse_args()
    data = args.out / "data"
    try:
        read_index(data)
    except DataError:  # none yet, or of an older format: Alice in chapters, so the val split has documents
        chapters = args.out / "chapters"
        chapters.mkdir(parents=True, exist_ok=True)
        for i, text in enumerate(resolve_input("builtin:alice").read_text().split("CHAPTER")):
            (chapters / f"part_{i:02d}.txt").write_text(text)
        prepare([str(chapters)], data, tokenizer="bpe:512", val_fraction=0.1, seed=0)
    for name in ("reference", "soak", "segmented"):  # a fresh run each time
        shutil.rmtree(args.out / name, ignore_errors=True)
    faults = schedule(args)
    data_faults = ",".join(spec(f) for f in faults if f["kind"] in DATA)

    t0 = time.perf_counter()
    ref = launch(args, args.out / "reference", data, data_faults, None, 0)
    ref_s = time.perf_counter() - t0
    assert ref.returncode == 0, ref.stderr[-3000:]

    run_dir, log = args.out / "soak", []
    launches = 0
    t0 = time.perf_counter()
    for f in faults:
        start = f["segment_end"] - args.every
        fail_at = start + CKPT_EVERY * f["save"] if f["kind"] == "enospc" else f["step"]
        fresh = not (run_dir / "checkpoints").exists()  # the first launch starts from nothing
        r = launch(args, run_dir, data, spec(f), f["segment_end"], 1)
        launches += 1
        resumed = [int(x) for x in re.findall(r"step-(\d{8}) at step", r.stdout)][0 if fresh else 1:]
        outcome = "finished" + (f" after {len(resumed)} restart(s)" if resumed else "")
        if r.returncode != 0 or f["kind"] == "sigterm":  # the scheduler starts the job again
            r2 = launch(args, run_dir, data, "", f["segment_end"], 0)
            launches += 1
            assert r2.returncode == 0, r2.stderr[-3000:]
            resumed += [int(re.findall(r"step-(\d{8}) at step", r2.stdout)[0])]
            outcome = (f"exit {r.returncode}" if r.returncode else "stopped") + " + relaunch"
        log.append({**f, "failed_at": fail_at, "resumed_from": resumed, "outcome": outcome})
        print(f"{spec(f):34s} segment to {f['segment_end']:4d}: {outcome}, resumed from {resumed}", flush=True)
    soak_s = time.perf_counter() - t0

    # the same launches without faults: what the segmentation itself costs
    t0 = time.perf_counter()
    for f in faults:
        r = launch(args, args.out / "segmented", data, data_faults, f["segment_end"], 0)
        assert r.returncode == 0, r.stderr[-3000:]
    segmented_s = time.perf_counter() - t0

    final, reference = checkpoint.latest(run_dir), checkpoint.latest(args.out / "reference")
    same = hashes(final) == hashes(reference) and state(final) == state(reference)
    summary = {"steps": args.steps, "ranks": args.ranks, "seed": args.seed, "faults_injected": len(faults),
               "by_kind": {k: sum(f["kind"] == k for f in faults) for k in INFRA + DATA},
               "survived": len(log), "launches": launches, "steps_recomputed": steps_recomputed(log),
               "reference_one_launch_s": round(ref_s, 1), "segmented_no_faults_s": round(segmented_s, 1),
               "soak_s": round(soak_s, 1), "overhead_vs_segmented": round(soak_s / segmented_s - 1, 3),
               "bitwise_equal_to_reference": same, "final_step": state(final)[0]}
    print(json.dumps(summary, indent=1))
    (args.out / "soak.json").write_text(json.dumps({"summary": summary, "faults": log}, indent=1))
    if not same:
        sys.exit("soak: the final checkpoint differs from the reference")


if __name__ == "__main__":
    main()
