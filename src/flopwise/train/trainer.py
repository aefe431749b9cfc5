"""The training loop: step -> (every log/eval/save step) sync -> guard -> metrics -> eval -> checkpoint.

`flopwise.train.build.build_run` hands this loop a ready run (this rank's shards, optimizer, loader,
restored state). A step runs entirely on the device: the loss, the gradient norm and the
non-finite flag stay there, and a non-finite step is skipped there too (fused AdamW's found_inf).
The host reads them once per sync point (a log, eval or checkpoint step), which is what lets a
GPU's host run ahead; the guard then replays the steps since the last sync in order, so a spike
is acted on exactly as if it had been seen at once: the rollback goes to a checkpoint written
before it (every checkpoint step is a sync point) and skips past its batch. The cost: the steps
after a spike up to the sync point are computed and thrown away (at most log.every - 1), and a
preemption signal is acted on at the next sync point.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from flopwise import log
from flopwise.checkpoints import checkpoint
from flopwise.config.schema import Config, config_hash, to_toml
from flopwise.data.loader import eval_batches
from flopwise.data.mixture import Source
from flopwise.data.shards import read_index
from flopwise.data.tasks import load_task
from flopwise.data.tokenizer import side_files
from flopwise.errors import ConfigError, DataError, TrainingStopped
from flopwise.eval.generate import generate_tokens
from flopwise.eval.tasks import evaluate_task
from flopwise.files import rundir
from flopwise.files.outputs import read_records
from flopwise.flops import count_params, flops_per_token, mfu
from flopwise.hardware.catalogue import cluster_catalogue
from flopwise.layout.linears import unconverted_linears
from flopwise.layout.rules import Layout
from flopwise.model.transformer import Transformer
from flopwise.parallel.apply import config_compiles
from flopwise.parallel.mesh import DIMS, Parallel, across_nodes, missing_ranks
from flopwise.train.engine import Engine, autocast
from flopwise.train.faults import Faults, nan_grad, poison
from flopwise.train.guard import Verdict
from flopwise.train.metrics import MetricsWriter, Peak, checked_peak, device_peak, mfu_basis, plot_loss_curve
from flopwise.train.optim import lr_at, step_unless
from flopwise.train.preflight import explain_oom
from flopwise.train.run import Finished, Run, last_step, restore
from flopwise.train.saver import Saver
from flopwise.train.watch import Watch, is_timeout, peer_lost

logger = logging.getLogger(__name__)


# The first-steps watch of continued pre-training: a training loss this many nats above the step-0
# validation loss (e-fold perplexity) within the first steps is warned about
RISE_NATS, RISE_WATCH_STEPS = 1.0, 100


@dataclass(kw_only=True)
class TrainResult:
    run_dir: Path
    steps: int
    tokens: int
    train_loss: float
    val_loss: float | None
    unigram_entropy: float
    tokens_per_s: float
    mfu: float | None  # None: the window's rate reached even a re-measured ceiling (no honest denominator)
    peak: Peak | None  # per device; None: nothing trained here (a finished run), no ceiling measured
    seconds: float
    checkpoint: Path | None
    plot: Path | None = None
    sample: str = ""
    losses: list[float] = field(default_factory=list)
    is_main: bool = True  # rank 0 of a torchrun job (the one that reports)
    preempted: int | None = None  # the step a SIGTERM/SIGUSR1 stopped the run at (checkpoint written)
    signal: str | None = None
    save_s: list[float] = field(default_factory=list)  # how long each checkpoint save blocked training
    async_save_s: list[float] = field(default_factory=list)  # async: call to complete, in the background
    layout: str = "single"  # layout.rules.Layout.name() of the layout that ran


def _eval_sources(sources: list[Source], seq_len: int) -> list[Source]:
    """The sources whose validation split holds one sequence (more than data.seq_len tokens), which
    evaluation reads; refused when none does (a split holds whole documents: one document, none)."""
    usable = [s for s in sources if read_index(s.data_dir)["splits"]["val"]["tokens"] > seq_len]
    if not usable:
        where = "no source of data.sources has" if len(sources) > 1 else f"data {sources[0].data_dir} has no"
        raise DataError(
            f"{where} validation split of one data.seq_len={seq_len} sequence (it holds whole documents, "
            "data.val_fraction of them); give more documents or raise data.val_fraction"
        )
    return usable


def _validation_losses(engine: Engine, sources: list[Source], cfg: Config) -> tuple[float, dict[str, float]]:
    """Mean loss over the first validation windows of each source, in micro-batches (a pipeline
    evaluates micro_batch × its number of micro-batches at a time); the mixture's loss is the
    weight-averaged mean of the sources' that have a validation split (of one sequence or more)."""
    rows = cfg.train.micro_batch * (engine.n_micro if engine.schedule is not None else 1)
    sources = _eval_sources(sources, cfg.data.seq_len)
    by_source = {}
    for s in sources:
        losses = [engine.eval_loss(b) for b in eval_batches(s.data_dir, cfg.data.seq_len, rows, cfg.train.eval_batches)]
        by_source[s.name] = sum(losses) / len(losses)
    total = sum(s.weight for s in sources)
    return sum(by_source[s.name] * s.weight / total for s in sources), by_source


def train_step(run: Run, step: int, faults: Faults, watch: Watch | None = None) -> tuple[torch.Tensor, float]:
    """Optimizer step `step` (0-based), with no host sync: returns the device tensor [loss, grad
    norm, non-finite flag (agreed by every rank), this rank's weights non-finite after the update]
    and the learning rate used."""
    cfg, engine, done = run.cfg, run.engine, step + 1
    lr = lr_at(step, cfg.optim, cfg.train.steps)
    for g in run.optimizer.param_groups:
        g["lr"] = lr
    batch = run.loader.next_batch()
    if faults.at("poison", done):
        batch = poison(batch, cfg.model.vocab_size, done)
    loss = engine.forward_backward(batch)
    if faults.at("nan_grad", done):
        nan_grad(engine.parts)
    faults.fire(done)
    norm = engine.clip_grad_norm(cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf)
    bad = (
        (~(torch.isfinite(loss) & torch.isfinite(norm))).float()
        if cfg.guard.enabled
        else torch.zeros((), device=loss.device)
    )
    if watch is not None:
        watch.arrived()
    if dist.is_initialized():  # a NaN on one rank's gradients skips the step on every rank
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    step_unless(run.optimizer, bad > 0)
    run.optimizer.zero_grad(set_to_none=True)
    broken = engine.weights_nonfinite() if cfg.guard.enabled else torch.zeros((), device=loss.device)
    return torch.stack([loss.detach().float(), norm.detach().float(), bad, broken]), lr


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=log.console(),
        transient=False,
    )


class _Loop:
    """The loop's state between sync points, and what it does at one."""

    def __init__(self, run: Run):
        cfg, par = run.cfg, run.par
        self.run, self.cfg = run, cfg
        self.run_dir = Path(cfg.run.dir)
        self.tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
        self.fpt = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak = device_peak(cluster_catalogue(cfg.cluster), cfg.train.dtype, par.device)
        self.end = last_step(cfg)
        self.first = run.start_step + 1  # logged too: a first line at once, not after log.every steps
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.faults = Faults.from_env(self.rank)
        self.writer = MetricsWriter(self.run_dir, cfg.log.tensorboard) if par.is_main else None
        self.tasks = [load_task(t) for t in cfg.train.eval_tasks] if par.layout.world == 1 else []
        # the model's own special tokens, chat template and generation settings travel with every
        # checkpoint of a continued model, so eval, generate and export never need its folder again
        files = {
            "tokenizer.json": run.sources[0].data_dir / run.index["tokenizer"],
            **(side_files(cfg.model.init_from[3:]) if cfg.model.init_from else {}),
        }
        files = {name: path.read_bytes() for name, path in files.items()}  # as it trains with them
        self.saver = Saver(
            cfg, self.run_dir, run.engine.parts, run.optimizer, self.snapshot, files, self.faults, par.layout.world
        )
        self.saver.last = run.resumed_from
        self.watch = Watch(
            cfg.watchdog,
            self.run_dir,
            self.rank,
            par.device,
            report=lambda m: logger.warning(m, extra={"highlighter": None}),
        )
        self.losses: list[float] = []
        self.val_loss: float | None = None
        self.val0: float | None = None  # validation loss of the model as loaded (model.init_from), while watched
        self.val0_seen: float | None = None
        self.tps = 0.0
        self.rates: list[tuple[float, float | None]] = []  # (tokens/s, MFU) of each log interval
        self.mfu: float | None = None
        self.ranks: dict = {}  # per-rank busy times of the last sync, logged with the metrics
        self.window = (run.start_step, time.perf_counter())  # (step, time) of the last log record

    def snapshot(self) -> dict:
        run = self.run
        return {
            "loader": run.loader.state_dict(),
            "rng": checkpoint.rng_state(),
            "guard": run.guard.state_dict(),
            "config": to_toml(self.cfg),
            "config_hash": config_hash(self.cfg),
            "data_fingerprint": run.data_fingerprint,
            "layout": {**run.par.layout.to_json(), "world_size": run.par.layout.world},
        }

    def write(self, record: dict) -> None:
        """A metrics row; every row carries the tokens drawn from each source so far."""
        if self.writer is not None:
            self.writer.write({**record, "tokens_by_source": self.run.loader.tokens_by_source()})

    def logs(self, done: int) -> bool:
        """Whether step `done` is logged: every log.every steps, this invocation's first and the last."""
        return done % self.cfg.log.every == 0 or done in (self.first, self.end)

    def due(self, done: int) -> tuple[bool, bool]:
        """(evaluate, checkpoint) at step `done`; either, or a log step, is a sync point."""
        last, every = done == self.end, self.cfg.train.eval_every
        return (self.run.engine.can_eval and (bool(every and done % every == 0) or last), self.saver.due(done, last))

    def settle(self, steps: list[tuple[int, float, list[float]]]) -> int | None:
        """At a sync point: let the guard judge the steps since the last one in order ((step, lr,
        [loss, grad norm, non-finite flag, weights non-finite]) each), and log; the step to go on
        from after a rollback, else None. An update that left a weight non-finite stops the run
        here, before any checkpoint of it is written."""
        for done, lr, (loss, norm, bad, broken) in steps:
            if broken > 0:
                raise TrainingStopped(
                    f"stopped at step {done}: its update made weights non-finite (lr {lr:.3g}, loss {loss:.4g}, "
                    f"grad norm {norm:.4g}); no checkpoint of them was written. Lower optim.lr, then run again: "
                    f"it resumes from {self.saver.last or 'the start (no checkpoint yet)'}"
                )
            guard = self.run.guard
            verdict, reason = guard.decide(loss, bad > 0, guard.is_spike(loss))
            if verdict is Verdict.ROLLBACK:
                back = self.rollback(done, reason, stuck=bad > 0)
                if back is not None:
                    return back
                continue
            if verdict is Verdict.SKIP:
                logger.warning(
                    f"[yellow]guard[/]: step {done}: {reason} (loss {loss}, grad norm {norm}); update skipped",
                    extra={"highlighter": None},
                )
                self.write({"step": done, "event": "skipped_update", "reason": reason})
            self.losses.append(loss)
            self.watch_rise(done, loss)
            if self.logs(done):
                self.log(done, loss, lr, norm)
        return None

    def watch_rise(self, done: int, loss: float) -> None:
        """Continued pre-training's first steps: a training loss far above the loaded model's own
        validation loss means the updates are destroying what it knew (a from-scratch learning
        rate did 2.93 -> 6.21 in two steps); said once, while there is still time to stop."""
        if self.val0 is None or done > RISE_WATCH_STEPS or loss <= self.val0 + RISE_NATS:
            return
        self.val0 = None  # once
        logger.warning(
            f"[yellow]warning[/]: step {done}: training loss {loss:.3f} is far above the loaded model's "
            f"step-0 validation loss ({self.val0_seen:.3f}): the model is being damaged, most likely by "
            f"a learning rate too high for continued pre-training (optim.lr={self.cfg.optim.lr:g}); "
            "stop (Ctrl-C) and lower it (docs/continued-pretraining.md)",
            extra={"highlighter": None},
        )
        self.write({"step": done, "event": "loss_rise", "loss": loss, "val_loss_step0": self.val0_seen})

    def log(self, done: int, loss: float, lr: float, norm: float) -> None:
        (step0, t0), now = self.window, time.perf_counter()
        self.window = (done, now)
        steps = max(1, done - step0)
        self.tps = steps * self.tokens_per_step / max(now - t0, 1e-9)
        self.mfu = self.measure_mfu(done)
        if done > self.first or done == self.end:  # the first step's warm-up (and compile) is not the run's speed
            self.rates.append((self.tps, self.mfu))
        basis = mfu_basis(self.cfg.train.dtype, self.cfg.train.float8)
        self.write(
            {
                "step": done,
                "loss": loss,
                "lr": lr,
                "grad_norm": norm,
                "tokens_per_s": self.tps,
                "mfu": self.mfu,
                "peak_flops": self.peak.flops,
                "peak_source": self.peak.source,
                "tokens": done * self.tokens_per_step,
                "step_time_s": (now - t0) / steps,
                "epochs_by_source": self.run.loader.epochs_by_source(),
                **self.ranks,
                **({"mfu_basis": basis} if basis else {}),
            }
        )
        if not log.console().is_terminal:  # a log file gets lines, a terminal gets the live bar
            logger.info(
                f"step {done}/{self.cfg.train.steps} loss {loss:.4f} lr {lr:.2e} grad_norm {norm:.3f} "
                f"{self.tps:,.0f} tok/s MFU {percent(self.mfu)}",
                extra={"highlighter": None},
            )

    def measure_mfu(self, done: int) -> float | None:
        """MFU of the window just logged, over every device in the job. A measured ceiling that the
        window's model FLOP/s reached is re-measured first (logged as an event), so MFU stays below 1;
        if even that cannot explain the rate, MFU is None rather than a number >= 1."""
        world = self.run.par.layout.world
        achieved = self.tps * self.fpt / world
        peak = checked_peak(self.peak, achieved, self.cfg.train.dtype, self.run.par.device)
        if peak != self.peak:
            self.write(
                {
                    "step": done,
                    "event": "peak_remeasured",
                    "previous_peak_flops": self.peak.flops,
                    "peak_flops": peak.flops,
                    "achieved_flops": achieved,
                }
            )
            self.peak = peak
        return mfu(self.tps, self.fpt, peak.flops, world) if achieved < peak.flops else None

    def rollback(self, bad_step: int, reason: str, stuck: bool = False) -> int | None:
        """Back to the last complete checkpoint, past the bad data; the step to go on from (None:
        no checkpoint to go back to, training goes on). `stuck`: the reason is updates skipped in a
        row, which with no checkpoint to go back to would go on being skipped: the run stops."""
        run, cfg = self.run, self.cfg
        run.guard.rolled_back(reason, bad_step)
        self.saver.wait()
        ckpt = checkpoint.latest(self.run_dir, verify_checksums=False, own=True)
        if ckpt is None and stuck:
            raise TrainingStopped(
                f"stopped at step {bad_step}: {reason} (loss or gradient) and no checkpoint to roll back to: "
                "this run cannot make progress; check model.init_std, optim.lr and the data"
            )
        if ckpt is None:  # nothing to go back to: the update already applied stays
            logger.warning(
                f"[yellow]guard[/]: step {bad_step}: {escape(reason)}; no checkpoint to roll back to, training goes on"
            )
            return None
        back = int(restore(run, ckpt, counters=False)["step"])
        n = max(cfg.guard.skip_batches, bad_step - back)
        ids = run.loader.skip(n)
        record: dict[str, Any] = {
            "step": bad_step,
            "rolled_back_to": back,
            "reason": reason,
            "batches": n,
            "windows": {k: v.tolist() for k, v in run.loader.by_source(ids).items()},
            "documents": run.loader.documents(ids),
        }
        if run.par.is_main:
            rundir.append(self.run_dir, "skipped.jsonl", (json.dumps(record) + "\n").encode())
        self.write({"step": bad_step, "event": "rollback", "rolled_back_to": back, "skipped_batches": n})
        logger.warning(
            f"[yellow]guard[/]: step {bad_step}: {escape(reason)}; rolled back to step {back} and "
            f"skipped {n} batches ({sum(map(len, record['documents'].values()))} documents, listed in "
            f"{self.run_dir / 'skipped.jsonl'})"
        )
        self.window = (back, time.perf_counter())
        return back

    def evaluate(self, done: int) -> None:
        run = self.run
        self.val_loss, by_source = _validation_losses(run.engine, run.sources, self.cfg)
        self.write(
            {
                "step": done,
                "val_loss": self.val_loss,
                **({"val_loss_by_source": by_source} if len(by_source) > 1 else {}),
            }
        )
        for name, examples in self.tasks:
            with autocast(run.par.device, self.cfg.train.dtype):
                r = evaluate_task(
                    run.engine.parts[0], run.tokenizer, name, examples, limit=self.cfg.train.eval_task_limit
                )
            run.engine.parts[0].train()
            self.write({"step": done, **r})

    def __call__(self, bar: Progress) -> int | None:
        """Train from the run's start step to the end; the step a signal stopped at, if one did."""
        task = bar.add_task("train", total=self.cfg.train.steps, completed=self.run.start_step, info="")
        pending: list[tuple[int, float, torch.Tensor]] = []
        step = self.run.start_step
        while step < self.end:
            done = step + 1
            self.watch.beat(done)
            try:
                values, lr = train_step(self.run, step, self.faults, self.watch)
            except torch.cuda.OutOfMemoryError as e:  # oom.json says where, beside the planner's breakdown
                raise explain_oom(self.cfg, self.run.par, done, e) from None
            except Exception:  # a stop signal to the process group kills a compile's C++ compiler (InductorError)
                if self.watch.signal is None:
                    raise
                self.saver.wait()
                return step  # stopped inside this step: nothing new to checkpoint
            pending.append((done, lr, values))
            step = done
            do_eval, do_save = self.due(done)
            # a signal on one process: checkpoint at this step's end (ranks learn of one at a sync point)
            signalled = self.watch.signal is not None and self.run.par.layout.world == 1
            if not (do_eval or do_save or signalled or self.logs(done)):
                continue
            values = torch.stack([v for _, _, v in pending])
            if dist.is_initialized():  # every rank stops if an update broke any rank's weights
                broken = values[:, 3].contiguous()
                dist.all_reduce(broken, op=dist.ReduceOp.MAX)
                values[:, 3] = broken
            sync, host = self.watch.sync(self.saver.poll(), values)
            self.ranks = {"rank_step_s": sync.rank_s, "slowest_rank": sync.slowest} if len(sync.rank_s) > 1 else {}
            if sync.save_failed:
                self.saver.failed()
            back = self.settle([(d, r, host[4 * i : 4 * i + 4]) for i, (d, r, _) in enumerate(pending)])
            pending = []
            if back is not None:
                step = back
                bar.update(task, completed=step)
                continue
            if do_eval:
                self.evaluate(done)
            if sync.stop or do_save:
                self.saver.save(done, list(self.watch.durations))
            loss = f"loss {self.losses[-1]:.3f}" if self.losses else ""
            val = f" val {self.val_loss:.3f}" if self.val_loss is not None else ""
            bar.update(task, completed=done, info=f"{loss}{val} | {self.tps:,.0f} tok/s | MFU {percent(self.mfu)}")
            if sync.stop:
                self.saver.wait()
                return done
        self.saver.wait()
        return None


def train_loop(run: Run, started: float | None = None) -> TrainResult:
    """Train a built run on this process, or as one rank of a torchrun/srun job (rank 0 writes logs
    and metrics); `started`: when building it began (perf_counter), for the run's wall time."""
    t_start = time.perf_counter() if started is None else started
    cfg = run.cfg
    _refuse_before_step_one(run)
    _start_records(run)
    loop = _Loop(run)
    if cfg.model.init_from and run.start_step == 0 and run.engine.can_eval:  # the model as loaded, for comparison
        loop.val0 = loop.val0_seen = _validation_losses(run.engine, run.sources, cfg)[0]
        loop.write({"step": 0, "val_loss": loop.val0})
        logger.info(
            f"step 0: val loss {loop.val0:.4f} (the model as loaded, {cfg.train.eval_batches} batches of "
            f"{cfg.data.seq_len}-token windows)",
            extra={"highlighter": None},
        )
    _banner(run, loop)
    preempted = _run_loop(run, loop)
    if loop.writer is not None:
        loop.writer.close()
    return _result(run, loop, preempted, time.perf_counter() - t_start)


def _refuse_before_step_one(run: Run) -> None:
    """What would fail or destroy something only later: refused before the first step."""
    cfg, par, run_dir = run.cfg, run.par, Path(run.cfg.run.dir)
    if cfg.checkpoint.resume == "none" and (done := checkpoint.list_complete(run_dir)):  # starting over beside them
        # would replace the earlier run's metrics and leave its checkpoints for the next resume
        raise ConfigError(
            f"checkpoint.resume=none, but run.dir={run_dir} holds an earlier run's checkpoints "
            f"(newest {done[-1].name}); choose a new run.dir, or delete {run_dir / 'checkpoints'} "
            "to start over there"
        )
    if run.engine.can_eval:  # every run evaluates at its end: refuse before step 1, not after the last
        _eval_sources(run.sources, cfg.data.seq_len)
    if cfg.train.sample_tokens and par.layout.world == 1:  # the end-of-run sample (one process only)
        n = len(run.tokenizer.encode(cfg.train.sample_prompt).ids)
        if not 0 < n < cfg.model.max_seq_len:
            raise ConfigError(
                f"train.sample_prompt is {n} tokens: it needs 1 to model.max_seq_len-1="
                f"{cfg.model.max_seq_len - 1}; change it or set train.sample_tokens=0"
            )


def _start_records(run: Run) -> None:
    """The run folder's metrics (kept up to the resumed step, or started afresh) and config.toml."""
    cfg, par, run_dir = run.cfg, run.par, Path(run.cfg.run.dir)
    metrics_path = run_dir / "metrics.jsonl"
    if run.resumed_from is not None:
        if par.is_main:
            kept = [r for r in read_records(metrics_path) if r["step"] <= run.start_step]
            rundir.replace(run_dir, "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in kept).encode())
        logger.info(
            f"[bold]resumed[/] from {run.resumed_from} at step {run.start_step} "
            f"(written by layout {Layout.from_json(run.resumed_layout or {}).name()})"
        )
    elif par.is_main:
        rundir.remove(run_dir, "metrics.jsonl")
    if par.is_main:
        rundir.replace(run_dir, "config.toml", to_toml(cfg).encode())


def _banner(run: Run, loop: _Loop) -> None:
    """The model, its MFU basis, float8, the layout and a missing validation, logged once."""
    cfg, par = run.cfg, run.par
    n_params, lo = count_params(cfg.model), par.layout
    logger.info(
        f"[bold]model[/] {_millions(n_params.total)} params ({_millions(n_params.non_embedding)} "
        f"non-embedding), {loop.fpt / 1e6:.1f} MFLOP/token (model FLOPs, 6N + attention); "
        f"{par.device.type} {cfg.train.dtype}{' compiled' if config_compiles(cfg, lo) else ''}; "
        f"MFU vs {loop.peak.flops / 1e9:,.0f} GFLOP/s "
        f"per device ({loop.peak.source})"
    )
    if config_compiles(cfg, lo) and run.start_step < loop.end:
        logger.info(
            "[bold]compiling[/]: the first step takes longer (torch.compile of each block, once per process; "
            "train.compile=false skips it)"
        )
    if cfg.train.float8 != "none":
        unconverted = ", ".join(["embedding", "head", *unconverted_linears(cfg.model, lo.tp)])
        logger.info(
            f"[bold]float8[/] {cfg.train.float8} (torchao{', emulated' if cfg.train.float8_emulate else ''}) "
            f"on the blocks' linears; in {cfg.train.dtype}: {unconverted}. MFU stays model FLOPs over the "
            f"{cfg.train.dtype} peak, so it compares with runs without float8 (their speed-up shows in it); "
            "the float8 matmuls' own peak is twice that"
        )
    if lo.world > 1:
        logger.info(
            f"[bold]layout[/] {layout_label(lo)} on {lo.world} processes{_nodes_label(par)} "
            f"({dist.get_backend()}), {run.engine.n_micro} micro-batches of {cfg.train.micro_batch} per rank"
        )
    if not run.engine.can_eval:
        logger.warning(
            f"[yellow]note[/]: no validation in this run: torch's {lo.pp_schedule} schedule deadlocks in eval "
            "(see Engine.can_eval); export the checkpoint and run `flopwise eval` on it"
        )


def _run_loop(run: Run, loop: _Loop) -> int | None:
    """The loop under its watchdog and progress bar; a timed-out collective becomes a one-line stop
    (at once when a peer is known lost). The preempted step, if the run was preempted."""
    try:
        with loop.watch, _progress() as bar:
            return loop(bar)
    except RuntimeError as e:
        if not is_timeout(e):
            raise
        if peer_lost(e):  # at once, not after the timeout: no hang, so no stack dumps either
            raise _lost_peer(run.par, loop.rank, loop.watch.step, loop.saver.last) from None
        raise TrainingStopped(
            f"rank {loop.rank}: a collective timed out at step {loop.watch.step} after "
            f"watchdog.collective_timeout_s={run.cfg.watchdog.collective_timeout_s:g} s (a rank hung "
            f"or died; see {Path(run.cfg.run.dir)}/hang-rank*.txt); restart resumes from the last complete "
            "checkpoint"
        ) from None


def _result(run: Run, loop: _Loop, preempted: int | None, seconds: float) -> TrainResult:
    """The run's summary, with the end-of-run plot and sample (one process)."""
    cfg, par, run_dir = run.cfg, run.par, Path(run.cfg.run.dir)
    metrics_path = run_dir / "metrics.jsonl"
    plot = None
    if par.is_main and metrics_path.exists() and read_records(metrics_path):
        png = plot_loss_curve(metrics_path, title=f"{cfg.run.name}: {_millions(count_params(cfg.model).total)} params")
        plot = rundir.replace(run_dir, "loss.png", png)
    sample = ""
    if cfg.train.sample_tokens and par.layout.world == 1:
        prompt = run.tokenizer.encode(cfg.train.sample_prompt).ids
        with autocast(par.device, cfg.train.dtype):
            model = cast(Transformer, run.engine.parts[0])  # one process: the only part is the plain Transformer
            ids = generate_tokens(model, prompt, cfg.train.sample_tokens, temperature=0.8, top_k=50, seed=cfg.run.seed)
        sample = run.tokenizer.decode(prompt + ids)
    final_loss = loop.losses[-1] if loop.losses else float("nan")
    reached = loop.end if preempted is None else preempted
    # the run's speed is the median log interval's: the last one alone may be a checkpoint's or a straggler's
    tps = statistics.median(r for r, _ in loop.rates) if loop.rates else 0.0
    mfus = [m for _, m in loop.rates if m is not None]
    return TrainResult(
        run_dir=run_dir,
        steps=reached,
        tokens=reached * loop.tokens_per_step,
        train_loss=final_loss,
        val_loss=loop.val_loss,
        unigram_entropy=run.index["unigram_entropy_nats"],
        tokens_per_s=tps,
        mfu=statistics.median(mfus) if mfus else None,
        peak=loop.peak,
        layout=layout_label(par.layout),
        seconds=seconds,
        checkpoint=loop.saver.last,
        plot=plot,
        sample=sample,
        losses=loop.losses,
        is_main=par.is_main,
        preempted=preempted,
        signal=loop.watch.signal,
        save_s=loop.saver.write_s,
        async_save_s=loop.saver.async_s,
    )


def finished(done: Finished, started: float) -> TrainResult:
    """A finished run run again: said in one line, and summed up from what it recorded (the
    checkpoint's step and layout, the last validation loss in metrics.jsonl); nothing trained."""
    cfg, step = done.cfg, done.state["step"]
    logger.info(
        f"[bold]complete[/]: the checkpoint is at step {step}, where this run ends "
        "(train.steps, train.stop_after): nothing to train; raise them to continue"
    )
    run_dir = Path(cfg.run.dir)
    vals = [  # the file is read, never written here: a record of another shape is passed over
        r["val_loss"]
        for r in read_records(run_dir / "metrics.jsonl")
        if isinstance(r.get("val_loss"), float) and isinstance(r.get("step"), int) and r["step"] <= step
    ]
    return TrainResult(
        run_dir=run_dir,
        steps=step,
        tokens=step * cfg.train.global_batch * cfg.data.seq_len,
        train_loss=float("nan"),
        val_loss=vals[-1] if vals else None,
        unigram_entropy=done.index["unigram_entropy_nats"],
        tokens_per_s=0.0,
        mfu=None,
        peak=None,
        seconds=time.perf_counter() - started,
        checkpoint=done.checkpoint,
        is_main=done.is_main,
        layout=layout_label(Layout.from_json(done.state.get("layout") or {})),
    )


def _nodes_label(par: Parallel) -> str:
    """ " on 2 nodes (tp inside a node, dp across)": where the mesh's groups lie, from each rank's node."""
    n = len(set(par.nodes))
    if n == 1 or par.mesh is None:
        return ""
    across = across_nodes(par.mesh, par.nodes)
    inside = [d for d in DIMS if par.size(d) > 1 and d not in across]
    if par.size("dp_replicate") == 1:  # plain data parallelism: say dp, as the layout's name does
        across, inside = ([d.replace("dp_shard", "dp") for d in x] for x in (across, inside))
    where = [f"{', '.join(inside)} inside a node"] * bool(inside) + [f"{', '.join(across)} across"] * bool(across)
    return f" on {n} nodes ({'; '.join(where)})"


def _lost_peer(par: Parallel, rank: int, step: int, last: Path | None) -> TrainingStopped:
    """The one line a surviving rank stops with when a peer went away: which node or ranks (those
    that did not check in through the job's store), at which step, and where a restart resumes. Only
    the lowest surviving rank says it (without the store: each node's first); the others stop quietly.
    On one node torchrun stops the survivors at once, so they do not wait for check-ins there."""
    me, nodes = par.nodes[rank], len(set(par.nodes))
    missing = missing_ranks(par) if nodes > 1 else None
    gone = sorted({par.nodes[r] for r in missing} - {me}) if missing else []
    if gone:
        ranks = [r for r in missing or [] if par.nodes[r] in gone]
        span = f"rank {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}"
        who = f"node {', '.join(map(str, gone))} ({span}) went away"
    elif missing:
        who = f"rank {', '.join(map(str, missing))} went away (its own output says why)"
    elif nodes == 2:  # no store to ask: it went with the other node
        who = f"node {1 - me} (it held the job's store) went away"
    else:
        who = "that process died (its own output says why)"
    if missing:
        quiet = rank != min(r for r in range(len(par.nodes)) if r not in missing)
    else:  # no store to agree through: one line per surviving node (on one node, every survivor's)
        quiet = nodes > 1 and os.environ.get("LOCAL_RANK", "0") != "0"
    where, fewer = (f"rank {rank} (node {me})", " (with fewer nodes too)") if nodes > 1 else (f"rank {rank}", "")
    resume = f"the last complete checkpoint, {last.name}" if last is not None else "the start (no checkpoint yet)"
    return TrainingStopped(
        f"{where}: another rank's connection closed at step {step}: {who}; the job stops here, "
        f"and a restart{fewer} resumes from {resume}",
        quiet=quiet,
    )


def layout_label(lo: Layout) -> str:
    """ "pp2 1f1b", "tp2 sp", "dp2 zero3": the degrees with sequence parallelism and the pipeline
    schedule (Layout.name's detail line, less the micro-batch and recompute the banner gives apart)."""
    detail = lo.name(detail=True).split("\n")[1].split()[:-2]
    return " ".join([lo.name(), *detail])


def _millions(n: float) -> str:
    """A parameter count as the model line and the loss plot's title both print it: "0.16M"."""
    return f"{n / 1e6:.2f}M"


def percent(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def summary_table(r: TrainResult) -> Table:
    t = Table(title="run summary", show_header=False)
    t.add_row("run dir", str(r.run_dir))
    t.add_row("steps / tokens", f"{r.steps:,} / {r.tokens:,}")
    trained = bool(r.losses)  # a run resumed at its last step trains nothing
    t.add_row("final train loss", f"{r.train_loss:.4f}" if trained else "– (no step trained here)")
    if r.val_loss is not None:
        t.add_row("val loss (ppl)", f"{r.val_loss:.4f} ({math.exp(r.val_loss):.1f})")
    t.add_row("unigram entropy of the data", f"{r.unigram_entropy:.4f} nats/token")
    t.add_row("layout", r.layout)
    t.add_row("throughput", f"{r.tokens_per_s:,.0f} tokens/s (median log interval)" if trained else "–")
    if r.peak is not None:
        t.add_row(
            "MFU (model FLOPs)",
            f"{percent(r.mfu)} of {r.peak.flops / 1e9:,.0f} GFLOP/s per device ({r.peak.source}; median log interval)",
        )
    t.add_row("wall time", f"{r.seconds:.1f} s")
    t.add_row("checkpoint", str(r.checkpoint))
    if r.save_s:
        t.add_row(
            "checkpoint saves",
            f"{len(r.save_s)}, median {statistics.median(r.save_s):.3f} s blocking training"
            + (f" ({statistics.median(r.async_save_s):.3f} s to complete in the background)" if r.async_save_s else ""),
        )
    if r.plot:
        t.add_row("loss curve", str(r.plot))
    return t
