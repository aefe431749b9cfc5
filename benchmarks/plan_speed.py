"""Planner speed and validation figures: full layout searches timed, and the published rows predicted.

python benchmarks/plan_speed.py  ->  benchmarks/results/plan.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from flopwise.config.schema import ModelConfig
from flopwise.hardware.catalogue import get_hardware
from flopwise.plan.search import search
from flopwise.plan.shape import model_shape
from flopwise.plan.stack import STACKS

OUT = Path(__file__).parent / "results" / "plan.json"


def timed(name, model, seq, hardware, gpus, batch, stack="flopwise", fixed=None, repeats=3):
    sh = model_shape(model, seq)
    hw = get_hardware(hardware)
    best_s, res = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        res = search(sh, hw, gpus, seq, batch, STACKS[stack], fixed)
        best_s = min(best_s, time.perf_counter() - t)
    b = res.best
    return {
        "case": name,
        "seconds": best_s,
        "evaluated": res.evaluated,
        "fitting": res.fitting,
        "best": b.layout.to_json(),
        "mfu": b.mfu,
        "hardware_tflops": b.hardware_tflops,
    }


def megatron(n_layers, d_model, heads):
    return ModelConfig(
        arch="gpt2", n_layers=n_layers, d_model=d_model, n_heads=heads, vocab_size=51200, max_seq_len=2048, dropout=0.1
    )


def main() -> None:
    rows = [
        timed(
            "llama3-405b, 16384 x h100-sxm, seq 8192, 2048 seqs (16M tokens)",
            ModelConfig(preset="llama3-405b"),
            8192,
            "h100-sxm",
            16384,
            2048,
        ),
        timed(
            "llama3-70b, 1024 x h100-sxm, seq 8192, 512 seqs",
            ModelConfig(preset="llama3-70b"),
            8192,
            "h100-sxm",
            1024,
            512,
        ),
        timed(
            "megatron 1T, 3072 x a100-80gb, batch 3072 (megatron-2021 stack)",
            megatron(128, 25600, 160),
            2048,
            "a100-80gb",
            3072,
            3072,
            "megatron-2021",
            repeats=1,
        ),
    ]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(
            f"{r['case']}: {r['seconds']:.3f} s, {r['evaluated']} layouts evaluated, {r['fitting']} fit, "
            f"best MFU {r['mfu']:.1%}"
        )


if __name__ == "__main__":
    main()
