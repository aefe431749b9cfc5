"""`flopwise plan --measure`: run a config's layout for a few training steps under torchrun and
set, per rank, what the engine holds and sends beside what the planner predicts (plan.rank).

    parent:  measure(path, overrides, nproc, steps) -> report (launches torchrun, compares)
    ranks:   python -m flopwise.measure CONFIG.toml OUT.json STEPS

Each rank builds the run as `flopwise train` does (flopwise.build.build_run) and takes the
trainer's own steps (train_step). Measured: parameters at rest, gradients when the optimizer
steps, AdamW moments after it, the peak of saved activations, and the elements of each kind of
collective in the last step. The joint tests (tests/dist/jobs.py) measure through `measure_rank`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist
from rich.console import Console

from flopwise.build import build_run
from flopwise.train.run import Run
from flopwise.config import load_config, load_tree, to_toml, validate
from flopwise.errors import ConfigError, FlopwiseError
from flopwise.parallel import accounting as acc
from flopwise.parallel.data import local_optimizer
from flopwise.parallel.mesh import layout_of
from flopwise.plan.planner import resolve_layout
from flopwise.plan.rank import predict_rank
from flopwise.train.faults import Faults
from flopwise.train.trainer import train_step

MAX_RANKS = 8  # processes one CPU machine runs for a measurement (gloo)
QUANTITIES = ("params", "grads", "optimizer", "activations", "gathered", "peak")


def measure_rank(run: Run, steps: int) -> dict[str, Any]:
    """This rank's mesh coordinates, its layers, and what it holds and sends over `steps` training
    steps: parameters at rest (after the build), gradient bytes as the optimizer steps, optimizer
    moments after the last step, the peak saved activations, FSDP2's all-gathered parameters then
    and the high-water mark of all memory in the last step, and collective
    elements by kind in one step more."""
    engine, opt, par = run.engine, run.optimizer, run.par
    plain = [getattr(m, "module", m) for m in engine.parts]  # DDP's wrapped module
    out: dict[str, Any] = {"pp_rank": par.rank("pp"), "shard_rank": par.rank("shard"), "dp_rank": par.rank("dp_cp"),
                           "layers": sorted(int(k) for m in plain for k in m.layers.keys()),
                           "params": acc.param_bytes(engine.parts), "cpu": par.device.type == "cpu"}
    grads: list[int] = []
    hook = local_optimizer(opt).register_step_pre_hook(lambda *_: grads.append(acc.grad_bytes(engine.parts)))
    faults = Faults()
    try:
        for i in range(steps):
            with acc.SavedBytes(*engine.parts) as saved, acc.PeakMemory(par.device) as peak:
                train_step(run, run.start_step + i, faults)
            out["activations"], out["gathered"], out["peak"] = saved.bytes, saved.gathered, peak.bytes
        # CommCounter is a dispatch mode, under which compiled blocks run eagerly (and save what eager
        # saves): the collectives get a step of their own
        with acc.CommCounter() as comm:
            train_step(run, run.start_step + steps, faults)
        out["collectives"] = comm.volumes()
    finally:
        hook.remove()
    out["grads"] = grads[-1]
    out["optimizer"] = acc.optimizer_bytes(local_optimizer(opt))
    return out


def gather(obj: Any) -> list[Any]:
    """`obj` from every rank, in rank order, on every rank (one process runs without a group)."""
    if not dist.is_initialized():
        return [obj]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def _rank_main(config: str, out: str, steps: int) -> None:
    run = build_run(load_config(config), Console(quiet=True))
    ranks = gather(measure_rank(run, steps))
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out).write_text(json.dumps(ranks))
    if dist.is_initialized():
        dist.destroy_process_group()


def measure(path: str | None, overrides: list[str], nproc: int | None = None, steps: int = 3) -> dict[str, Any]:
    """Run the layout the config asks for on `nproc` local processes (default: the product of its
    parallel degrees) for `steps` steps; per rank, predicted and measured values side by side."""
    if steps < 1:
        raise ConfigError(f"--steps={steps}: measure at least one step")
    tree = load_tree(path, [*overrides, 'checkpoint.resume="none"'])
    cfg = validate(tree)
    p = cfg.parallel
    world = nproc or (p.dp or 1) * p.tp * p.pp * p.cp
    if world > MAX_RANKS:
        raise ConfigError(f"--measure runs one process per rank on this machine: {world} ranks asked, at most "
                          f"{MAX_RANKS}; lower the parallel.* degrees (or --nproc)")
    cfg = resolve_layout(cfg, tree, world)
    lo = layout_of(cfg, world)
    with tempfile.TemporaryDirectory(prefix="flopwise-measure-") as tmp:
        config, out = Path(tmp) / "config.toml", Path(tmp) / "measured.json"
        config.write_text(to_toml(cfg))
        env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world)), **os.environ}
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                            str(world), "-m", "flopwise.measure", str(config), str(out), str(steps)],
                           capture_output=True, text=True, env=env)
        if r.returncode != 0 or not out.exists():
            errors = [ln for ln in r.stderr.splitlines() if "Error: " in ln and "ChildFailedError" not in ln]
            raise FlopwiseError(f"the measurement run of {lo.name()} failed (exit {r.returncode}): "
                                f"{(errors or ['see torchrun output'])[-1].strip()[:300]}")
        measured = json.loads(out.read_text())
    ranks = []
    for i, m in enumerate(measured):
        want = predict_rank(cfg, lo, m["pp_rank"], m["shard_rank"], m["dp_rank"], m["cpu"])
        kinds = sorted(set(want.collectives) | set(m["collectives"]))
        ranks.append({"rank": i, **{k: m[k] for k in ("pp_rank", "shard_rank", "dp_rank")},
                      "layers": {"predicted": want.layers, "measured": m["layers"]},
                      **{q: {"predicted": getattr(want, q), "measured": m[q]} for q in QUANTITIES},
                      "collectives": {k: {"predicted": want.collectives.get(k, 0), "measured": m["collectives"].get(k, 0)}
                                      for k in kinds}})
    return {"layout": lo.name(), "parallel": lo.to_json(), "world": world, "steps": steps, "dtype": cfg.train.dtype,
            "seq_len": cfg.data.seq_len, "global_batch": cfg.train.global_batch, "ranks": ranks}


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
