"""Soak: a long run on several ranks that meets a fault every ~20 steps, ended equal to a clean run.

    python benchmarks/long/soak.py [--steps 200] [--ranks 4] [--every 20] [--seed 0] [--out /tmp/soak]

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
deterministically. So the reference is one uninterrupted launch with the same data faults, keeping
every checkpoint, and each segment of the soak is judged against it:

  fired      the fault left its mark: a torchrun restart or a failed launch (kill, hang, enospc); a
             preemption exit 0 at a step before the segment's end and a relaunch resumed from that
             step (sigterm: it lands in the segment's first 4 steps, so the job stops at the next
             sync point mid-segment, at a step with no regular checkpoint); the straggler named
             slowest in the metrics (slow); a skipped update or a rollback in the metrics (nan_grad,
             poison)
  recovered  the segment's last launch exited 0, its checkpoint at the segment's end is bitwise the
             reference's at that step (every .distcp file's sha256, the step, data position and RNG),
             and the segment's logged losses, gradient norms, learning rates and guard events are
             the reference's, row for row

A fault counts as survived only when both hold. The soak passes when every fault survived and the
final checkpoint is bitwise the reference's. Prints a row per fault with its evidence, steps
recomputed and the wall-time overhead.
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

from flopwise.checkpoints import checkpoint
from flopwise.data.prepare import prepare_data
from flopwise.data.shards import read_index, resolve_input
from flopwise.errors import DataError

INFRA = ("kill", "hang", "sigterm", "enospc", "slow")
DATA = ("nan_grad", "poison")
CKPT_EVERY = 10


LOG_EVERY = 5  # a sync point every 5 steps: where a SIGTERM is acted on


def overrides(run_dir: Path, data: Path, steps: int, keep: int = 3) -> list[str]:
    kw = {
        "run.dir": f'"{run_dir}"',
        "data.path": f'"{data}"',
        "model.preset": '"demo-tiny"',
        "data.seq_len": 32,
        "train.global_batch": 8,
        "train.micro_batch": 2,
        "train.dtype": '"fp32"',
        "train.steps": steps,
        "train.eval_every": 0,
        "train.eval_batches": 1,
        "train.sample_tokens": 0,
        "optim.warmup_steps": 2,
        "log.every": LOG_EVERY,
        "checkpoint.interval": CKPT_EVERY,
        "checkpoint.keep": keep,
        "parallel.zero": 3,
        "guard.window": 10,
        "guard.min_window": 5,
        "guard.skip_batches": 2,
        "watchdog.collective_timeout_s": 15,
        "watchdog.min_s": 2,
        "watchdog.hang_factor": 3,
    }
    return [f"{k}={v}" for k, v in kw.items()]


def launch(
    args, run_dir: Path, data: Path, faults: str, stop_after: int | None, restarts: int, keep: int = 3
) -> subprocess.CompletedProcess:
    """One torchrun job; each on its own port (a killed or hung job's port may not be free at once)."""
    args.port += 1
    ov = overrides(run_dir, data, args.steps, keep) + ([f"train.stop_after={stop_after}"] if stop_after else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLOPWISE_FAULTS": faults, "COLUMNS": "400"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(args.ranks),
        "--max-restarts",
        str(restarts),
        "--master-port",
        str(args.port),
        "-m",
        "flopwise",
        "train",
        *ov,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)


def schedule(args) -> list[dict]:
    """One fault per segment after the first (the guard needs a window of losses first)."""
    rng = random.Random(args.seed)
    kinds = list(INFRA + DATA)
    out = []
    for start in range(args.every, args.steps, args.every):
        kind = kinds[len(out) % len(kinds)] if len(out) < len(kinds) else rng.choice(kinds)  # each kind once first
        step = rng.randrange(start + 2, start + args.every - 1)
        if kind == "sigterm":  # in the first sync interval: the job stops mid-segment, not at a checkpoint step
            step = start + 1 + step % (LOG_EVERY - 1)
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


def same_state(a: Path | None, b: Path | None) -> bool:
    """Bitwise the same training state: every .distcp file's sha256, the step, data position, RNG."""
    return a is not None and b is not None and hashes(a) == hashes(b) and state(a) == state(b)


def metrics(run_dir: Path, lo: int, hi: int) -> tuple[list, list]:
    """(loss rows, guard events) logged for steps lo < step <= hi, in order: what the run that
    reached `hi` did there (a resume drops the rows past its checkpoint)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if lo < r.get("step", -1) <= hi]
    return (
        [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in rows if "loss" in r],
        [(r["step"], r["event"]) for r in rows if "event" in r],
    )


def slowest_after(run_dir: Path, step: int) -> int | None:
    """The rank the metrics name slowest over the sync interval holding `step`."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return next((r.get("slowest_rank") for r in rows if "loss" in r and r["step"] >= step), None)


def fired(f: dict, start: int, first, relaunch, restarts: list[int], run_dir: Path) -> tuple[bool, str]:
    """Whether the fault left its mark on the launches or the metrics, and which."""
    kind, end = f["kind"], f["segment_end"]
    if kind in ("kill", "hang", "enospc"):
        ok = bool(restarts) or first.returncode != 0
        return ok, (
            f"torchrun restarted from step {restarts}"
            if restarts
            else f"exit {first.returncode}, relaunched"
            if first.returncode
            else "no restart, no failure"
        )
    if kind == "sigterm":
        stops = [int(x) for x in re.findall(r"preempted by .*? at step (\d+)", first.stdout)]
        back = [int(x) for x in re.findall(r"step-\d{8} at step (\d+)", relaunch.stdout)] if relaunch else []
        ok = (
            first.returncode == 0
            and len(stops) == 1
            and start < stops[0] < end
            and stops[0] % CKPT_EVERY != 0
            and back[:1] == stops
        )
        return ok, f"exit {first.returncode}, preempted at step {stops}, relaunch resumed from {back[:1]}"
    if kind == "slow":
        who = slowest_after(run_dir, f["step"])
        return who == f["rank"], f"metrics name rank {who} slowest over step {f['step']}"
    _, events = metrics(run_dir, start, end)
    want = "skipped_update" if kind == "nan_grad" else "rollback"
    hits = [s for s, e in events if e == want and s >= f["step"]]
    return bool(hits), f"{want} at step {hits}"


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
        prepare_data([str(chapters)], data, tokenizer="bpe:512", val_fraction=0.1, seed=0)
    for name in ("reference", "soak", "segmented"):  # a fresh run each time
        shutil.rmtree(args.out / name, ignore_errors=True)
    faults = schedule(args)
    data_faults = ",".join(spec(f) for f in faults if f["kind"] in DATA)

    t0 = time.perf_counter()
    ref_dir = args.out / "reference"
    ref = launch(args, ref_dir, data, data_faults, None, 0, keep=args.steps // CKPT_EVERY + 1)  # keeps them all
    ref_s = time.perf_counter() - t0
    assert ref.returncode == 0, ref.stderr[-3000:]

    run_dir, log, segments = args.out / "soak", [], []
    launches = 0
    t0 = time.perf_counter()
    for f in [None, *faults]:  # the first segment has no fault; it is checked all the same
        end = f["segment_end"] if f else args.every
        start = end - args.every
        fresh = not (run_dir / "checkpoints").exists()  # the first launch starts from nothing
        first = launch(args, run_dir, data, spec(f) if f else "", end, 1)
        launches += 1
        restarts = [int(x) for x in re.findall(r"step-(\d{8}) at step", first.stdout)][0 if fresh else 1 :]
        rcs, relaunch = [first.returncode], None
        if first.returncode != 0 or (f and f["kind"] == "sigterm"):  # the scheduler starts the job again
            relaunch = launch(args, run_dir, data, "", end, 0)
            launches += 1
            rcs.append(relaunch.returncode)
        last = relaunch or first
        mine, ref_ckpt = checkpoint.latest(run_dir), checkpoint.step_dir(ref_dir, end)
        losses, events = metrics(run_dir, start, end)
        ref_losses, ref_events = metrics(ref_dir, start, end)
        check = {
            "exit": rcs,
            "checkpoint": mine.name if mine else None,
            "state_equal": last.returncode == 0
            and mine == checkpoint.step_dir(run_dir, end)
            and same_state(mine, ref_ckpt),
            "loss_rows_equal": f"{sum(a == b for a, b in zip(losses, ref_losses, strict=False))}/{len(ref_losses)}",
            "events_equal": events == ref_events,
        }
        recovered = check["state_equal"] and losses == ref_losses and len(losses) > 0 and check["events_equal"]
        segments.append({"segment": [start, end], **check, "recovered": recovered})
        if f is None:
            print(
                f"{'(no fault)':34s} segment to {end:4d}: exit {rcs}, state equal {check['state_equal']}, "
                f"losses {check['loss_rows_equal']}",
                flush=True,
            )
            if not recovered:
                sys.exit(
                    f"soak: the fault-free first segment differs from the reference: {check}\n{last.stderr[-3000:]}"
                )
            continue
        fail_at = start + CKPT_EVERY * f["save"] if f["kind"] == "enospc" else f["step"]
        resumed = restarts + (
            [int(re.findall(r"step-(\d{8}) at step", relaunch.stdout)[0])]
            if relaunch is not None and relaunch.returncode == 0
            else []
        )
        hit, evidence = fired(f, start, first, relaunch, restarts, run_dir)
        outcome = (
            "finished" + (f" after {len(restarts)} restart(s)" if restarts else "")
            if relaunch is None
            else (f"exit {first.returncode}" if first.returncode else "stopped") + " + relaunch"
        )
        log.append(
            {
                **f,
                "failed_at": fail_at,
                "resumed_from": resumed,
                "outcome": outcome,
                "fired": hit,
                "evidence": evidence,
                **check,
                "survived": hit and recovered,
            }
        )
        print(
            f"{spec(f):34s} segment to {end:4d}: {outcome}; fired {hit} ({evidence}); state equal "
            f"{check['state_equal']}, losses {check['loss_rows_equal']}, events equal {check['events_equal']}"
            f" -> survived {hit and recovered}",
            flush=True,
        )
    soak_s = time.perf_counter() - t0

    # the same launches without faults: what the segmentation itself costs
    t0 = time.perf_counter()
    for end in range(args.every, args.steps + 1, args.every):
        r = launch(args, args.out / "segmented", data, data_faults, end, 0)
        assert r.returncode == 0, r.stderr[-3000:]
    segmented_s = time.perf_counter() - t0

    final, reference = checkpoint.latest(run_dir), checkpoint.latest(ref_dir)
    same = same_state(final, reference)
    survived = sum(f["survived"] for f in log)
    summary = {
        "steps": args.steps,
        "ranks": args.ranks,
        "seed": args.seed,
        "faults_injected": len(faults),
        "by_kind": {k: sum(f["kind"] == k for f in faults) for k in INFRA + DATA},
        "survived": survived,
        "survived_by_kind": {k: sum(f["survived"] for f in log if f["kind"] == k) for k in INFRA + DATA},
        "segments_equal_to_reference": sum(s["recovered"] for s in segments),
        "segments": len(segments),
        "sigterm_stops_mid_segment": [(f["step"], f["resumed_from"]) for f in log if f["kind"] == "sigterm"],
        "launches": launches,
        "steps_recomputed": steps_recomputed(log),
        "reference_one_launch_s": round(ref_s, 1),
        "segmented_no_faults_s": round(segmented_s, 1),
        "soak_s": round(soak_s, 1),
        "overhead_vs_segmented": round(soak_s / segmented_s - 1, 3),
        "bitwise_equal_to_reference": same,
        "final_step": state(final)[0] if final else None,
    }
    print(json.dumps(summary, indent=1))
    (args.out / "soak.json").write_text(json.dumps({"summary": summary, "faults": log, "segments": segments}, indent=1))
    if not same or survived < len(faults):
        sys.exit(
            f"soak: {len(faults) - survived} fault(s) not survived; final checkpoint equal to the reference: {same}"
        )


if __name__ == "__main__":
    main()
