"""Failures from outside, to measure goodput: `flopwise train` under torchrun `--max-restarts` while
this process SIGKILLs one of its workers at chosen times, recording when each step was logged and
when each failure struck (plan.reliability.account turns the two into goodput and its parts).

The schedule is a sequence of gaps in seconds, counted from a logged step (the first by default):
fixed ones (a test's kill just after step N) or `exponential_gaps` (failures at a mean time between
failures, M).
A failure due while no worker is alive (torchrun between two generations of workers) strikes the
next worker to start: in the exponential model a failure during a restart restarts it, and so does
killing a starting worker. Used by tests/train/test_goodput.py and benchmarks/long/goodput.py.
"""

from __future__ import annotations

import ctypes
import math
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from flopwise.errors import FlopwiseError
from flopwise.parallel.mesh import torchrun

STEP = re.compile(r"^step (\d+)/(\d+) ")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class Timeline:
    lines: list[tuple[float, int]] = field(default_factory=list)  # (time.monotonic(), step) of each step logged
    kills: list[float] = field(default_factory=list)  # time.monotonic() of each SIGKILL that struck a worker
    output: list[str] = field(default_factory=list)  # what torchrun and its workers printed
    returncode: int | None = None  # None: stopped by `until` before the end


def exponential_gaps(mtbf_s: float, seed: int) -> Iterator[float]:
    """Exponential gaps of mean `mtbf_s`: a randomly shifted van der Corput sequence through the inverse
    CDF. Each gap is exponential; unlike independent draws, their running mean stays near the mean
    over the tens of failures a run can afford (a low-discrepancy sequence covers the distribution
    evenly), so one run measures the rate it was asked for."""
    shift = random.Random(seed).random()
    i = 1
    while True:
        q, f, n = 0.0, 0.5, i
        while n:
            q, n, f = q + f * (n & 1), n >> 1, f / 2
        yield -mtbf_s * math.log(1 - (q + shift) % 1.0)
        i += 1


def workers(agent: int) -> list[int]:
    """The flopwise worker processes torchrun agent `agent` runs now."""
    out = []
    children = Path(f"/proc/{agent}/task/{agent}/children")
    for pid in children.read_text().split() if children.exists() else []:
        try:
            if b"flopwise" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(int(pid))
        except OSError:  # exited meanwhile
            continue
    return out


def _die_with_parent() -> None:
    """In torchrun's process before it starts (Linux): SIGTERM when the process that launched it dies,
    however it dies (a harness killed by a timeout), so that torchrun stops its workers and exits
    instead of training on as an orphan."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run_under_failures(
    overrides: list[str],
    gaps: Iterable[float],
    *,
    nproc: int = 2,
    seed: int = 0,
    from_step: int = 1,
    until: Callable[[Timeline], bool] | None = None,
    timeout_s: float = 3600.0,
) -> Timeline:
    """Train `overrides` on `nproc` ranks (torchrun --standalone --max-restarts 1000), SIGKILLing a
    random worker after each gap of `gaps`, counted from the line of step `from_step`. `until(timeline)`,
    asked at each logged step, ends the job early (torchrun and its workers killed; returncode None).
    A job still running after `timeout_s` is killed and reported in one line."""
    cmd = torchrun(
        nproc,
        "--max-restarts",
        "1000",
        "-m",
        "flopwise",
        "train",
        *overrides,
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=_die_with_parent,
    )
    t = Timeline()
    started, done = threading.Event(), threading.Event()
    rng = random.Random(seed)

    def strike() -> None:
        while not done.is_set():
            victims = workers(proc.pid)
            if victims:
                try:
                    os.kill(rng.choice(victims), signal.SIGKILL)
                except ProcessLookupError:  # it exited between the listing and the kill
                    continue
                t.kills.append(time.monotonic())
                return
            done.wait(0.05)

    def killer() -> None:
        started.wait()
        due = time.monotonic()
        for gap in gaps:
            due += gap
            if done.wait(max(0.0, due - time.monotonic())):
                return
            strike()

    ended: list[str] = []  # why this process ended the job early: "until" or "timeout"

    def stop(why: str) -> None:
        ended.append(why)
        done.set()
        for pid in [proc.pid, *workers(proc.pid)]:  # torchrun starts each worker in a session of its own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # already gone
                pass

    threading.Thread(target=killer, daemon=True).start()
    deadline = threading.Timer(timeout_s, stop, ("timeout",))
    deadline.start()
    try:
        assert proc.stdout is not None  # piped above
        for line in proc.stdout:
            t.output.append(line)
            m = STEP.match(line)
            if not m or done.is_set():
                continue
            t.lines.append((time.monotonic(), int(m[1])))
            if int(m[1]) >= from_step:
                started.set()
            if int(m[1]) == int(m[2]):
                done.set()
            elif until is not None and until(t):
                stop("until")
        proc.wait()
    finally:
        deadline.cancel()
        if proc.poll() is None:  # interrupted here: leave nothing running
            stop("interrupted")
        done.set()
        started.set()
    lines = [line.strip() for line in t.output if line.strip()] or ["no output"]
    last = next((line for line in reversed(lines) if "error" in line.lower()), lines[-1])[:300]  # the cause
    if "timeout" in ended:
        raise FlopwiseError(f"training under failures still ran after {timeout_s:g} s and was killed: {last}")
    if not ended and proc.returncode != 0:
        raise FlopwiseError(f"training under failures failed (exit {proc.returncode}): {last}")
    t.returncode = None if ended else proc.returncode
    return t
