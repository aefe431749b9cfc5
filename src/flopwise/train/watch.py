"""What every rank watches while it trains: preemption signals, hung steps, and each other.

- SIGTERM / SIGUSR1 (SLURM's warning signal, `--signal=USR1@120`) and a first Ctrl-C (SIGINT)
  only set a flag: training goes on to the next sync point (a log, eval or checkpoint step), where
  every rank learns of it and the job checkpoints and exits 0. A second Ctrl-C stops at once.
- A watchdog thread dumps every thread's Python stack (faulthandler) to stderr and to
  `<run.dir>/hang-rank{R}.txt` when a step has run `watchdog.hang_factor` × the median step time
  (and at least `watchdog.min_s`). A hung collective then fails after
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

import faulthandler
import signal
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from flopwise.config import WatchdogConfig

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@dataclass
class Sync:
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

    def __enter__(self) -> Watch:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._on_signal)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            if self.signal == "SIGINT":  # asked twice: stop now, losing the steps since the last checkpoint
                raise KeyboardInterrupt
            self.report("Ctrl-C: stopping at the next log step with a checkpoint; Ctrl-C again to stop now "
                        "without one")
        self.signal = signal.Signals(signum).name

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
        while not self._stop.wait(0.2):
            step, elapsed = self._step, time.monotonic() - self._t
            if step and step != self._dumped and elapsed > self.limit_s():
                self._dumped = step
                self._dump(step, elapsed)

    def _dump(self, step: int, elapsed: float) -> None:
        median = self.median_step_s()
        why = f"step {step} has run {elapsed:.1f} s" + (f" (median step {median:.2f} s)" if median else "")
        with open(self.dump_path, "w") as f:
            f.write(f"rank {self.rank}: {why}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        self.report(f"watchdog: rank {self.rank}: {why}; every thread's stack is in {self.dump_path}")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    def arrived(self) -> None:
        """This rank reached the step's last collective: the time since the step began is its
        own work (what follows is waiting for the others), the figure that names a straggler."""
        self._busy += time.perf_counter() - self._step_start

    def sync(self, save_failed: bool, values: torch.Tensor) -> tuple[Sync, list[float]]:
        """The sync point (every rank calls it at the same steps): preemption and failed saves
        seen by any rank, each rank's own work time since the previous sync (`arrived`), and `values` (a device tensor
        of the steps since) read on the host, all in one device-to-host transfer."""
        mine = [self._busy, float(self.signal is not None), float(save_failed)]
        n = values.numel()
        if dist.is_initialized():
            parts = [torch.empty(3, dtype=torch.float64, device=self.device) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, torch.tensor(mine, dtype=torch.float64, device=self.device))
            host = torch.cat([values.flatten().double(), *parts]).tolist()
            rows = [host[n + 3 * r:n + 3 * r + 3] for r in range(len(parts))]
        else:
            host, rows = values.flatten().double().tolist(), [mine]
        self._busy = 0.0
        sync = Sync(any(r[1] for r in rows), any(r[2] for r in rows), [r[0] for r in rows])
        return sync, host[:n]


PEER_LOST = ("connection closed by peer", "connection reset by peer")


def peer_lost(e: BaseException) -> bool:
    """A collective that failed because another rank's process went away (gloo's wording), rather
    than one that waited out the timeout."""
    return any(p in str(e).lower() for p in PEER_LOST)


def is_timeout(e: BaseException) -> bool:
    """A collective that gave up waiting (a rank hung or died), as gloo and NCCL report it: their
    distributed error types, or gloo's "Timed out waiting" / NCCL watchdog wording. Any other
    error that merely mentions a timeout is not one."""
    text = str(e).lower()
    if isinstance(e, getattr(torch.distributed, "DistBackendError", ())):
        return True
    return isinstance(e, RuntimeError) and any(p in text for p in (
        "timed out waiting", "collective operation timeout", "gloo timeout", "wait timeout", *PEER_LOST))
