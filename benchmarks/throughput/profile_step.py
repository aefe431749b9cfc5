"""Where a training step's time goes: torch.profiler over flopwise's own `train_step`, self CPU time
grouped into matmuls, attention, the loss, the optimizer, compiled (fused) kernels and the rest.

    python benchmarks/throughput/profile_step.py --shape holdout                         # as `flopwise train` runs it
    python benchmarks/throughput/profile_step.py --shape ref --flopwise train.compile=false 'train.dtype="fp32"'
    python benchmarks/throughput/profile_step.py --shape gpt2 --dtype fp32 --flopwise train.compile=false \
        --against nanogpt --nanogpt PATH/TO/nanoGPT/model.py   # side by side with a peer, op by op
    python benchmarks/throughput/profile_step.py --shape ref --dtype fp32 --flopwise train.compile=false \
        --against transformers

Shapes, settings and peers are benchmarks/throughput/train_cpu.py's. One thread by default, so the shares do
not depend on what else runs on the machine (the profiler's op times are wall time: on a loaded machine
compare the two columns of one run, not runs).
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
from train_cpu import SHAPES, flopwise_config, flopwise_step, nanogpt_step, transformers_step

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


def per_op(step, batches: list[torch.Tensor], steps: int) -> dict[str, tuple[float, float]]:
    """Self CPU ms and calls per step of each op over `steps` profiled steps (after 3 warm-up steps)."""
    for i in range(3):
        step(batches[i % len(batches)])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            step(batches[i % len(batches)])
    return {e.key: (e.self_cpu_time_total / steps / 1e3, e.count / steps) for e in prof.key_averages()}


def side_by_side(args, shape: dict) -> None:
    """flopwise's step and a peer's (train_cpu.py's), op by op, the largest differences first."""
    torch.manual_seed(0)
    ours = flopwise_step(shape, args.dtype, args.flopwise)
    peer = (
        nanogpt_step(args.nanogpt, shape, args.dtype)
        if args.against == "nanogpt"
        else transformers_step(shape, args.dtype)
    )
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"] + 1), generator=g) for _ in range(4)]
    a, b = per_op(ours, batches, args.steps), per_op(peer, batches, args.steps)
    print(
        f"total self CPU ms/step: flopwise {sum(v[0] for v in a.values()):.1f}, "
        f"{args.against} {sum(v[0] for v in b.values()):.1f}"
    )
    print(f"| op | flopwise ms | calls | {args.against} ms | calls | difference ms |\n|---|---|---|---|---|---|")
    zero = (0.0, 0.0)
    for k in sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, zero)[0] - b.get(k, zero)[0]))[: args.top]:
        (x, n), (y, m) = a.get(k, zero), b.get(k, zero)
        print(f"| {k[:60]} | {x:.1f} | {n:.0f} | {y:.1f} | {m:.0f} | {x - y:+.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="ref")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--flopwise", nargs="*", default=[])
    ap.add_argument("--against", choices=["nanogpt", "transformers"], default=None, help="a peer, op by op")
    ap.add_argument("--nanogpt", default=None, help="path to nanoGPT's model.py (for --against nanogpt)")
    ap.add_argument("--top", type=int, default=25, help="rows of the side-by-side table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    if args.against:
        if args.against == "nanogpt" and not args.nanogpt:
            ap.error("--against nanogpt needs --nanogpt PATH/TO/nanoGPT/model.py (it is not vendored)")
        return side_by_side(args, shape)
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
