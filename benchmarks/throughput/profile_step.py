"""Where a training step's time goes: torch.profiler over flopwise's own `train_step`, self CPU time
grouped into matmuls, attention, the loss, the optimizer, compiled (fused) kernels and the rest.

    python benchmarks/throughput/profile_step.py --shape holdout                         # as `flopwise train` runs it
    python benchmarks/throughput/profile_step.py --shape ref --flopwise train.compile=false 'train.dtype="fp32"'

Shapes and settings are benchmarks/throughput/train_cpu.py's. One thread by default, so the shares do not
depend on what else runs on the machine.
"""

from __future__ import annotations

import argparse
import types
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from flopwise.parallel import mesh
from flopwise.train.build import build_engine
from flopwise.train.faults import Faults
from flopwise.train.trainer import train_step
from train_cpu import SHAPES, flopwise_config

GROUPS = [
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("attention", ("scaled_dot_product",)),
    ("loss", ("log_softmax", "nll_loss", "cross_entropy")),
    ("optimizer", ("adamw", "Optimizer.")),
    ("compiled kernels", ("CompiledFxGraph",)),
    ("casts and copies", ("aten::copy_", "aten::_to_copy")),
    (
        "elementwise",
        (
            "aten::mul",
            "aten::add",
            "aten::silu",
            "aten::pow",
            "aten::rsqrt",
            "aten::neg",
            "aten::cat",
            "aten::div",
            "aten::sum",
            "aten::mean",
            "aten::fill_",
            "rms_norm",
            "aten::where",
            "aten::gelu",
        ),
    ),
]


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k.lower() in name.lower() for k in keys):
            return group
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="ref")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--flopwise", nargs="*", default=[])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    cfg = flopwise_config(shape, args.dtype, args.flopwise)
    engine, optimizer = build_engine(cfg, mesh.init(cfg, torch.device("cpu")))
    batch = torch.randint(
        0, shape["vocab_size"], (shape["batch"], shape["seq"] + 1), generator=torch.Generator().manual_seed(1)
    )
    run = types.SimpleNamespace(
        cfg=cfg, engine=engine, optimizer=optimizer, loader=types.SimpleNamespace(next_batch=lambda: batch)
    )
    faults = Faults()
    for i in range(6):  # warm-up (and compile)
        train_step(run, i, faults)[0].tolist()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(args.steps):
            train_step(run, 6 + i, faults)[0].tolist()
    total, by = 0.0, defaultdict(float)
    for e in prof.key_averages():
        by[group_of(e.key)] += e.self_cpu_time_total
        total += e.self_cpu_time_total
    print(
        f"{args.shape} {args.dtype} {' '.join(args.flopwise)}: {total / args.steps / 1e3:.1f} ms of CPU per step "
        f"({args.threads} thread{'s' if args.threads > 1 else ''}, under the profiler)"
    )
    for group, t in sorted(by.items(), key=lambda kv: -kv[1]):
        print(f"  {group:18s} {100 * t / total:5.1f}%")


if __name__ == "__main__":
    main()
