"""Prints the built-in H100/H200 efficiency tables, derived from the one H200 profile this project recorded,
and the planner's step time beside every recorded H200 run, before and after them.

    python benchmarks/hopper_tables.py

Source: `benchmarks/gpu/llama1b.py --zero 3 --profile` on a lent H200 (2026-12-04, torch 2.11.0+cu130,
cuBLAS nvjet GEMM kernels, cuDNN SDPA; benchmarks/results/gpu_llama1b_z3_b8.json): one compiled step of
a 1.1B Llama (16 x 2048, 32 heads of 64, 8 kv heads, SwiGLU 8192, vocab 32000) at 8 x 2048 tokens,
208.96 ms of kernels. Each kernel class's measured time is set beside the planner's time for the same
work at unit efficiency (GEMMs, attention forward and backward) or at the nominal HBM bandwidth
(element-wise work: the planner's byte count of the layers and the loss), so each table row is the
share of the peak (or the bytes/s) this chip and its libraries really gave on this model's shapes:
- GEMMs: aten::mm, all 339 products of the step (7 per layer forward, 14 backward, the head's 3);
- attention: cuDNN flash forward and backward, at seq 2048, head dim 64 (causal; shares of the peak in
  the planner's full-score FLOP count, as `hardware calibrate` measures them);
- element-wise: the kernels left after GEMMs, attention, the fused AdamW and FSDP2's copies on its
  one-rank mesh (`aten::copy_`, a cost the planner does not book for a one-rank run);
- optimizer: the fused AdamW kernel over the model's 1.104B fp32 parameters.
One shape per table: these are points, not curves (`flopwise hardware calibrate --device cuda` on a GPU
measures the curves). The H100 SXM has the same GH100 compute (132 SMs, 989.4 TFLOP/s dense bf16) and
libraries, so it shares the compute shares; its memory-bound rates scale with HBM bandwidth (3.35 vs
4.8 TB/s). Published large-GEMM ceilings agree on the compute side: H100 SXM 792.1 TFLOP/s = 80.1% of
989 at its best shape (S. Bekman, ml-engineering, "Maximum Achievable Matmul FLOPS", CUDA 12.1),
torchao's roofline 0.78 for large inputs (torchao/testing/training/roofline_utils.py), and this H200's
own 742-820 TFLOP/s on 4096^2 and 8192^2 products (75-83%).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from flopwise.hardware import get_hardware
from flopwise.plan.hopper import derive, predict, run_config

RESULTS = Path(__file__).parent / "results"
PROFILED = RESULTS / "gpu_llama1b_z3_b8.json"
RUNS = ["gpu_llama1b_z3_b8", "gpu_llama1b_z3_b16", "gpu_llama1b_z0_b8", "gpu_llama1b_z0_b8_eager"]


def main() -> None:
    print("derived H200 table:", derive(json.loads(PROFILED.read_text())))
    print("built-in H200:      ", get_hardware("h200").calibration)
    print("run: measured step | predicted before (A100's 0.75, nominal HBM) | after (built-in tables)")
    before_hw = replace(get_hardware("h200"), calibration=None, matmul_efficiency=0.75)
    rows = []
    for name in RUNS:
        run = json.loads((RESULTS / f"{name}.json").read_text())
        zero = 3 if "fsdp2" in run["layout"] else 0
        cfg = run_config(run["batch"], zero, run["compile"])
        before, after = predict(cfg, before_hw)[0], predict(cfg, get_hardware("h200"))[0]
        m = run["median_step_s"]
        rows.append({"run": name, "measured_s": m, "before_s": before, "after_s": after})
        print(
            f"  {name:26s} {1e3 * m:6.1f} ms | {1e3 * before:6.1f} ({m / before:.3f}) | {1e3 * after:6.1f} "
            f"({m / after:.3f})   measured/predicted"
        )
    (RESULTS / "hopper_tables.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
