"""float8 training (train.float8, torchao) against bf16 on one GPU, through flopwise's own engine:
tokens/s, peak memory and the loss curve over real tokens (the shipped Shakespeare corpus), with
the planner's prediction beside each figure.

    python benchmarks/gpu/float8.py [--shapes a b] [--steps 200] [--out benchmarks/gpu/results/gpu_float8.json]
    python benchmarks/gpu/float8.py --tiny        # the same code path on CPU, emulated float8 (CI-sized)

Shapes, per-block compiled, seq 2048, bf16 autocast over fp32 master weights (ZeRO-0,
one process): (a) Llama 3.2 3B's (28 × 3072, 24 heads, 8 kv heads, SwiGLU 8192); (b) 8 layers of
Llama 3 8B's block (4096, 32 heads, 8 kv heads, SwiGLU 14336); both with a `--vocab` BPE vocabulary
trained on the corpus. Recipes: bf16 (train.float8=none), rowwise, tensorwise. Each (shape, recipe)
runs in its own process (a fresh compile cache and allocator) on the same batches (same seed), and
reports the median step time after `--warmup` steps, tokens/s, the allocator's peak, the training
loss at every step, the mean of the last 20 against bf16's, and the speed-up over bf16 next to the
planner's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _out import report  # benchmarks/gpu/_out.py: this script's folder is on sys.path

SHAPES = {
    "a": ["model.n_layers=28", "model.d_model=3072", "model.n_heads=24", "model.n_kv_heads=8", "model.ffn_dim=8192"],
    "b": ["model.n_layers=8", "model.d_model=4096", "model.n_heads=32", "model.n_kv_heads=8", "model.ffn_dim=14336"],
    "tiny": ['model.preset="demo-tiny"'],
}
RECIPES = ("none", "rowwise", "tensorwise")
TAIL = 20  # the loss compared: the mean over the last TAIL steps


def one(shape: str, recipe: str, a: argparse.Namespace) -> dict:
    """Train `a.steps` steps of one shape under one recipe in this process; its figures."""
    import torch

    from flopwise.config.schema import load_config
    from flopwise.flops import flops_per_token, mfu
    from flopwise.hardware.catalogue import get_hardware
    from flopwise.plan.rank import predict_rank
    from flopwise.plan.step import evaluate_layout
    from flopwise.train.build import build_run
    from flopwise.train.faults import Faults
    from flopwise.train.trainer import train_step

    cuda = not a.tiny
    seq = 64 if a.tiny else 2048
    cfg = load_config(
        None,
        [
            *SHAPES[shape],
            f"model.vocab_size={a.vocab}",
            f"model.max_seq_len={seq}",
            f"data.seq_len={seq}",
            f'data.path="{a.data}"',
            f'run.dir="{a.work / f"{shape}-{recipe}"}"',
            'checkpoint.resume="none"',
            f"train.steps={a.warmup + a.steps}",
            f"train.global_batch={a.batch}",
            f"train.micro_batch={a.batch}",
            'train.dtype="bf16"',
            f"train.compile={'true' if cuda else 'false'}",
            f'train.device="{"cuda" if cuda else "cpu"}"',
            f'train.float8="{recipe}"',
            f"train.float8_emulate={'false' if cuda else 'true'}",
            "parallel.zero=0",
            'cluster.hardware="h200"',
            "optim.warmup_steps=20" if not a.tiny else "optim.warmup_steps=1",
        ],
    )
    run = build_run(cfg)
    faults = Faults.from_env(0)
    losses, times = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(cfg.train.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        values, _ = train_step(run, step, faults)
        losses.append(float(values[0]))  # a host sync per step: the timing includes it for every recipe
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens_per_s = a.batch * seq / step_s
    fpt = flops_per_token(cfg.model, seq)
    h200 = get_hardware("h200")
    lo = run.par.layout
    rank = predict_rank(cfg, lo, 0, 0, 0, cpu=not cuda)
    out = {
        "shape": shape,
        "recipe": recipe,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (emulated)",
        "torch": torch.__version__,
        "seq_len": seq,
        "batch": a.batch,
        "steps": a.steps,
        "warmup": a.warmup,
        "median_step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu_bf16_peak": mfu(tokens_per_s, fpt, h200.peak("bf16")) if cuda else None,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "predicted_peak_bytes": rank.params + rank.grads + rank.optimizer + rank.peak,
        "losses": losses,
        "tail_loss": statistics.fmean(losses[-TAIL:]),
    }
    plan = evaluate_layout(
        cfg.model, h200, lo, seq, a.batch, compile=cfg.train.compile, steps=cfg.train.steps, dtype="bf16", float8=recipe
    )
    out["predicted_tokens_per_s"] = plan.tokens_per_s
    return out


def prepare_data(a: argparse.Namespace) -> None:
    from flopwise.data.prepare import prepare_data

    if not (a.data / "index.json").exists():
        prepare_data(["builtin:shakespeare"], a.data, tokenizer=f"bpe:{a.vocab}", val_fraction=0.05, seed=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="demo-tiny on CPU with torchao's emulation: checks the path")
    ap.add_argument("--shapes", nargs="+", default=None, choices=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    ap.add_argument("--steps", type=int, default=200, help="timed steps (the loss is compared over all)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed first steps (compile)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--vocab", type=int, default=32768, help="BPE vocabulary trained on the corpus")
    ap.add_argument("--work", type=Path, default=None, help="run folders and the prepared corpus (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--one", nargs=2, metavar=("SHAPE", "RECIPE"), help=argparse.SUPPRESS)  # a child process
    a = ap.parse_args()
    if a.tiny:
        a.vocab, a.batch, a.steps, a.warmup = 512, 4, min(a.steps, 6), 1
    a.work = a.work or Path(tempfile.mkdtemp(prefix="flopwise-float8-"))
    a.data = a.work / f"shakespeare-bpe{a.vocab}"
    if a.one:
        print(json.dumps(one(*a.one, a)))
        return
    prepare_data(a)
    shapes = ["tiny"] if a.tiny else (a.shapes or ["a", "b"])
    results = []
    for shape in shapes:
        for recipe in a.recipes:
            args = [
                sys.executable,
                __file__,
                "--one",
                shape,
                recipe,
                "--work",
                str(a.work),
                "--steps",
                str(a.steps),
                "--warmup",
                str(a.warmup),
                "--batch",
                str(a.batch),
                "--vocab",
                str(a.vocab),
            ] + (["--tiny"] if a.tiny else [])
            r = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
            if r.returncode:
                results.append({"shape": shape, "recipe": recipe, "error": r.stderr.strip().splitlines()[-1:]})
            else:
                results.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"}), flush=True)
    for r in results:  # against the same shape's bf16 run
        base = next(
            (b for b in results if b["shape"] == r["shape"] and b["recipe"] == "none" and "error" not in b), None
        )
        if base is None or "error" in r:
            continue
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["tail_loss_vs_bf16"] = r["tail_loss"] / base["tail_loss"] - 1
        if r["predicted_tokens_per_s"] and base["predicted_tokens_per_s"]:
            r["predicted_speedup"] = r["predicted_tokens_per_s"] / base["predicted_tokens_per_s"]
    summary = [
        {
            k: r.get(k)
            for k in (
                "shape",
                "recipe",
                "tokens_per_s",
                "speedup",
                "predicted_speedup",
                "peak_memory_bytes",
                "predicted_peak_bytes",
                "tail_loss",
                "tail_loss_vs_bf16",
                "error",
            )
        }
        for r in results
    ]
    report(results, a.out, shown=summary)


if __name__ == "__main__":
    main()
