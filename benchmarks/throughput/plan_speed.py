"""Planner speed and validation figures: full layout searches timed, and the published rows predicted.

python benchmarks/throughput/plan_speed.py  ->  benchmarks/throughput/results/plan_speed.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "published"))  # the published Megatron shapes
from flopwise.config.schema import ModelConfig  # noqa: E402
from flopwise.hardware.catalogue import get_hardware  # noqa: E402
from flopwise.plan.search import search_layouts  # noqa: E402
from flopwise.plan.shape import model_shape  # noqa: E402
from flopwise.plan.stack import STACKS  # noqa: E402
from plan_published import megatron  # noqa: E402

OUT = Path(__file__).parent / "results" / "plan_speed.json"


def timed(name, model, seq, hardware, gpus, batch, stack="flopwise", fixed=None, repeats=3):
    sh = model_shape(model, seq)
    hw = get_hardware(hardware)
    best_s, res = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        res = search_layouts(sh, hw, gpus, seq, batch, STACKS[stack], fixed)
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
