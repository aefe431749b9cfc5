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

_STEP = re.compile(r"^step (\d+)/(\d+) ")
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
    job = _Job(_launch(overrides, nproc), random.Random(seed))
    threading.Thread(target=job.kill_after, args=(gaps,), daemon=True).start()
    deadline = threading.Timer(timeout_s, job.stop, ("timeout",))
    deadline.start()
    try:
        job.follow(from_step, until)
    finally:
        deadline.cancel()
        if job.proc.poll() is None:  # interrupted here: leave nothing running
            job.stop("interrupted")
        job.done.set()
        job.started.set()
    return job.outcome(timeout_s)


def _launch(overrides: list[str], nproc: int) -> subprocess.Popen:
    """`flopwise train` under torchrun, its output piped line by line, dying with this process."""
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
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=_die_with_parent,
    )


class _Job:
    """A training job under torchrun, the timeline of its logged steps and kills, and why this process
    ended it early, if it did."""

    def __init__(self, proc: subprocess.Popen, rng: random.Random) -> None:
        self.proc, self.rng, self.t = proc, rng, Timeline()
        self.started, self.done = threading.Event(), threading.Event()
        self.ended: list[str] = []  # why this process ended the job early: "until" or "timeout"

    def strike(self) -> None:
        """SIGKILL a random worker, waiting for one to start if none is alive."""
        while not self.done.is_set():
            victims = workers(self.proc.pid)
            if victims:
                try:
                    os.kill(self.rng.choice(victims), signal.SIGKILL)
                except ProcessLookupError:  # it exited between the listing and the kill
                    continue
                self.t.kills.append(time.monotonic())
                return
            self.done.wait(0.05)

    def kill_after(self, gaps: Iterable[float]) -> None:
        """Strike after each gap, counted from the step the schedule starts at."""
        self.started.wait()
        due = time.monotonic()
        for gap in gaps:
            due += gap
            if self.done.wait(max(0.0, due - time.monotonic())):
                return
            self.strike()

    def stop(self, why: str) -> None:
        self.ended.append(why)
        self.done.set()
        for pid in [self.proc.pid, *workers(self.proc.pid)]:  # torchrun starts each worker in a session of its own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # already gone
                pass

    def follow(self, from_step: int, until: Callable[[Timeline], bool] | None) -> None:
        """Record each logged step until the job ends (its last step, `until`, or a stop)."""
        assert self.proc.stdout is not None  # piped by _launch
        t = self.t
        for line in self.proc.stdout:
            t.output.append(line)
            m = _STEP.match(line)
            if not m or self.done.is_set():
                continue
            t.lines.append((time.monotonic(), int(m[1])))
            if int(m[1]) >= from_step:
                self.started.set()
            if int(m[1]) == int(m[2]):
                self.done.set()
            elif until is not None and until(t):
                self.stop("until")
        self.proc.wait()

    def outcome(self, timeout_s: float) -> Timeline:
        """The timeline, or a one-line error with the cause torchrun printed."""
        lines = [line.strip() for line in self.t.output if line.strip()] or ["no output"]
        last = next((line for line in reversed(lines) if "error" in line.lower()), lines[-1])[:300]  # the cause
        if "timeout" in self.ended:
            raise FlopwiseError(f"training under failures still ran after {timeout_s:g} s and was killed: {last}")
        if not self.ended and self.proc.returncode != 0:
            raise FlopwiseError(f"training under failures failed (exit {self.proc.returncode}): {last}")
        self.t.returncode = None if self.ended else self.proc.returncode
        return self.t
