"""The planner's float8 speed-up of one linear, shape by shape, beside torchao's published table.

    python benchmarks/published/plan_float8_linear.py  ->  benchmarks/published/results/plan_float8_linear.json

Reference, method and devices: flopwise.plan.float8_speedup's docstring.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from flopwise.hardware.catalogue import get_hardware
from flopwise.plan.float8_speedup import ln_linear_sigmoid, published, speedup, table_gpu

ROOT = Path(__file__).parents[2]
TABLE = ROOT / "tests" / "fixtures" / "torchao_float8_rowwise_h100.json"
OUT = Path(__file__).parent / "results" / "plan_float8_linear.json"
BAND = 0.10  # a speed-up within 10% of 1 is "about even"; outside it, float8 pays or loses


def summary(pairs: list[tuple[float, float]]) -> dict:
    """(predicted, published) pairs: median and largest |log(predicted / published)|, the mean log
    ratio (> 0: the planner promises more than was measured), and how many shapes the planner puts on
    the wrong side of 1 where the table is more than BAND from it."""
    logs = [math.log(p / q) for p, q in pairs]
    wrong = sum((q >= 1 + BAND and p <= 1) or (q <= 1 - BAND and p >= 1) for p, q in pairs)
    return {
        "shapes": len(pairs),
        "median_abs_log_ratio": statistics.median(abs(x) for x in logs),
        "max_abs_log_ratio": max(abs(x) for x in logs),
        "mean_log_ratio": statistics.fmean(logs),
        "wrong_side_of_1": wrong,
    }


def main() -> None:
    doc, table = published(TABLE)
    devices = {"table_gpu": table_gpu(doc), "h100-sxm": get_hardware("h100-sxm")}
    rows = []
    for (m, k, n), pub in table.items():
        row = {"M": m, "K": k, "N": n, "published_rowwise": pub}
        for key, hw in devices.items():
            row[f"rowwise_{key}"] = round(speedup(m, k, n, hw, "rowwise"), 4)
        row["tensorwise_table_gpu"] = round(speedup(m, k, n, devices["table_gpu"], "tensorwise"), 4)
        row["ms_table_gpu"] = {
            r: {t: round(1e3 * v, 5) for t, v in ln_linear_sigmoid(m, k, n, devices["table_gpu"], r).items()}
            for r in ("none", "rowwise")
        }
        rows.append(row)
    bands = {
        "all": lambda r: True,
        "N<=2048": lambda r: r["N"] <= 2048,
        "N>=4096": lambda r: r["N"] >= 4096,
        "M,K,N>=4096": lambda r: min(r["M"], r["K"], r["N"]) >= 4096,
    }
    stats = {
        key: {
            band: summary([(r[f"rowwise_{key}"], r["published_rowwise"]) for r in rows if keep(r)])
            for band, keep in bands.items()
        }
        for key in devices
    }

    ns = doc["n_values"]
    print(
        "rowwise float8 speed-up of LayerNorm -> Linear -> Sigmoid (fwd + bwd) over bf16: torchao published (H100) / "
        "planner on the table's GPU (2.4 TB/s)"
    )
    print(f"  {'M':>5s} {'K':>5s}  " + "  ".join(f"N={n:<9d}" for n in ns))
    for m in ns:
        for k in ns:
            cells = [next(r for r in rows if (r["M"], r["K"], r["N"]) == (m, k, n)) for n in ns]
            print(
                f"  {m:5d} {k:5d}  "
                + "  ".join(f"{c['published_rowwise']:4.2f}/{c['rowwise_table_gpu']:4.2f}  " for c in cells)
            )
    print("planner vs published, |log(planner/published)| median, max; mean log ratio; shapes on the wrong side of 1")
    for key, by_band in stats.items():
        for band, s in by_band.items():
            print(
                f"  {key:10s} {band:12s} n={s['shapes']:3d}  median {s['median_abs_log_ratio']:.3f}  "
                f"max {s['max_abs_log_ratio']:.3f}  mean {s['mean_log_ratio']:+.3f}  "
                f"wrong side {s['wrong_side_of_1']}"
            )
    OUT.write_text(
        json.dumps(
            {
                "reference": str(TABLE.relative_to(ROOT)),
                "source": doc["source"],
                "device": doc["device"],
                "band": BAND,
                "summary": stats,
                "shapes": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
