"""`flopwise plan --rehearse`: one rank of the full world, built by `flopwise train`'s own build and
stepped once, with no real memory and no peers, to check the planner's account of that rank.

    parent:  rehearse_plan(path, overrides) -> report (one subprocess per rank, compares)
    rank:    python -m flopwise.measure.rehearse CONFIG.toml RANK WORLD OUT.json

The rank joins torch's `fake` process group (every collective returns at once, with no data) as
rank r of W, builds the run as `flopwise train` does (train.build.build_engine: meta model,
pipeline split, parallelize, then this rank's shards) under FakeTensorMode, and takes one training
step (train.trainer.train_step: forward, backward, gradient reduction, clipping, optimizer step)
on a batch of the right shape. torch's MemTracker attributes the bytes (parameters, gradients,
activations, optimizer state) and the repo's CommCounter the collectives, as `plan measure`
counts them on a real run. Values are meaningless; shapes, bytes and collectives are the run's.

The step runs eagerly (train.compile=false; the planner is asked about the same run) and on the
CPU engine (its attention core in fp32: plan.rank's `cpu` account), since no GPU is there to fake.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from flopwise.config.schema import Config, load_config, load_tree, to_toml, validate
from flopwise.errors import ConfigError
from flopwise.hardware.catalogue import cluster_hardware
from flopwise.layout.rules import Layout, layout_of
from flopwise.plan.planner import resolve_layout
from flopwise.plan.rank import predict_rank
from flopwise.plan.rank_memory import FIT_MARGIN, RUNTIME_RESERVE

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "peak")
_PLANNED = {"parameters": "params", "gradients": "grads", "optimizer": "optimizer", "activations": "activations"}


def rank_of(lo: Layout, pp_rank: int) -> int:
    """The global rank of pipeline rank `pp_rank`'s first data/tensor-parallel coordinate (the
    mesh's dims, outermost first: pp, dp_replicate, dp_shard, cp, tp)."""
    return pp_rank * (lo.world // lo.pp)


def distinct_ranks(lo: Layout) -> list[int]:
    """The ranks whose share differs: the first pipeline stage (embedding), a middle one and the
    last (head and loss); one rank without pipelining."""
    return [rank_of(lo, p) for p in sorted({0, lo.pp // 2, lo.pp - 1})]


def rehearsed_config(path: str | None, overrides: list[str]) -> tuple[Config, Layout]:
    """The config to rehearse (eager, nothing read or written) and its layout on the world of its
    degrees (parallel.layout=auto: the planner's best for cluster.gpus)."""
    tree = load_tree(path, [*overrides, "train.compile=false", 'checkpoint.resume="none"'])
    cfg = validate(tree)
    p = cfg.parallel
    world = (p.dp or 1) * p.tp * p.pp * p.cp if p.layout != "auto" else cfg.cluster.gpus
    cfg = resolve_layout(cfg, tree, world)
    return cfg, layout_of(cfg, world)


def rehearse_plan(path: str | None, overrides: list[str], ranks: list[int] | None = None) -> dict[str, Any]:
    """Rehearse each of `ranks` (default: `distinct_ranks`) in a process of its own, and set the
    planner's account of the same rank beside what it holds. A rank whose rehearsal fails is
    reported with torch's error; the others still run (and `fits` is false: not shown to fit)."""
    start = time.perf_counter()
    cfg, lo = rehearsed_config(path, overrides)
    chosen = distinct_ranks(lo) if ranks is None else ranks
    if bad := [r for r in chosen if not 0 <= r < lo.world]:
        raise ConfigError(f"--rank {bad[0]}: the layout {lo.name()} has ranks 0 to {lo.world - 1}")
    rows = [_rank_row(cfg, lo, r, _run_rank(cfg, r, lo.world)) for r in chosen]
    usable = cluster_hardware(cfg.cluster).memory_bytes * (1 - FIT_MARGIN)
    done = [r for r in rows if "error" not in r]
    return {
        "layout": lo.name(),
        "parallel": lo.to_json(),
        "world": lo.world,
        "hardware": cfg.cluster.hardware,
        "usable_bytes": int(usable),
        "fits": bool(done) and len(done) == len(rows) and all(r["total"]["rehearsed"] <= usable for r in done),
        "ranks": rows,
        "seconds": round(time.perf_counter() - start, 1),
    }


def _run_rank(cfg: Config, rank: int, world: int) -> dict[str, Any]:
    """One rank's rehearsal in a fresh process (the fake process group and torch's patches stay
    there), or {"error": torch's last line} where it failed."""
    with tempfile.TemporaryDirectory(prefix="flopwise-rehearse-") as tmp:
        config, out = Path(tmp) / "config.toml", Path(tmp) / "rank.json"
        config.write_text(to_toml(cfg))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        r = subprocess.run(
            [sys.executable, "-m", "flopwise.measure.rehearse", str(config), str(rank), str(world), str(out)],
            capture_output=True,
            text=True,
            env=env,
        )
        if r.returncode != 0 or not out.exists():
            lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
            errors = [ln for ln in lines if "Error" in ln or "Exception" in ln]
            return {"error": ((errors or lines or [f"exit {r.returncode}"])[-1])[:400]}
        return json.loads(out.read_text())


def _rank_row(cfg: Config, lo: Layout, rank: int, got: dict[str, Any]) -> dict[str, Any]:
    """A rank's rehearsed bytes beside the planner's (plan.rank.predict_rank, the CPU engine's
    account), and its collectives' elements, both sides."""
    coords = _coordinates(lo, rank)
    want = predict_rank(cfg, lo, coords["pp_rank"], coords["shard_rank"], coords["dp_rank"], cpu=True, fake=True)
    first_step = want.peak + want.received  # a rehearsal is a first step: it allocates the receive buffers
    planned = {c: int(getattr(want, _PLANNED[c])) for c in _PLANNED} | {"peak": int(first_step)}
    row: dict[str, Any] = {"rank": rank, "stage": coords["pp_rank"], "layers": want.layers, "planned": planned}
    if "error" in got:
        return {**row, "error": got["error"]}
    kinds = sorted(set(want.collectives) | set(got["collectives"]))
    resident = got["parameters"] + got["optimizer"] + got["buffers"] + RUNTIME_RESERVE
    return {
        **row,
        "rehearsed": {c: got[c] for c in CATEGORIES},
        "total": {
            "rehearsed": int(resident + got["peak"]),
            "planned": int(want.params + want.optimizer + want.buffers + RUNTIME_RESERVE + first_step),
        },
        "collectives": {
            k: {
                "planned_elements": int(want.collectives.get(k, 0)),
                "rehearsed_elements": got["collectives"].get(k, {}).get("elements", 0),
                "rehearsed_bytes": got["collectives"].get(k, {}).get("bytes", 0),
            }
            for k in kinds
        },
        "seconds": got["seconds"],
        "max_rss_bytes": got["max_rss_bytes"],
    }


def _coordinates(lo: Layout, rank: int) -> dict[str, int]:
    """A global rank's pp, shard (dp_shard × cp) and dp_cp coordinates in the mesh's order."""
    pp, rep, shard, cp, tp = (lo.pp, lo.dp_replicate, lo.dp_shard, lo.cp, lo.tp)
    r_cp = rank // tp % cp
    r_shard = rank // (tp * cp) % shard
    r_rep = rank // (tp * cp * shard) % rep
    return {
        "pp_rank": rank // (tp * cp * shard * rep) % pp,
        "shard_rank": r_shard * cp + r_cp,
        "dp_rank": (r_rep * shard + r_shard) * cp + r_cp,
    }


# ---- the rank's process: torch only from here on ---------------------------------------------


@contextlib.contextmanager
def _fake_world(hidden: torch.Tensor, comm: Any, tracker: Any):
    """torch and flopwise as a rank of a world that is not there: `_metadata_patches` and
    `_pipeline_patches` in force, undone after."""
    patches = {**_metadata_patches(), **_pipeline_patches(hidden, comm, tracker)}
    saved = {(owner, name): getattr(owner, name) for owner, name in patches}
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


def _metadata_patches() -> dict[tuple[Any, str], Any]:
    """The model is made on the real meta device (a fake meta parameter cannot be swapped for its
    fake allocation), and the pieces that compute layout metadata (a mesh's coordinates, a shard's
    box) run on real tensors, outside the fake mode: their values decide shapes (the fake mode
    refuses data-dependent ops). DTensor's sharding propagation gets a fake mode of its own, so the
    memory tracker does not count its whole-tensor stand-ins (MemTracker skips other fake modes).
    Initial values are not drawn: a fake tensor holds none."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed import device_mesh
    from torch.distributed.tensor import _sharding_prop

    from flopwise.model import init
    from flopwise.model.transformer import Transformer

    def real(fn):
        def wrapped(*args, **kwargs):
            with unset_fake_temporarily():
                return fn(*args, **kwargs)

        return wrapped

    return {
        (Transformer, "__init__"): real(Transformer.__init__),
        (device_mesh.DeviceMesh, "__init__"): real(device_mesh.DeviceMesh.__init__),
        (init, "compute_local_shape_and_global_offset"): real(init.compute_local_shape_and_global_offset),
        (init, "normal_box"): lambda seed, name, full, offset, shape: torch.empty(shape),
        (_sharding_prop, "detect_fake_mode"): lambda *args: None,
    }


def _pipeline_patches(hidden: torch.Tensor, comm: Any, tracker: Any) -> dict[tuple[Any, str], Any]:
    """A pipeline stage's neighbours are not there to answer: its warm-up vote settles on
    inferring shapes, the previous stage's output is `hidden` (the residual stream every stage
    boundary carries) and a gradient has its tensor's shape (torch runs autograd.grad to learn so,
    which the memory tracker's module hooks refuse; the inference's graph is freed by a backward
    of its own, whose gradients are dropped). `comm` counts none of the collectives of that one-off
    inference (torch runs it before a pipeline's first step only), and `tracker`'s peak starts
    after it."""
    from torch.distributed.pipelining import _utils as pp_utils
    from torch.distributed.pipelining.stage import PipelineStage

    infer_forward = PipelineStage._forward_metadata_inference
    boundary = pp_utils._StageForwardMeta(forward_metas=pp_utils.extract_tensor_metas((hidden,)) or ())

    def vote(*args, **kwargs) -> SimpleNamespace:
        return SimpleNamespace(item=lambda: 0)  # the vote's outcome, read on the host: infer the shapes

    def forward_meta(stage: PipelineStage, *args, **kwargs):
        comm.paused = True
        try:
            return infer_forward(stage, *args, **kwargs)
        finally:
            comm.paused = False

    def backward_meta(stage: PipelineStage, *args, **kwargs):
        inputs, outputs = stage._fwd_inputs_for_bwd_meta, stage._fwd_outputs_for_bwd_meta or ()
        stage._fwd_outputs_for_bwd_meta = stage._fwd_inputs_for_bwd_meta = None
        stage._fwd_kwargs_tensors_for_bwd_meta = None
        comm.paused = True
        try:
            live = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
            torch.autograd.backward(live, [torch.ones_like(o) for o in live])
        finally:
            comm.paused = False
        for p in stage.submod.parameters():
            p.grad = None
        tracker.restart_peak()
        metas = stage._stage_meta.outputs
        stage._stage_meta.output_grads = None if stage.is_last or metas is None else pp_utils._derive_grad_metas(metas)
        metas = pp_utils.extract_tensor_metas(inputs)
        stage._stage_meta.input_grads = pp_utils._derive_grad_metas(metas) if metas is not None else None
        meta = pp_utils._StageBackwardMeta(backward_metas=stage._stage_meta.input_grads or ())
        return meta if stage.is_first or stage._is_same_rank(stage.stage_index - 1) else None

    return {
        (PipelineStage, "_warmup_forward_vote"): vote,
        (PipelineStage, "_warmup_backward_result"): vote,
        (PipelineStage, "_recv_meta"): lambda stage, src: boundary,
        (PipelineStage, "_send_meta"): lambda stage, meta, dst: None,
        (PipelineStage, "_forward_metadata_inference"): forward_meta,
        (PipelineStage, "_backward_metadata_inference"): backward_meta,
    }


def _hidden(cfg: Config, lo: Layout) -> torch.Tensor:
    """What a pipeline stage boundary carries: one micro-batch's residual stream (this rank's
    context shard, its tensor-parallel slice under sequence parallel), in the parameters' compute
    dtype under FSDP2's bf16 policy (ZeRO >= 2, or replicate under tensor parallel), else fp32 (the
    embedding's output; autocast leaves the residual additions in fp32)."""
    seq = cfg.data.seq_len // lo.cp // (lo.tp if lo.sequence_parallel else 1)
    fsdp2 = lo.zero >= 2 or (lo.zero == 0 and lo.tp > 1 and lo.dp * lo.cp > 1)
    dtype = torch.bfloat16 if fsdp2 and cfg.train.dtype == "bf16" else torch.float32
    with torch.device("meta"):
        return torch.empty(lo.micro_batch, seq, cfg.model.d_model, dtype=dtype, requires_grad=True)


def _tracker():
    """torch's MemTracker over one whole step: a module runs once per micro-batch (its per-module
    statistics are of the last call), and the peak kept is of what the step allocates above the
    optimizer state (what a steady step holds at its start)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

    class StepTracker(MemTracker):
        peak, at_peak = 0, {}

        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state) -> None:
            for snap in self._curr_mem_snap.values():
                live = snap[_TOTAL_KEY] - snap[_MemRefType.OPT]
                if live > self.peak:
                    self.peak, self.at_peak = live, {getattr(k, "value", k): v for k, v in snap.items()}

        def restart_peak(self) -> None:
            self.peak, self.at_peak = 0, {}
            self._update_peak_stats(None)

        def live(self) -> int:
            return sum(s[_TOTAL_KEY] - s[_MemRefType.OPT] for s in self._curr_mem_snap.values())

        def category(self, ref: Any) -> int:
            return sum(s[ref] for s in self._curr_mem_snap.values())

    return StepTracker(), _MemRefType


def rehearse_rank(cfg: Config, rank: int, world: int) -> dict[str, Any]:
    """Rank `rank` of the config's world: build its share under the fake process group and fake
    tensors and take one training step; what it holds and sends (bytes as ints)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from flopwise.measure import bytes as acc
    from flopwise.parallel.data import local_optimizer
    from flopwise.parallel.mesh import Parallel, make_mesh
    from flopwise.train.build import build_engine
    from flopwise.train.faults import Faults
    from flopwise.train.trainer import train_step

    start = time.perf_counter()
    lo = layout_of(cfg, world)
    device = torch.device("cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        par = Parallel(lo, make_mesh(lo, device), device, [0] * world)  # real: its coordinates are values
        comm, (tracker, ref) = acc.CommCounter(), _tracker()
        with _fake_world(_hidden(cfg, lo), comm, tracker), FakeTensorMode(allow_non_fake_inputs=True):
            engine, opt = build_engine(cfg, par)
            out: dict[str, Any] = {"parameters": acc.param_bytes(engine.parts)}
            run = _Rehearsal(cfg, engine, opt, cfg.train.global_batch // lo.dp)
            tracker.track_external(*engine.parts)
            grads: list[int] = []
            hook = local_optimizer(opt).register_step_pre_hook(lambda *_: grads.append(acc.grad_bytes(engine.parts)))
            with comm, tracker, acc.SavedBytes(*engine.parts, fake=True) as saved:
                out["buffers"] = tracker.category(ref.BUFFER)
                before = tracker.live()
                train_step(run, 0, Faults())  # type: ignore[arg-type]  # the step reads cfg, engine, optimizer, loader
            hook.remove()
            out |= {
                "gradients": grads[-1],
                "optimizer": acc.optimizer_bytes(local_optimizer(opt)),
                "activations": saved.bytes,
                "peak": tracker.peak - before,
                "at_peak": tracker.at_peak,
                "collectives": {k: {"elements": n, "bytes": comm.bytes[k]} for k, n in comm.volumes().items()},
            }
    finally:
        dist.destroy_process_group()
    out["seconds"] = round(time.perf_counter() - start, 1)
    out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


class _Rehearsal:
    """What train_step reads of a run: the config, the engine, the optimizer, and a loader whose
    batch is this rank's share of the global batch, of random tokens (fake, like everything here)."""

    def __init__(self, cfg: Config, engine, optimizer, local_batch: int):
        self.cfg, self.engine, self.optimizer = cfg, engine, optimizer
        self.loader = self
        self._shape = (local_batch, cfg.data.seq_len + 1)

    def next_batch(self) -> torch.Tensor:
        return torch.randint(0, self.cfg.model.vocab_size, self._shape)


if __name__ == "__main__":
    _cfg = load_config(sys.argv[1])
    Path(sys.argv[4]).write_text(json.dumps(rehearse_rank(_cfg, int(sys.argv[2]), int(sys.argv[3]))))
