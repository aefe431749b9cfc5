"""The planner's float8 speed-up of one linear, shape by shape, for comparison with torchao's published
per-shape table (benchmarks/plan_float8_linear.py prints it; tests/plan/test_float8_plan.py checks it).

Reference: torchao's per-shape microbenchmark on an NVIDIA H100 (tests/fixtures/torchao_float8_rowwise_h100.json,
transcribed from pytorch/ao docs/static/fp8-rowwise-perf.png at commit fdddb2cfa, with its citation):
rowwise float8 vs bf16 speed-up of LayerNorm -> Linear -> Sigmoid, forward + backward, compiled, as the
sum of GPU kernel times, for M, K, N each in 1024 ... 32768 (216 shapes). No tensorwise table of that
kind is published as data (the README's tensorwise tables are images outside the repository, and the
2024 one was a roofline estimate from benchmarked GEMMs, not a measurement), so the planner's
tensorwise figures are listed without a reference.

The planner: `linear_times`, the terms plan.step.layer_times books for a block's float8 linear, for
one (M, K, N) product: the three GEMMs (plan.step.gemm_fwd_bwd at the bf16 or fp8 peak, each
direction at plan.float8.scaled_mm_speed), the amax, cast and rescale kernels (plan.float8.
linear_cast_bytes with the module's bf16 weight) and the module's element-wise work, both streamed
at plan.step.stream_time's rate for an M x K activation, as layer_times streams a layer's. The
LayerNorm (no affine) and the sigmoid are booked as plan.step.layer_elementwise_bytes books a
fused block's norms and activation function: a read and a write of M x K and of M x N bf16 in
forward, twice that in backward; bf16 and float8 alike. Not booked: the LayerNorm's per-row
statistics, fixed per-kernel costs (the planner has none; torchao's roofline takes 2 us per kernel,
torchao/testing/float8/roofline_utils.py KERNEL_LAUNCH_OVERHEAD_SEC), and anything outside the
kernels (the reference sums kernel times too).

Devices: the table's GPU is a Meta H100 with 2.4 TB/s HBM (the device note in the data file): the
h100-sxm entry with that bandwidth and its memory-bound rates scaled to it as hardware.hopper_calibration
scales them; and, beside it, h100-sxm as catalogued (3.35 TB/s).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from flopwise.errors import ConfigError
from flopwise.hardware.catalogue import Hardware, get_hardware, hopper_calibration
from flopwise.plan.float8 import linear_cast_bytes, scaled_mm_speed
from flopwise.plan.step import ACT_BYTES, gemm_fwd_bwd, planning_peak, stream_time


def published(path: Path) -> tuple[dict, dict[tuple[int, int, int], float]]:
    """torchao's table as transcribed in `path` (tests/fixtures/torchao_float8_rowwise_h100.json): the
    document and its rows as {(M, K, N): speed-up}."""
    doc = json.loads(path.read_text())
    return doc, {(m, k, n): s for m, k, *row in doc["rows"] for n, s in zip(doc["n_values"], row, strict=True)}


def table_gpu(doc: dict) -> Hardware:
    """h100-sxm at the table's HBM bandwidth, its memory-bound rates scaled as the catalogue scales them."""
    bw = doc["device"]["memory_bw"]
    return replace(
        get_hardware("h100-sxm"),
        name="h100-meta",
        memory_bw=bw,
        calibration=hopper_calibration(bw, f"h100-sxm's tables at {bw / 1e12:.1f} TB/s: {doc['device']['name']}"),
    )


def linear_times(
    shapes: list[tuple[int, int, int]], hw: Hardware, recipe: str, elementwise_bytes: float, act_bytes: float
) -> dict[str, float]:
    """Seconds of forward + backward of (M, K, N) linears under train.float8 = `recipe` ("none": bf16), by
    term, as plan.step.layer_times books a block's linears, with `elementwise_bytes` of other work
    streamed at the rate of an `act_bytes` activation."""
    products: list[tuple[float, float, float]] = [(m, k, n) for m, k, n in shapes]
    cast = 0.0
    if recipe == "none":
        gemm = sum(gemm_fwd_bwd(products, hw, planning_peak(hw)))
    else:
        fp8 = hw.peak("fp8")
        if fp8 is None:
            raise ConfigError(f"cluster.hardware={hw.name}: no fp8 peak, so no float8 recipe to time")
        (g_f, g_b), (s_f, s_b) = gemm_fwd_bwd(products, hw, fp8), scaled_mm_speed(recipe)
        gemm = g_f / s_f + g_b / s_b
        cast = stream_time(sum(sum(linear_cast_bytes(n, k, m, recipe)) for m, k, n in shapes), hw, act_bytes)
    other = stream_time(elementwise_bytes, hw, act_bytes)
    return {"gemm": gemm, "cast": cast, "elementwise": other, "total": gemm + cast + other}


def ln_linear_sigmoid(m: int, k: int, n: int, hw: Hardware, recipe: str) -> dict[str, float]:
    """The reference's module: LayerNorm over M x K, the linear, sigmoid over M x N (module docstring)."""
    elementwise = 3 * 2 * ACT_BYTES * (m * k + m * n)
    return linear_times([(m, k, n)], hw, recipe, elementwise, ACT_BYTES * m * k)


def speedup(m: int, k: int, n: int, hw: Hardware, recipe: str) -> float:
    return ln_linear_sigmoid(m, k, n, hw, "none")["total"] / ln_linear_sigmoid(m, k, n, hw, recipe)["total"]
