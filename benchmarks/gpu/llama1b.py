"""One-GPU training throughput of a ~1B Llama through flopwise's own engine: bf16 (FSDP2's
mixed-precision policy, fp32 master weights), FSDP2 over a one-rank mesh, per-block compile.

    python benchmarks/gpu/llama1b.py [--steps 20] [--batch 8] [--out benchmarks/gpu/results/gpu_llama1b.json]
    python benchmarks/gpu/llama1b.py --zero 0 --profile       # autocast without FSDP2; top kernels
    python benchmarks/gpu/llama1b.py --tiny --steps 3        # the same code path on CPU (CI-sized)
    python benchmarks/gpu/llama1b.py --hardware-file gpu.toml  # also predict from `hardware calibrate`'s tables

Reports tokens/s (median step over the timed steps, after compile warm-up), MFU against the
catalogue's dense bf16 peak and against a bf16 matmul ceiling measured here, and peak memory.
Beside each measured figure it prints the planner's prediction for the same layout (flopwise stack):
step time, MFU, and this rank's parameter/gradient/optimizer/activation bytes. Tokens are synthetic
(uniform over the vocabulary): throughput does not depend on them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from flopwise.config.schema import load_config
from flopwise.flops import count_params, flops_per_token, mfu
from flopwise.hardware.catalogue import get_hardware, load_catalogue
from flopwise.measure.hopper_tables import SHAPE_1B  # Llama 3.2 1B's blocks, 32K vocabulary
from flopwise.parallel import mesh
from flopwise.plan.rank import predict_rank
from flopwise.plan.step import evaluate_layout
from flopwise.train.build import build_engine
from flopwise.train.metrics import measure_matmul_peak
from flopwise.train.optim import step_unless

SHAPE_TINY = ['model.preset="demo-tiny"', "data.seq_len=64"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="a tiny model, fp32, on CPU: checks the path, not speed")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--zero", type=int, default=3, help="3: FSDP2 (bf16 params, fp32 masters); 0: plain autocast")
    ap.add_argument(
        "--eager", action="store_true", help="no torch.compile (what the planner's eager activation model books)"
    )
    ap.add_argument("--profile", action="store_true", help="after timing, profile one step: top kernels by time")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--hardware-file",
        type=Path,
        default=None,
        help="a `flopwise hardware calibrate` TOML: its h200 "
        "entry's prediction is reported too (`predicted_calibrated`)",
    )
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not dist.is_initialized():  # one rank, with or without torchrun
        store = tempfile.NamedTemporaryFile(delete=False).name
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    shape = SHAPE_TINY if a.tiny else SHAPE_1B
    cfg = load_config(
        None,
        [
            *shape,
            f"train.global_batch={a.batch}",
            f"train.micro_batch={a.batch}",
            f'train.dtype="{"bf16" if cuda else "fp32"}"',
            f"train.compile={'true' if cuda and not a.eager else 'false'}",
            f"parallel.zero={a.zero}",
            f'train.device="{device.type}"',
            'cluster.hardware="h200"',
        ],
    )
    lo = mesh.layout_of(cfg, 1)
    par = mesh.Parallel(lo, mesh.make_mesh(lo, device), device)
    engine, opt = build_engine(cfg, par)
    seq, vocab = cfg.data.seq_len, cfg.model.vocab_size
    gen = torch.Generator().manual_seed(0)

    def step() -> torch.Tensor:
        batch = torch.randint(0, vocab, (a.batch, seq + 1), generator=gen)
        loss = engine.forward_backward(batch)
        norm = engine.clip_grad_norm(1.0)
        step_unless(opt, ~(torch.isfinite(loss) & torch.isfinite(norm)))
        opt.zero_grad(set_to_none=True)
        return loss

    times = []
    for i in range(a.warmup + a.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tps = a.batch * seq / step_s
    fpt = flops_per_token(cfg.model, seq)
    dtype = cfg.train.dtype
    catalogue = get_hardware("h200").peak(dtype) if cuda else None
    measured = measure_matmul_peak(dtype, device, sizes=(4096, 8192) if cuda else (256,))
    result = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "params": count_params(cfg.model).total,
        "seq_len": seq,
        "batch": a.batch,
        "dtype": dtype,
        "compile": cfg.train.compile,
        "layout": "fsdp2 (zero3) on a one-rank mesh" if a.zero == 3 else f"zero{a.zero} on a one-rank mesh",
        "median_step_s": step_s,
        "tokens_per_s": tps,
        "model_flops_per_token": fpt,
        "final_loss": float(loss),
        "mfu_vs_catalogue": mfu(tps, fpt, catalogue) if catalogue else None,
        "catalogue_peak_flops": catalogue,
        "mfu_vs_measured_matmul": mfu(tps, fpt, measured),
        "measured_matmul_flops": measured,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }
    plan = evaluate_layout(
        cfg.model,
        get_hardware("h200"),
        lo,
        seq,
        a.batch,  # what flopwise plan says of this run
        compile=cfg.train.compile,
        steps=cfg.train.steps,
        dtype=cfg.train.dtype,
    )
    rank = predict_rank(cfg, lo, 0, 0, 0, cpu=not cuda)
    result["predicted"] = {
        "step_s": plan.step_time,
        "tokens_per_s": plan.tokens_per_s,
        "mfu": plan.mfu,
        "memory_bytes": plan.memory,
        "rank_bytes": {
            "params": rank.params,
            "grads": rank.grads,
            "optimizer": rank.optimizer,
            "activations": rank.activations,
        },
    }
    if a.hardware_file:  # the same prediction from this GPU's own tables
        mine = evaluate_layout(
            cfg.model,
            load_catalogue(a.hardware_file)["h200"],
            lo,
            seq,
            a.batch,
            compile=cfg.train.compile,
            steps=cfg.train.steps,
            dtype=cfg.train.dtype,
        )
        result["predicted_calibrated"] = {
            "step_s": mine.step_time,
            "tokens_per_s": mine.tokens_per_s,
            "mfu": mine.mfu,
            "time_breakdown_s": mine.time,
        }
    print(json.dumps(result, indent=1))
    if a.profile:  # where a step's time goes, per kernel (profile before optimising)
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            step()
            if cuda:
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=25)
        print(table)
        result["profile_top_kernels"] = table
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
