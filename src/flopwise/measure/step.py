"""`flopwise plan measure`: run a config's layout for a few training steps under torchrun and
set, per rank, what the engine holds and sends beside what the planner predicts (plan.rank).

    parent:  measure_plan(path, overrides, nproc, steps) -> report (launches torchrun, compares)
    ranks:   python -m flopwise.measure.step CONFIG.toml OUT.json STEPS

Each rank builds the run as `flopwise train` does (flopwise.train.build.build_run) and takes the
trainer's own steps (train_step). Measured: parameters at rest, gradients when the optimizer
steps, AdamW moments after it, the peak of saved activations, and the elements of each kind of
collective in the last step. The joint tests (tests/dist/jobs.py) measure through `measure_rank`.

Time: the memory steps (the first of which compiles) warm up; then `steps` more are timed by
the wall clock, each from a barrier to the device drained, and PROFILED more (taking turns with
them) under torch.profiler split a step into components (`step_components`), set beside the
planner's time model (plan.step.estimate of this exact layout on cluster.hardware).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile, record_function

from flopwise.config.schema import Config, load_config, load_tree, to_toml, validate
from flopwise.errors import ConfigError, FlopwiseError
from flopwise.hardware.catalogue import cluster_hardware
from flopwise.layout.rules import Layout, layout_of
from flopwise.measure import bytes as acc
from flopwise.parallel.data import local_optimizer
from flopwise.parallel.mesh import torchrun
from flopwise.plan.planner import plan_hardware, resolve_layout
from flopwise.plan.rank import predict_rank
from flopwise.plan.shape import model_shape
from flopwise.plan.stack import STACKS
from flopwise.plan.step import Estimate, estimate
from flopwise.train.build import build_run
from flopwise.train.faults import Faults
from flopwise.train.run import Run
from flopwise.train.trainer import train_step

_MAX_RANKS = 8  # processes one CPU machine runs for a measurement (gloo)
QUANTITIES = ("params", "grads", "optimizer", "activations", "gathered", "peak", "fsdp_copies")
# The step's components, measured and predicted: the planner's Estimate.time terms that make each
_COMPONENTS = {
    "matmul": ("matmul",),
    "attention": ("attention",),
    "other_compute": ("other_compute", "grad_accum", "fsdp_copies", "weight_casts"),
    "optimizer": ("optimizer",),
    "exposed_comm": ("tp_comm", "dp_comm", "pp_comm", "cp_comm"),
    "pipeline_bubble": ("pp_bubble",),
}
_STEP_SCOPE = "flopwise.step"  # the record_function around the profiled step
PROFILED = 3  # profiled steps, of which the median one is split into components
_MATMUL_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::matmul",
    "aten::linear",
    "aten::_addmm_activation",
}
_MATMUL_NODES = ("MmBackward", "AddmmBackward", "BmmBackward", "BaddbmmBackward", "LinearBackward", "MatmulBackward")
_COMM_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:", "nccl:", "record_param_comms")
_P2P = ("send", "recv", "recv_", "recv_any_source_")


def measure_rank(run: Run, steps: int, timed: int = 0, collectives: bool = True) -> dict[str, Any]:
    """This rank's mesh coordinates, its layers, and what it holds and sends over `steps` training
    steps: parameters at rest (after the build), gradient bytes as the optimizer steps, optimizer
    moments after the last step, the peak saved activations, FSDP2's all-gathered parameters then
    and the high-water mark of all memory in the last step, and, with `collectives`, collective
    elements by kind and the bytes FSDP2 copies around them in one step more. With `timed` > 0,
    also the wall time of that many steps after the memory steps (which warm up and compile) and
    the components of a profiled one."""
    engine, opt, par = run.engine, run.optimizer, run.par
    plain = [getattr(m, "module", m) for m in engine.parts]  # DDP's wrapped module
    out: dict[str, Any] = {
        "pp_rank": par.rank("pp"),
        "shard_rank": par.rank("shard"),
        "dp_rank": par.rank("dp_cp"),
        # the stages are Transformers, .layers a ModuleDict (nn.Module's stub can't say so)
        "layers": sorted(int(k) for m in plain for k in m.layers.keys()),  # type: ignore[union-attr, operator]
        "params": acc.param_bytes(engine.parts),
        "cpu": par.device.type == "cpu",
    }
    grads: list[int] = []
    hook = local_optimizer(opt).register_step_pre_hook(lambda *_: grads.append(acc.grad_bytes(engine.parts)))
    faults = Faults()
    step = itertools.count(run.start_step)
    try:
        for _ in range(steps):
            with acc.SavedBytes(*engine.parts) as saved, acc.PeakMemory(par.device) as peak:
                train_step(run, next(step), faults)
            out["activations"], out["gathered"], out["peak"] = saved.bytes, saved.gathered, peak.bytes
        if timed:  # before the counted step, under whose dispatch mode compiled blocks run eagerly
            out.update(_time_steps(run, step, faults, timed))
        # CommCounter is a dispatch mode, under which compiled blocks run eagerly (and save what eager
        # saves): the collectives get a step of their own
        if collectives:
            with acc.CommCounter() as comm, acc.FsdpCopyBytes(engine.parts) as copies:
                train_step(run, next(step), faults)
            out["collectives"], out["fsdp_copies"] = comm.volumes(), sum(copies.bytes.values())
    finally:
        hook.remove()
    out["grads"] = grads[-1]
    out["optimizer"] = acc.optimizer_bytes(local_optimizer(opt))
    return out


def _time_steps(run: Run, step: Iterator[int], faults: Faults, n: int) -> dict[str, Any]:
    """The wall time of `n` steps and their median, and PROFILED steps under torch.profiler (kept
    out of the median: the profiler adds its own overhead), the one of median wall time split into
    components (one step: its components add up to its wall time). Timed and profiled steps take
    turns, so that a neighbour's burst on a shared machine falls on both alike."""
    cuda = run.par.device.type == "cuda"
    times, profiled = [], []
    for i in range(max(n, PROFILED)):
        if i < n:
            times.append(_timed_step(run, next(step), faults))
        if i < PROFILED:
            with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
                profiled.append((_timed_step(run, next(step), faults, scope=_STEP_SCOPE), prof))
    wall, prof = sorted(profiled, key=lambda p: p[0])[PROFILED // 2]
    return {
        "step_time_s": {"measured": statistics.median(times), "steps": times},
        "profiled_step_s": wall,
        "components": _step_components(prof.events(), wall, cuda, bubble=run.par.size("pp") > 1),
    }


def _timed_step(run: Run, step: int, faults: Faults, scope: str | None = None) -> float:
    """Wall seconds of training step `step` on this rank: every rank starts it together (a
    barrier) and the clock stops when this rank's device has finished it."""
    device = run.par.device
    if dist.is_initialized():
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with record_function(scope) if scope else contextlib.nullcontext():
        train_step(run, step, faults)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _category(e: FunctionEvent | None) -> str:
    """The component an event's own time belongs to, by its name and its callers' (the first that
    classifies, in this order: communication, optimizer, attention, matmul; else other compute).
    Communication comes first because DTensor and ZeRO issue collectives from inside matmuls and the
    optimizer step; the gradient-clipping norm (foreach kernels) is the optimizer's, as the planner
    books its read of the gradients there."""
    names = []
    while e is not None and e.name != _STEP_SCOPE:
        names.append(e.name.removeprefix("autograd::engine::evaluate_function: "))
        e = e.cpu_parent
    if any(n.startswith(_COMM_PREFIXES) for n in names):
        return "exposed_comm"
    if any(n.startswith(("Optimizer.step#", "aten::_foreach_", "aten::_fused_adam")) for n in names):
        return "optimizer"
    if any("scaleddotproduct" in n.lower().replace("_", "") for n in names):
        return "attention"
    if any(n in _MATMUL_OPS or n.startswith(_MATMUL_NODES) for n in names):
        return "matmul"
    return "other_compute"


def _step_components(events: list[FunctionEvent], wall: float, cuda: bool, bubble: bool) -> dict[str, float]:
    """Seconds of one profiled step by component; they sum to its wall time.

    On a CPU, each operator's own time on the step's thread (its span less its children's, so
    nothing counts twice) goes to its `_category`, except that where an operator's own time lies
    between its children while a collective is in flight (the async gloo events of its worker
    threads), the rank is waiting for it: exposed communication. Point-to-point transfers are left
    out of that: a pipeline stage waiting on a receive waits for its neighbour's compute (bubble).
    On a GPU, each operator's own kernels' device time goes to its category; collective kernels may
    overlap compute, so theirs is an upper bound of the exposed. What is left of the wall time is
    the pipeline bubble (pp > 1) or, with no pipeline, idle: host work outside operators and waits
    the profiler sees no collective for."""
    scope = next(e for e in events if e.name == _STEP_SCOPE)
    start, end = scope.time_range.start, scope.time_range.end
    flight = _merged(
        [
            (e.time_range.start, e.time_range.end)
            for e in events
            if e.is_async and e.name.startswith(_COMM_PREFIXES) and not e.name.endswith(_P2P)
        ]
    )
    out = dict.fromkeys([*_COMPONENTS][:-1], 0.0)
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or e.is_async or not start <= e.time_range.start <= end:
            continue
        if cuda:
            if e is not scope:
                out[_category(e)] += e.self_device_time_total / 1e6
            continue
        if e.thread != scope.thread:
            continue
        waiting = sum(_overlap(gap, flight) for gap in _gaps(e)) if e.cpu_children else 0.0
        out["exposed_comm"] += waiting / 1e6
        if e is not scope:
            out[_category(e)] += (e.self_cpu_time_total - waiting) / 1e6
    out["pipeline_bubble" if bubble else "idle"] = wall - sum(out.values())
    return out


def _gaps(e: FunctionEvent) -> list[tuple[float, float]]:
    """The stretches of an event's span (µs) that none of its children cover."""
    out, at = [], e.time_range.start
    for c in sorted(e.cpu_children, key=lambda c: c.time_range.start):
        if c.time_range.start > at:
            out.append((at, c.time_range.start))
        at = max(at, c.time_range.end)
    if e.time_range.end > at:
        out.append((at, e.time_range.end))
    return out


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(span: tuple[float, float], merged: list[tuple[float, float]]) -> float:
    """Length of `span` that the disjoint, sorted `merged` spans cover."""
    a, b = span
    i = max(0, bisect.bisect_right(merged, (a, math.inf)) - 1)
    total = 0.0
    for lo, hi in merged[i:]:
        if lo >= b:
            break
        total += max(0.0, min(b, hi) - max(a, lo))
    return total


def predicted_time(cfg: Config, lo: Layout) -> tuple[Estimate | None, str | None]:
    """The planner's step for this exact layout on cluster.hardware (this engine's stack, the run's
    dtype, compile setting, length, sequence and batch), or None and why not."""
    try:
        hw = plan_hardware(cfg)
    except ConfigError:
        return None, (
            f"cluster.hardware={cfg.cluster.hardware} has no peak FLOP/s to predict time from: run "
            "`flopwise hardware calibrate --out hw.toml` and pass cluster.hardware_file=hw.toml"
        )
    seq = cfg.data.seq_len
    return estimate(
        model_shape(cfg.model, seq, cfg.data.document_mask),
        hw,
        lo,
        seq,
        cfg.train.global_batch,
        STACKS["flopwise"],
        compile=cfg.train.compile,
        steps=cfg.train.steps,
        dtype=cfg.train.dtype,
        float8=cfg.train.float8,
        loss_chunk=cfg.train.loss_chunk_tokens,
    ), None


def _component_times(est: Estimate | None, measured: dict[str, float], last: str) -> dict[str, dict[str, float | None]]:
    """Predicted beside measured per component (`COMPONENTS`); the measured side's `last` is the
    bubble (pp > 1) or idle, both set beside the planner's bubble."""
    names = {c: c for c in _COMPONENTS} | {"pipeline_bubble": last}
    return {
        names[c]: {"predicted": sum(est.time[k] for k in keys) if est else None, "measured": measured[names[c]]}
        for c, keys in _COMPONENTS.items()
    }


def _calibrated_threads(cfg: Config, world: int) -> int:
    """Threads per rank on a CPU: as many as the calibration's device had (a CPU device is one rank
    of `hardware calibrate --nproc`, so prediction and measurement run alike), else a fair share."""
    cal = cluster_hardware(cfg.cluster).calibration
    return cal.threads if cal and cal.threads else max(1, (os.cpu_count() or 1) // world)


def gather(obj: Any) -> list[Any]:
    """`obj` from every rank, in rank order, on every rank (one process runs without a group)."""
    if not dist.is_initialized():
        return [obj]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def _rank_main(config: str, out: str, steps: int) -> None:
    torch.set_flush_denormal(True)  # this process is one rank's measurement (build.subnormals_flushed)
    run = build_run(load_config(config))
    assert isinstance(run, Run)  # measure's checkpoint.resume="none": never a finished run
    ranks = gather(measure_rank(run, steps, timed=steps))
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out).write_text(json.dumps(ranks))
    if dist.is_initialized():
        dist.destroy_process_group()


def measure_plan(
    path: str | None,
    overrides: list[str],
    nproc: int | None = None,
    steps: int = 3,
    on_start: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run the layout the config asks for on `nproc` local processes (default: the product of its
    parallel degrees) for `steps` steps; per rank, predicted and measured values side by side.
    `on_start` is called once the arguments and the config are accepted, just before the launch (the
    CLI says there whether the machine is busy: a refused run times nothing, so it gets no note)."""
    cfg, lo, world = _measured_layout(path, overrides, nproc, steps)
    if on_start is not None:
        on_start()
    measured = _run_ranks(cfg, lo, world, steps)
    ranks = [_rank_row(cfg, lo, i, m) for i, m in enumerate(measured)]
    return {
        "layout": lo.name(),
        "parallel": lo.to_json(),
        "world": world,
        "steps": steps,
        "dtype": cfg.train.dtype,
        "seq_len": cfg.data.seq_len,
        "global_batch": cfg.train.global_batch,
        **_step_time(cfg, lo, measured, ranks, steps),
        "ranks": ranks,
    }


def _measured_layout(
    path: str | None, overrides: list[str], nproc: int | None, steps: int
) -> tuple[Config, Layout, int]:
    """The config, its layout and the world size to measure, every refusal before any launch."""
    if steps < 1:
        raise ConfigError(f"--steps={steps}: measure at least one step")
    if nproc is not None and nproc < 1:
        raise ConfigError(
            f"--nproc={nproc}: run at least one process (or leave --nproc out for the product of the parallel degrees)"
        )
    tree = load_tree(path, [*overrides, 'checkpoint.resume="none"'])
    cfg = validate(tree)
    p = cfg.parallel
    world = (p.dp or 1) * p.tp * p.pp * p.cp if nproc is None else nproc
    if world > _MAX_RANKS:
        raise ConfigError(
            f"plan measure runs one process per rank on this machine: {world} ranks asked, at most "
            f"{_MAX_RANKS}; lower the parallel.* degrees (or --nproc)"
        )
    cfg = resolve_layout(cfg, tree, world)
    return cfg, layout_of(cfg, world), world


def _run_ranks(cfg: Config, lo: Layout, world: int, steps: int) -> list[dict[str, Any]]:
    """Each rank's measurement (`measure_rank`), from one torchrun of this module's `_rank_main`."""
    with tempfile.TemporaryDirectory(prefix="flopwise-measure-") as tmp:
        config, out = Path(tmp) / "config.toml", Path(tmp) / "measured.json"
        config.write_text(to_toml(cfg))
        env = {"OMP_NUM_THREADS": str(_calibrated_threads(cfg, world)), **os.environ}
        r = subprocess.run(
            torchrun(
                world,
                "-m",
                "flopwise.measure.step",
                str(config),
                str(out),
                str(steps),
            ),
            capture_output=True,
            text=True,
            env=env,
        )
        if r.returncode != 0 or not out.exists():
            raise FlopwiseError(
                f"the measurement run of {lo.name()} failed (exit {r.returncode}): {_failure_reason(r.stderr)}"
            )
        return json.loads(out.read_text())


def _failure_reason(stderr: str) -> str:
    """The line of torchrun's output that says why: a Python error's last line, else torchrun's own
    account of the failed rank (its exit code or signal), else the output's last line. The output is
    captured, so the reason must be in the message."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error: " in ln and "ChildFailedError" not in ln]
    failed = [ln for ln in lines if ln.startswith(("exitcode", "traceback")) and "N/A" not in ln]
    return ((errors or failed or lines or ["no output"])[-1])[:300]


def _rank_row(cfg: Config, lo: Layout, i: int, m: dict[str, Any]) -> dict[str, Any]:
    """Rank i's predicted values (plan.rank.predict_rank) beside its measured ones."""
    want = predict_rank(cfg, lo, m["pp_rank"], m["shard_rank"], m["dp_rank"], m["cpu"])
    kinds = sorted(set(want.collectives) | set(m["collectives"]))
    return {
        "rank": i,
        **{k: m[k] for k in ("pp_rank", "shard_rank", "dp_rank")},
        "layers": {"predicted": want.layers, "measured": m["layers"]},
        **{q: {"predicted": getattr(want, q), "measured": m[q]} for q in QUANTITIES},
        "collectives": {
            k: {"predicted": want.collectives.get(k, 0), "measured": m["collectives"].get(k, 0)} for k in kinds
        },
        "step_time_s": m["step_time_s"],
        "profiled_step_s": m["profiled_step_s"],
        "step_time_components_s": m["components"],
    }


def _step_time(
    cfg: Config, lo: Layout, measured: list[dict[str, Any]], ranks: list[dict[str, Any]], steps: int
) -> dict[str, Any]:
    """The step's time, predicted and measured, and its components on the rank that paces it."""
    est, why = predicted_time(cfg, lo)
    # every step starts from a barrier, so the slowest rank's time is the step's
    slowest = statistics.median(max(r) for r in zip(*(m["step_time_s"]["steps"] for m in measured), strict=False))
    # the rank that paces the step: the busiest in its profiled step (least bubble or idle)
    last = "pipeline_bubble" if lo.pp > 1 else "idle"
    pacing = min(ranks, key=lambda r: r["step_time_components_s"][last])
    return {
        "step_time_s": {"predicted": est.step_time if est else None, "measured": slowest},
        "step_time_note": f"measured: the median over {steps} timed steps of the slowest rank's wall time "
        f"(each step starts from a barrier); components: rank {pacing['rank']}'s profiled step; predicted: "
        + (
            why
            or f"plan.step.estimate of {lo.name()} on {cfg.cluster.hardware}"
            + (f" ({cfg.cluster.hardware_file})" if cfg.cluster.hardware_file else "")
        ),
        "step_time_components_s": _component_times(est, pacing["step_time_components_s"], last),
        "components_rank": pacing["rank"],
    }


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
