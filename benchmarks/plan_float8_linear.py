"""The planner's float8 speed-up of one linear, shape by shape, beside torchao's published table (issue 32).

    python benchmarks/plan_float8_linear.py  ->  benchmarks/results/plan_float8_linear.json

Reference: torchao's per-shape microbenchmark on an NVIDIA H100 (tests/data/torchao_float8_rowwise_h100.json,
transcribed from pytorch/ao docs/static/fp8-rowwise-perf.png at commit fdddb2cfa, with its citation):
rowwise float8 vs bf16 speed-up of LayerNorm -> Linear -> Sigmoid, forward + backward, compiled, as the
sum of GPU kernel times, for M, K, N each in 1024 ... 32768 (216 shapes). No tensorwise table of that
kind is published as data (the README's tensorwise tables are images outside the repository, and the
2024 one was a roofline estimate from benchmarked GEMMs, not a measurement), so the planner's
tensorwise figures are listed without a reference.

The planner: `linear_times`, the terms plan.perf.layer_times books for a block's float8 linear, for
one (M, K, N) product: the three GEMMs (plan.perf.gemm_fwd_bwd at the bf16 or fp8 peak, each
direction at plan.float8.scaled_mm_speed), the amax, cast and rescale kernels (plan.float8.
linear_cast_bytes with the module's bf16 weight) and the module's element-wise work, both streamed
at plan.perf.stream_time's rate for an M x K activation, as layer_times streams a layer's. The
LayerNorm (no affine) and the sigmoid are booked as plan.perf.layer_elementwise_bytes books a
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
import math
import statistics
from dataclasses import replace
from pathlib import Path

from flopwise.hardware import Hardware, get_hardware, hopper_calibration
from flopwise.plan.float8 import linear_cast_bytes, scaled_mm_speed
from flopwise.plan.perf import ACT_BYTES, gemm_fwd_bwd, stream_time

ROOT = Path(__file__).parents[1]
TABLE = ROOT / "tests" / "data" / "torchao_float8_rowwise_h100.json"
OUT = Path(__file__).parent / "results" / "plan_float8_linear.json"
BAND = 0.10  # a speed-up within 10% of 1 is "about even"; outside it, float8 pays or loses


def published() -> tuple[dict, dict[tuple[int, int, int], float]]:
    """The data file and its table as {(M, K, N): speed-up}."""
    doc = json.loads(TABLE.read_text())
    return doc, {(m, k, n): s for m, k, *row in doc["rows"] for n, s in zip(doc["n_values"], row, strict=True)}


def table_gpu(doc: dict) -> Hardware:
    """h100-sxm at the table's HBM bandwidth, its memory-bound rates scaled as the catalogue scales them."""
    bw = doc["device"]["memory_bw"]
    return replace(get_hardware("h100-sxm"), name="h100-meta", memory_bw=bw,
                   calibration=hopper_calibration(bw, f"h100-sxm's tables at {bw / 1e12:.1f} TB/s: "
                                                      f"{doc['device']['name']}"))


def linear_times(shapes: list[tuple[float, float, float]], hw: Hardware, recipe: str, elementwise_bytes: float,
                 act_bytes: float) -> dict[str, float]:
    """Seconds of forward + backward of (M, K, N) linears under train.float8 = `recipe` ("none": bf16), by
    term, as plan.perf.layer_times books a block's linears, with `elementwise_bytes` of other work
    streamed at the rate of an `act_bytes` activation."""
    if recipe == "none":
        gemm, cast = sum(gemm_fwd_bwd(shapes, hw, hw.peak_16bit)), 0.0
    else:
        (g_f, g_b), (s_f, s_b) = gemm_fwd_bwd(shapes, hw, hw.peak("fp8")), scaled_mm_speed(recipe)
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


def summary(pairs: list[tuple[float, float]]) -> dict:
    """(predicted, published) pairs: median and largest |log(predicted / published)|, the mean log
    ratio (> 0: the planner promises more than was measured), and how many shapes the planner puts on
    the wrong side of 1 where the table is more than BAND from it."""
    logs = [math.log(p / q) for p, q in pairs]
    wrong = sum((q >= 1 + BAND and p <= 1) or (q <= 1 - BAND and p >= 1) for p, q in pairs)
    return {"shapes": len(pairs), "median_abs_log_ratio": statistics.median(abs(x) for x in logs),
            "max_abs_log_ratio": max(abs(x) for x in logs), "mean_log_ratio": statistics.fmean(logs),
            "wrong_side_of_1": wrong}


def main() -> None:
    doc, table = published()
    devices = {"table_gpu": table_gpu(doc), "h100-sxm": get_hardware("h100-sxm")}
    rows = []
    for (m, k, n), pub in table.items():
        row = {"M": m, "K": k, "N": n, "published_rowwise": pub}
        for key, hw in devices.items():
            row[f"rowwise_{key}"] = round(speedup(m, k, n, hw, "rowwise"), 4)
        row["tensorwise_table_gpu"] = round(speedup(m, k, n, devices["table_gpu"], "tensorwise"), 4)
        row["ms_table_gpu"] = {r: {t: round(1e3 * v, 5) for t, v in ln_linear_sigmoid(m, k, n, devices["table_gpu"],
                                                                                      r).items()}
                               for r in ("none", "rowwise")}
        rows.append(row)
    bands = {"all": lambda r: True, "N<=2048": lambda r: r["N"] <= 2048, "N>=4096": lambda r: r["N"] >= 4096,
             "M,K,N>=4096": lambda r: min(r["M"], r["K"], r["N"]) >= 4096}
    stats = {key: {band: summary([(r[f"rowwise_{key}"], r["published_rowwise"]) for r in rows if keep(r)])
                   for band, keep in bands.items()} for key in devices}

    ns = doc["n_values"]
    print("rowwise float8 speed-up of LayerNorm -> Linear -> Sigmoid (fwd + bwd) over bf16: torchao published (H100) / "
          "planner on the table's GPU (2.4 TB/s)")
    print(f"  {'M':>5s} {'K':>5s}  " + "  ".join(f"N={n:<9d}" for n in ns))
    for m in ns:
        for k in ns:
            cells = [next(r for r in rows if (r["M"], r["K"], r["N"]) == (m, k, n)) for n in ns]
            print(f"  {m:5d} {k:5d}  " + "  ".join(f"{c['published_rowwise']:4.2f}/{c['rowwise_table_gpu']:4.2f}  "
                                                  for c in cells))
    print("planner vs published, |log(planner/published)| median, max; mean log ratio; shapes on the wrong side of 1")
    for key, by_band in stats.items():
        for band, s in by_band.items():
            print(f"  {key:10s} {band:12s} n={s['shapes']:3d}  median {s['median_abs_log_ratio']:.3f}  "
                  f"max {s['max_abs_log_ratio']:.3f}  mean {s['mean_log_ratio']:+.3f}  "
                  f"wrong side {s['wrong_side_of_1']}")
    OUT.write_text(json.dumps({"reference": str(TABLE.relative_to(ROOT)), "source": doc["source"],
                               "device": doc["device"], "band": BAND, "summary": stats, "shapes": rows}, indent=1))


if __name__ == "__main__":
    main()
