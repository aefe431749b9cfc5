"""What every rank watches while it trains: preemption signals, hung steps, and each other.

- SIGTERM / SIGUSR1 (SLURM's warning signal, `--signal=USR1@120`), SIGHUP (a closed ssh session)
  and a first Ctrl-C (SIGINT) only set a flag: training goes on to the next sync point (a log,
  eval or checkpoint step; the next step on one process), where every rank learns of it and the
  job checkpoints and exits 0.
  A second Ctrl-C stops at once. Both are acted on at once even in the middle of a step: Python
  runs a signal handler only when the main thread is back in bytecode, which a CPU step of a 135M
  model keeps it out of for a minute (the acknowledgement came ~63 s late, and a second Ctrl-C in
  that time was merged into the first). So the signal's wake-up byte (`signal.set_wakeup_fd`,
  written by CPython's C-level handler) is read by the watchdog thread, which says so at once and,
  on the second Ctrl-C, ends the process (exit 130; the last complete checkpoint stays).
- A watchdog thread says so in one line and appends every thread's Python stack (faulthandler)
  to `<run.dir>/hang-rank{R}.txt` when a step has run `watchdog.hang_factor` × the median step
  time (and at least `watchdog.min_s`). A hung collective then fails after
  `watchdog.collective_timeout_s` (the process group timeout) and torchrun restarts the job.
- The sync point (each log, eval and checkpoint step): one small all-gather of each rank's flags
  (preempt, failed async save), so all ranks take the same decision, and of its own work time
  since the previous sync: each step's time until it reaches the step's last collective (the
  non-finite flag's all-reduce), not the waiting for the others there. Collectives earlier in a
  step make ranks wait for each other too, so these times separate ranks that are slow after the
  gradient reduction (data loading, host stalls, clipping); the slowest rank is named in the
  metrics.
"""

from __future__ import annotations

import _thread
import faulthandler
import os
import select
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from flopwise.config.schema import WatchdogConfig
from flopwise.errors import FlopwiseError
from flopwise.files import rundir

_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)  # SIGHUP: a closed ssh session
_ABORT_GRACE_S = 1.0  # a second Ctrl-C: how long the main thread has to take its KeyboardInterrupt


@dataclass
class _Sync:
    """What all ranks agreed on at a sync point."""

    stop: bool
    save_failed: bool
    rank_s: list[float]

    @property
    def slowest(self) -> int:
        return max(range(len(self.rank_s)), key=self.rank_s.__getitem__)


class Watch:
    def __init__(self, cfg: WatchdogConfig, run_dir: Path, rank: int, device: torch.device, report=print):
        self.cfg, self.rank, self.device, self.report = cfg, rank, device, report
        self.dump_path = run_dir / f"hang-rank{rank}.txt"
        self.signal: str | None = None
        self.durations: deque[float] = deque(maxlen=100)
        self._step, self._t, self._dumped = 0, time.monotonic(), -1
        self._busy, self._step_start = 0.0, time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flopwise-watchdog", daemon=True)
        self._previous: dict = {}
        self._wakeup: tuple[int, int] | None = None  # (read, write) ends of the signals' wake-up pipe
        self._previous_fd = -1
        self._interrupts = 0
        self._aborting = False
        self.abort = self._exit_now  # the second Ctrl-C's action (a test replaces it)

    def __enter__(self) -> Watch:
        if threading.current_thread() is threading.main_thread():
            for s in _SIGNALS:
                self._previous[s] = signal.signal(s, self._on_signal)
            r, w = os.pipe()
            os.set_blocking(w, False)
            self._wakeup = (r, w)
            self._previous_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_fd)
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    def _on_signal(self, signum, frame) -> None:
        """Python's handler, run once the main thread is back in bytecode; with the wake-up pipe
        the watchdog thread has already acted on the signal (and asks for a KeyboardInterrupt here
        after a second Ctrl-C: `_exit_now`)."""
        if self._wakeup is None and signum == signal.SIGINT:
            self._interrupt()
        self.signal = signal.Signals(signum).name
        if self._aborting and signum == signal.SIGINT:
            raise KeyboardInterrupt

    def _signalled(self, data: bytes) -> None:
        """Signal numbers read from the wake-up pipe (watchdog thread), as they arrive."""
        for signum in data:
            if signum in _SIGNALS:
                if signum == signal.SIGINT:
                    self._interrupt()
                self.signal = signal.Signals(signum).name

    def _interrupt(self) -> None:
        self._interrupts += 1
        if self._interrupts == 1:
            self.report(
                "Ctrl-C: stopping at the end of this step with a checkpoint; Ctrl-C again to stop now without one"
            )
        elif self._interrupts == 2:  # asked twice: stop now, losing the steps since the last checkpoint
            self.report("Ctrl-C again: stopping now, without a checkpoint (the last complete one is kept)")
            self.abort()

    def _exit_now(self) -> None:
        """The second Ctrl-C: a KeyboardInterrupt in the main thread as soon as it runs Python again
        (the usual way out, with its clean-up); if a long step keeps it in C code, the process
        ends (exit 130) after ABORT_GRACE_S."""
        self._aborting = True
        if threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt
        _thread.interrupt_main()  # runs _on_signal(SIGINT) in the main thread, which raises
        if not self._stop.wait(_ABORT_GRACE_S):  # still in the step
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)

    def beat(self, step: int) -> None:
        """Step `step` starts now (the previous one ended)."""
        self._step_start = time.perf_counter()
        now = time.monotonic()
        if self._step:
            self.durations.append(now - self._t)
        self._step, self._t = step, now

    @property
    def step(self) -> int:
        """The step in progress."""
        return self._step

    def median_step_s(self) -> float | None:
        return statistics.median(self.durations) if self.durations else None

    def limit_s(self) -> float:
        median = self.median_step_s()
        return max(self.cfg.min_s, self.cfg.hang_factor * median) if median is not None else self.cfg.min_s

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._wakeup is not None:
                if select.select([self._wakeup[0]], [], [], 0.2)[0]:
                    try:
                        self._signalled(os.read(self._wakeup[0], 64))
                    except OSError:  # closed by __exit__ meanwhile
                        return
            elif self._stop.wait(0.2):
                return
            step, elapsed = self._step, time.monotonic() - self._t
            if step and step != self._dumped and elapsed > self.limit_s():
                self._dumped = step
                self._dump(step, elapsed)

    def _dump(self, step: int, elapsed: float) -> None:
        """One line for the terminal, every thread's stack appended to the report (the terminal got
        them too, ~40 lines per slow step: noise in a log where one line says where to look); the
        report keeps each dump, so every line's step is still there to read."""
        median = self.median_step_s()
        why = f"step {step} has run {elapsed:.1f} s" + (f" (median step {median:.2f} s)" if median else "")
        with tempfile.TemporaryFile("w+b") as f:  # faulthandler needs a real file; the run folder gets its bytes
            f.write(f"rank {self.rank}: {why}\n".encode())
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            stacks = f.read()
        try:
            rundir.append(self.dump_path.parent, self.dump_path.name, stacks + b"\n")
        except (OSError, FlopwiseError) as e:  # in this thread an exception would be a traceback, and the stacks lost
            self.report(
                f"watchdog: rank {self.rank}: {why}; {self.dump_path.name} cannot be written "
                f"({' '.join(str(e).split())[:200]}): every thread's stack follows on stderr"
            )
            sys.stderr.write(stacks.decode(errors="replace"))
            return
        self.report(f"watchdog: rank {self.rank}: {why}; every thread's stack is in {self.dump_path}")

    def arrived(self) -> None:
        """This rank reached the step's last collective: the time since the step began is its
        own work (what follows is waiting for the others), the figure that names a straggler."""
        self._busy += time.perf_counter() - self._step_start

    def sync(self, save_failed: bool, values: torch.Tensor) -> tuple[_Sync, list[float]]:
        """The sync point (every rank calls it at the same steps): preemption and failed saves
        seen by any rank, each rank's own work time since the previous sync (`arrived`), and `values` (a device tensor
        of the steps since) read on the host, all in one device-to-host transfer."""
        mine = [self._busy, float(self.signal is not None), float(save_failed)]
        n = values.numel()
        if dist.is_initialized():
            parts = [torch.empty(3, dtype=torch.float64, device=self.device) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, torch.tensor(mine, dtype=torch.float64, device=self.device))
            host = torch.cat([values.flatten().double(), *parts]).tolist()
            rows = [host[n + 3 * r : n + 3 * r + 3] for r in range(len(parts))]
        else:
            host, rows = values.flatten().double().tolist(), [mine]
        self._busy = 0.0
        sync = _Sync(any(r[1] for r in rows), any(r[2] for r in rows), [r[0] for r in rows])
        return sync, host[:n]


_PEER_LOST = ("connection closed by peer", "connection reset by peer")


def peer_lost(e: BaseException) -> bool:
    """A collective that failed because another rank's process went away (gloo's wording), rather
    than one that waited out the timeout."""
    return any(p in str(e).lower() for p in _PEER_LOST)


def is_timeout(e: BaseException) -> bool:
    """A collective that gave up waiting (a rank hung or died), as gloo and NCCL report it: their
    distributed error types, or gloo's "Timed out waiting" / NCCL watchdog wording. Any other
    error that merely mentions a timeout is not one."""
    text = str(e).lower()
    if isinstance(e, getattr(torch.distributed, "DistBackendError", ())):
        return True
    return isinstance(e, RuntimeError) and any(
        p in text
        for p in ("timed out waiting", "collective operation timeout", "gloo timeout", "wait timeout", *_PEER_LOST)
    )
