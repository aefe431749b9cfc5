"""When and how the training loop checkpoints: the interval (fixed, or Young/Daly from the measured
write time), sync or async writes with at most one in flight, and what a failed write does.

An async save (`checkpoint.async=true`) stages the tensors to host memory, returns, and lets DCP's
background thread write them over a dedicated gloo group (so its collectives never interleave with
training's); rank 0 completes it (state, checksums, manifest, rename, retention) in a second
background thread once the write is done; the loop checks for it every step. The next save and
the end of the run wait for it.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from rich.markup import escape
from torch.distributed.checkpoint.api import CheckpointException

from flopwise.checkpoints import checkpoint
from flopwise.config.schema import Config
from flopwise.errors import CheckpointError
from flopwise.parallel.mesh import is_rank0
from flopwise.plan.reliability import DEFAULT_GPU_MTBF_HOURS, daly_interval
from flopwise.train.faults import Faults

logger = logging.getLogger(__name__)

_AUTO_PROBE_STEP = 5  # interval=auto: the first save, after enough steps for a median step time


@dataclass
class _Pending:
    step: int
    tmp: Path
    future: Future  # of _finish_async
    t0: float


class Saver:
    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        parts: list,
        optimizer,
        snapshot: Callable[[], dict],
        files: Mapping[str, Path | bytes],
        faults: Faults,
        world: int,
    ):
        self.cfg, self.run_dir, self.parts, self.optimizer = cfg, run_dir, parts, optimizer
        self.snapshot, self.files, self.faults, self.world = snapshot, files, faults, world
        c = cfg.checkpoint
        self.every = None if c.interval == "auto" else c.interval
        self.pending: _Pending | None = None
        self.failure: str | None = None  # of a finished async write, until reported
        self.last: Path | None = None
        self.write_s: list[float] = []  # what each save blocked the training loop
        self.async_s: list[float] = []  # async saves: from the call until written and complete
        self.async_group, self._pool = None, None
        if c.async_save:
            self.async_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="flopwise-checkpoint")
        self.is_main = is_rank0()

    def due(self, done: int, last: bool) -> bool:
        if last:
            return True
        if self.every is None:  # auto, not measured yet
            return done == _AUTO_PROBE_STEP
        return bool(self.every) and done % self.every == 0

    def save(self, done: int, step_times: list[float]) -> None:
        """Checkpoint step `done` (every rank); a failure stops or warns per checkpoint.on_error."""
        self.wait()
        t0 = time.perf_counter()
        try:
            tmp, future = checkpoint.begin(
                self.run_dir,
                done,
                self.parts,
                self.optimizer,
                self.faults.writer,
                self.cfg.checkpoint.async_save,
                self.async_group,
            )
            if future is None:
                self.last = checkpoint.finish(
                    self.run_dir, done, tmp, self.snapshot(), self.files, self.cfg.checkpoint.keep
                )
            else:
                assert self._pool is not None  # made with the async group: only an async save has a future
                self.pending = _Pending(
                    done, tmp, self._pool.submit(self._finish_async, done, tmp, future, self.snapshot()), t0
                )
        except CheckpointError as e:
            self.failed(str(e))
        self.write_s.append(time.perf_counter() - t0)
        if self.every is None:
            self._auto_interval(step_times)

    def _auto_interval(self, step_times: list[float]) -> None:
        """Daly's interval for this job: write cost δ measured just now, job MTBF = device MTBF / devices."""
        c = self.cfg.cluster
        write = self.write_s[-1]
        mtbf_h = (c.gpu_mtbf_hours or DEFAULT_GPU_MTBF_HOURS) / self.world
        step_s = statistics.median(step_times) if step_times else 1.0
        tau = daly_interval(write, mtbf_h * 3600)
        every = [max(1, round(tau / step_s))]
        if dist.is_initialized():  # every rank's own timings differ a little: rank 0's choice is everyone's
            dist.broadcast_object_list(every, src=0)
        self.every = every[0]
        source = f"cluster.gpu_mtbf_hours={c.gpu_mtbf_hours:g}" if c.gpu_mtbf_hours else "Llama 3's failure rate"
        logger.info(
            f"[bold]checkpoint.interval=auto[/]: write {write:.3g} s, job MTBF {mtbf_h:,.3g} h "
            f"({source} over {self.world} device(s)) -> Daly interval {tau:,.4g} s = "
            f"every {self.every:,} steps of {step_s:.3g} s"
        )

    def poll(self) -> bool:
        """Take in a finished async save; True when one failed (the step sync tells every rank)."""
        p = self.pending
        if p is not None and p.future.done():
            self.pending = None
            self._complete(p)
        return self.failure is not None

    def _finish_async(self, step: int, tmp: Path, written: Future, state: dict) -> Path | None:
        """In the background: wait for DCP's write, then (rank 0) checksum, manifest, rename, prune."""
        written.result()
        if not self.is_main:
            return None
        return checkpoint.finish(self.run_dir, step, tmp, state, self.files, self.cfg.checkpoint.keep, collective=False)

    def _complete(self, p: _Pending) -> None:
        try:
            self.last = p.future.result() or self.last
            self.async_s.append(time.perf_counter() - p.t0)
        except (Exception, CheckpointException) as e:  # the background write's error (DCP's is a BaseException)
            checkpoint.abandon(p.tmp)
            self.failure = (
                str(e)
                if isinstance(e, CheckpointError)
                else str(checkpoint.not_written(self.run_dir, p.step, checkpoint.reason(e)))
            )

    def wait(self) -> None:
        """Block until the async write in flight (if any) is complete (every rank, collectively);
        act on a failed one."""
        p, self.pending = self.pending, None
        if p is not None:
            self._complete(p)
        failures = [self.failure]
        if dist.is_initialized():
            failures = [None] * dist.get_world_size()
            dist.all_gather_object(failures, self.failure)
        if any(failures):
            self.failed(next(f for f in failures if f))

    def failed(self, message: str | None = None) -> None:
        """Act on a failed write that every rank knows of (the message: rank 0's when it has one)."""
        message, self.failure = message or self.failure or "an async checkpoint write failed on another rank", None
        if self.cfg.checkpoint.on_error == "stop":
            raise CheckpointError(message)
        logger.warning(f"[yellow]warning[/]: {escape(message)}; training goes on (checkpoint.on_error=continue)")
