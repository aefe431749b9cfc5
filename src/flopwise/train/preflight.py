"""Will it fit? The pre-flight of `flopwise train`, and the report of an out-of-memory step.

Before anything large exists (no data prepared, no run folder, no parameter), every rank predicts
its own peak with the planner's per-rank account (plan.rank_memory.engine_memory: the `total` the layout
search compares with usable memory) and compares it with what its device has free (CUDA:
torch.cuda.mem_get_info; CPU: MemAvailable shared by the node's ranks), under the planner's own
rule: it fits if it is at most (1 - FIT_MARGIN) of that. The ranks agree, and if one does not fit
they all stop with exit 2 while rank 0 says why in one line, with the nearest change the planner's
search finds that fits in the memory of the tightest rank, for the same world size.

If CUDA still runs out of memory during a step, `explain_oom` writes oom.json (the planner's
breakdown for this rank beside torch.cuda.memory_stats(), and where in the step it happened) and,
with train.memory_snapshot, the allocator's history for pytorch.org/memory_viz.
"""

from __future__ import annotations

import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType

import torch
import torch.distributed as dist

from flopwise.config.schema import Config
from flopwise.errors import FlopwiseError
from flopwise.files import rundir
from flopwise.files.outputs import json_record
from flopwise.hardware.catalogue import GiB, Hardware, cluster_catalogue, cpu_multiplies_bf16, identify_gpu
from flopwise.layout.rules import Layout
from flopwise.parallel.mesh import Parallel, is_rank0
from flopwise.plan.memory import rank_param_count
from flopwise.plan.rank import rank_layers, rank_stages
from flopwise.plan.rank_memory import FIT_MARGIN, RUNTIME_RESERVE, EngineRun, engine_memory
from flopwise.plan.search import RECOMPUTE_ORDER, search_layouts
from flopwise.plan.shape import RankLoad, model_shape
from flopwise.plan.stack import STACKS

# what a suggestion may change, and the config key each lives in (dp follows from tp and pp)
_CHANGES = {
    "micro_batch": "train.micro_batch",
    "recompute": "parallel.recompute",
    "zero": "parallel.zero",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
}


class WillNotFit(FlopwiseError):
    """The run is predicted (pre-flight) or was seen (out of memory) not to fit its devices."""


@dataclass(frozen=True)
class _RankView:
    """One rank's side of the pre-flight: what it needs and what its device has."""

    rank: int
    need: float  # bytes: plan.rank_memory.engine_memory's total for this rank's pipeline stage
    available: float | None  # bytes free for this rank (None: cannot tell on this system)
    source: str  # where `available` comes from


def gib(b: float) -> str:
    return f"{b / GiB:.1f} GiB"


def rank_memory_total(cfg: Config, lo: Layout, pp_rank: int, cpu: bool) -> dict:
    """The bytes of pipeline rank `pp_rank` of `lo` by the layout search's own account
    (plan.rank_memory.engine_memory over this one stage, booked at its largest data-parallel share as the
    search books it), with the engine's stage split (parallel.pp_layers) and, on a CPU, its fp32
    attention core."""
    layers, emb, head = rank_layers(cfg, lo, pp_rank)
    load = RankLoad(
        layers=len(layers),
        params=rank_param_count(cfg.model, lo, len(layers), emb, head),
        head=head,
        embedding=emb,
        stages=rank_stages(cfg, lo, pp_rank),
    )
    memory, _ = engine_memory(EngineRun.of(cfg, cpu), lo, STACKS["flopwise"], [(load, pp_rank)], {})
    return memory


def _worst_rank_total(cfg: Config, lo: Layout, cpu: bool) -> float:
    return max(rank_memory_total(cfg, lo, r, cpu)["total"] for r in range(lo.pp))


def mem_available() -> float | None:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping); None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def device_memory(device: torch.device) -> tuple[float | None, str]:
    """(bytes this rank may use on its device, where that figure comes from)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"free on {torch.cuda.get_device_name(device)}"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    avail = mem_available()
    return (None if avail is None else avail / local), f"MemAvailable / {local} local rank{'s' * (local > 1)}"


def _search_hardware(cfg: Config, device: torch.device) -> Hardware:
    """The device to search layouts for: its catalogue entry (a GPU identified by name; the CPU's
    entry, which `hardware calibrate` can fill), else cluster.hardware, with the node's ranks as its
    devices per node. Step times only order equally near changes; where neither
    entry has rates (the built-in CPU), unit rates stand in and the order is by work alone."""
    catalogue = cluster_catalogue(cfg.cluster)
    name = "cpu"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = identify_gpu(props.name, props.total_memory) or cfg.cluster.hardware
    hw = catalogue.get(name) or catalogue[cfg.cluster.hardware]
    if not (hw.peak_16bit and hw.memory_bw and hw.intra_node_bw):
        hw = replace(hw, peak_flops={"bf16": 1.0, "fp32": 1.0}, memory_bw=1.0, intra_node_bw=1.0, inter_node_bw=1.0)
    return replace(hw, devices_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _distance(lo: Layout, user: Layout) -> tuple[int, float]:
    """(keys changed, how far): a factor of 2 in micro-batch, tp or pp, one recompute level or one
    ZeRO stage each count 1."""
    changed = [k for k in _CHANGES if getattr(lo, k) != getattr(user, k)]
    far = sum(abs(math.log2(getattr(lo, k) / getattr(user, k))) for k in ("micro_batch", "tp", "pp"))
    far += abs(RECOMPUTE_ORDER.index(lo.recompute) - RECOMPUTE_ORDER.index(user.recompute)) + abs(lo.zero - user.zero)
    return len(changed), far


def _nearest_fit(cfg: Config, user: Layout, hw: Hardware, budget: float, cpu: bool) -> tuple[Layout, float] | float:
    """The fitting layout nearest `user` (fewest changed keys, then the smallest changes, then the
    fastest) among those the planner's search finds for the same world size with every ZeRO stage
    and recompute policy, each predicted to need at most `budget` bytes on its worst rank; its
    predicted bytes. If none fits: the least any layout needs."""
    sh = model_shape(cfg.model, cfg.data.seq_len, cfg.data.document_mask)
    p = cfg.parallel
    fixed = {
        "cp": p.cp,
        "dp_replicate": p.dp_replicate,
        "sequence_parallel": p.sequence_parallel,
        "pp_schedule": p.pp_schedule,
        "virtual_stages": p.virtual_stages,
    }
    if p.pp_layers is not None:  # a stage split holds for its own pp only
        fixed["pp"] = p.pp
    hw = replace(hw, memory_bytes=budget / (1 - FIT_MARGIN))  # the search's rule: total <= budget
    fits, least = [], math.inf
    for zero in range(4):
        for rc in RECOMPUTE_ORDER:
            r = search_layouts(
                sh,
                hw,
                user.world,
                cfg.data.seq_len,
                cfg.train.global_batch,
                STACKS["flopwise"],
                {**fixed, "zero": zero, "recompute": rc},
                keep=sys.maxsize,
                compile=cfg.train.compile,
                steps=cfg.train.steps,
                dtype=cfg.train.dtype,
                float8=(cfg.train.float8,),
            )
            if r.fitting:
                fits += r.ranked
            elif r.ranked:
                least = min(least, r.ranked[0].memory["total"])
    fits.sort(key=lambda e: (*_distance(e.layout, user), -e.tokens_per_s))
    for e in fits:  # the search books a CPU's tensors only for the `cpu` entry: confirm with this engine's
        total = _worst_rank_total(cfg, e.layout, cpu) if cpu else e.memory["total"]
        if total <= budget:
            return e.layout, total
        least = min(least, total)
    return least


def _describe_change(cfg: Config, user: Layout, hw_name: str, found: tuple[Layout, float] | float) -> str:
    if not isinstance(found, tuple):
        return f"nothing fits on {user.world} rank{'s' * (user.world > 1)} of {hw_name}: needs >= {gib(found)}"
    lo, total = found
    keys = [k for k in _CHANGES if getattr(lo, k) != getattr(user, k)]
    sets = [f"{_CHANGES[k]}={getattr(lo, k)}" for k in keys]
    if lo.dp != user.dp and cfg.parallel.dp is not None:
        sets.append(f"parallel.dp={lo.dp}")
    n = len(keys)
    return (
        f"nearest change that fits ({n} change{'s' * (n > 1)}: {', '.join(keys)}): {' '.join(sets)} "
        f"(predicted {gib(total)})"
    )


def cheapest_recompute(cfg: Config, lo: Layout, budget: float | None, cpu: bool) -> str:
    """parallel.recompute=auto: the first policy of the search's order (none, selective, op, full:
    each never faster than the one before) whose worst rank the planner books within `budget`
    bytes (None: memory cannot be read, so none); full if none does (the pre-flight then says so)."""
    for rc in RECOMPUTE_ORDER:
        if budget is None or _worst_rank_total(cfg, replace(lo, recompute=rc), cpu) <= budget:
            return rc
    return RECOMPUTE_ORDER[-1]


def resolve_recompute(cfg: Config, par: Parallel) -> Config:
    """The config with parallel.recompute=auto replaced by `cheapest_recompute` for the tightest
    rank's device (every rank decides the same); `par.layout` follows."""
    if cfg.parallel.recompute != "auto":
        return cfg
    available, _ = device_memory(par.device)
    if dist.is_initialized():
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, available)
        available = None if None in every else min(every)
    budget = None if available is None else available * (1 - FIT_MARGIN)
    rc = cheapest_recompute(cfg, par.layout, budget, par.device.type != "cuda")
    par.layout = replace(par.layout, recompute=rc)
    return cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"recompute": rc})})


def run_preflight(cfg: Config, par: Parallel) -> str | None:
    """Stop the run (WillNotFit on every rank, rank 0's message saying why) if any rank is predicted
    not to fit its device; else rank 0's one-line summary (None where memory cannot be read)."""
    if not cfg.train.preflight:
        return None
    lo, cpu = par.layout, par.device.type != "cuda"
    rank = dist.get_rank() if dist.is_initialized() else 0
    available, source = device_memory(par.device)
    views = [_RankView(rank, rank_memory_total(cfg, lo, par.rank("pp"), cpu)["total"], available, source)]
    if dist.is_initialized():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, views[0])
        views = gathered
    known = [(v, v.available) for v in views if v.available is not None]
    if not known:
        return None
    worst, available = max(known, key=lambda k: k[0].need / k[1])
    usable = available * (1 - FIT_MARGIN)
    head = (
        f"rank {worst.rank} of {lo.world} ({lo.name()}, micro-batch {lo.micro_batch}, recompute {lo.recompute}) "
        f"needs {gib(worst.need)}; {gib(usable)} usable of {gib(available)} available ({worst.source}, "
        f"less the planner's {FIT_MARGIN:.0%} margin)"
    )
    if worst.need <= usable:
        return f"pre-flight: {head}"
    if not is_rank0():
        raise WillNotFit("does not fit (rank 0 says why)")
    budget = min(a for _, a in known) * (1 - FIT_MARGIN)
    hw = _search_hardware(cfg, par.device)
    change = _describe_change(cfg, lo, hw.name, _nearest_fit(cfg, lo, hw, budget, cpu))
    raise WillNotFit(f"train.preflight: will not fit: {head}; {change}; train.preflight=false starts it anyway")


def slow_bf16_note(cfg: Config, device: torch.device) -> str | None:
    """bf16 asked for on a CPU without bf16 matrix instructions: said before the run starts, not
    refused (it trains, only slower; train.dtype=auto picks fp32 there)."""
    if cfg.train.dtype != "bf16" or device.type != "cpu" or cpu_multiplies_bf16():
        return None
    return (
        "note: train.dtype=bf16 on a CPU without bf16 matrix instructions (AMX or AVX512-BF16): PyTorch's "
        "bf16 matmuls run tens of times slower than fp32 here; train.dtype=auto or fp32 trains at this CPU's speed"
    )


# --- out of memory during a step ------------------------------------------------------------

_PHASES = {
    "next_batch": "data",
    "forward_backward": "forward",
    "backward": "backward",
    "_pipeline": "pipeline schedule",
    "clip_grad_norm": "gradient clipping",
    "step_unless": "optimizer step",
}


def _where_in_step(tb: TracebackType | None) -> tuple[str | None, int | None]:
    """(phase, 0-based micro-batch) of the innermost step function an exception passed through (the
    engine's loop variable gives the micro-batch); None where unknown."""
    phase, micro = None, None
    while tb is not None:
        code, frame = tb.tb_frame.f_code, tb.tb_frame
        if code.co_name in _PHASES:
            phase = _PHASES[code.co_name]
        if code.co_name == "forward_backward" and isinstance(frame.f_locals.get("i"), int):
            micro = frame.f_locals["i"] // frame.f_locals["mb"]
        tb = tb.tb_next
    return phase, micro


def _requested(message: str) -> float | None:
    """The bytes of the allocation that failed ("Tried to allocate 2.00 GiB")."""
    m = re.search(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)", message)
    return float(m.group(1)) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(m.group(2)) if m else None


def oom_names(world: int, rank: int) -> tuple[str, str]:
    """(report, allocator snapshot): the names rank `rank`'s out-of-memory report writes at the top
    of the run folder (oom.json and memory_snapshot.pickle; per rank in a multi-rank job)."""
    suffix = f"-rank{rank}" if world > 1 else ""
    return f"oom{suffix}.json", f"memory_snapshot{suffix}.pickle"


def explain_oom(cfg: Config, par: Parallel, step: int, error: BaseException) -> WillNotFit:
    """Write oom.json (and memory_snapshot.pickle when train.memory_snapshot) in the run folder and
    return the one-line error to stop with.

    The suggestion asks for a layout whose bytes above the runtime reserve (which no layout
    changes) are predicted smaller than this one's by the share the allocator fell short (reserved
    bytes vs reserved + the failed request; unknown without CUDA) and the fit margin."""
    run_dir, lo, cpu = Path(cfg.run.dir), par.layout, par.device.type != "cuda"
    rank = dist.get_rank() if dist.is_initialized() else 0
    report_name, snapshot_name = oom_names(lo.world, rank)
    phase, micro = _where_in_step(error.__traceback__)
    predicted = rank_memory_total(cfg, lo, par.rank("pp"), cpu)
    stats = torch.cuda.memory_stats(par.device) if par.device.type == "cuda" else None
    snapshot = None
    if stats is not None and cfg.train.memory_snapshot:
        with tempfile.TemporaryDirectory() as tmp:  # torch writes a path; the run folder gets its bytes
            torch.cuda.memory._dump_snapshot(f"{tmp}/{snapshot_name}")
            snapshot = rundir.replace(run_dir, snapshot_name, Path(tmp, snapshot_name).read_bytes())
    requested = _requested(str(error))
    share = 1.0
    if stats and requested:
        reserved = stats.get("reserved_bytes.all.current", 0)
        share = reserved / (reserved + requested)
    budget = RUNTIME_RESERVE + (predicted["total"] - RUNTIME_RESERVE) * share * (1 - FIT_MARGIN)
    hw = _search_hardware(cfg, par.device)
    change = _describe_change(cfg, lo, hw.name, _nearest_fit(cfg, lo, hw, budget, cpu))
    report = rundir.replace(
        run_dir,
        report_name,
        json_record(
            {
                "step": step,
                "micro_batch": micro,
                "phase": phase,
                "rank": rank,
                "device": str(par.device),
                "error": str(error).splitlines()[0] if str(error) else type(error).__name__,
                "layout": lo.to_json(),
                "requested_bytes": requested,
                "predicted_bytes": {k: round(v) for k, v in predicted.items()},
                "predicted_by": "flopwise.plan.rank_memory.engine_memory for this rank's pipeline stage (what the "
                "layout search compares with usable memory); total includes the runtime reserve",
                "memory_stats": stats,
                "memory_stats_note": None
                if stats is not None
                else f"no CUDA allocator on {par.device}: memory_stats is null",
                "memory_snapshot": snapshot.name if snapshot else None,
                "suggestion": change,
            },
            "train",
        ),
    )
    where = f"step {step}" + (f", micro-batch {micro}" if micro is not None else "") + (f", {phase}" if phase else "")
    files = f"{report}" + (
        f" and {snapshot} (open at pytorch.org/memory_viz)"
        if snapshot
        else " (train.memory_snapshot=true also records the allocator's history)"
    )
    return WillNotFit(
        f"out of memory at {where} on {par.device} (predicted {gib(predicted['total'])}): see {files}; {change}"
    )


def record_history(cfg: Config, device: torch.device) -> None:
    """Start recording the allocator's history (train.memory_snapshot), for the snapshot an OOM writes."""
    if cfg.train.memory_snapshot and device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=100_000)
