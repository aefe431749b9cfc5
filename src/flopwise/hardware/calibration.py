"""What `flopwise hardware calibrate` measured on one device, and how the time model reads it.
Pure Python: the planner uses it without torch.

A hardware entry's `calibration` table replaces the single numbers the catalogue otherwise
assumes (one GEMM efficiency, one streaming efficiency of the nominal HBM bandwidth, nominal
link rates):
- gemm: (m, n, k, share of the entry's dense peak) per measured (M×K)·(K×N) product, read for any
  shape by inverse-distance weighting over log(m), log(n), log(k): efficiency is a smooth function
  of the logarithm of each dimension (tiles fill, caches overflow);
- attention: (sequence, head dim, forward share, backward share) of SDPA causal attention, shares of
  the peak in the planner's attention FLOPs (forward: the score and value products; backward: twice
  those plus the recomputed scores of a fused kernel);
- elementwise: (tensor-parallel degree, bytes of one activation tensor, achieved bytes/s) of the
  engine's own forward + backward (under its tensor parallel for a degree > 1) with the GEMM and
  attention tables' time (and, at tp > 1, the fitted all-reduces) taken out, in the planner's byte
  count (`plan.step` element-wise terms): what everything else really costs at that size and
  degree, launch overheads, casts and DTensor's per-op dispatch included;
- optimizer: (parameters, seconds) of one fused AdamW step with gradient clipping;
- collectives: per kind, (ranks, bytes, seconds); the planner fits latency and bandwidth of the
  ring model (`plan.comm.ring_time`) to them;
- overlap: the share of an all-reduce that hides behind matmuls on the same device, which scales
  the stack's overlap of data-parallel traffic with backward;
- layer_overhead: seconds per layer of a decode step of the calibrated architecture at width 64
  (measure.serve.layer_overhead): the eager engine's fixed work per layer, which the byte-priced
  element-wise table cannot show at a decode step's tiny tensors (0: not measured).
On a CPU a device is one rank of `--nproc` on the machine: the compute tables are measured with
`threads` = cores / nproc, and `plan measure` gives each rank that many.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import pairwise

from flopwise.errors import ConfigError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


@dataclass(frozen=True)
class Calibration:
    dtype: str
    # rows of 4, 4, 3, 2 and 3 numbers (checked where a calibration is read)
    gemm: tuple[tuple[float, ...], ...]
    attention: tuple[tuple[float, ...], ...]
    elementwise: tuple[tuple[float, ...], ...]
    optimizer: tuple[tuple[float, ...], ...]
    collectives: tuple[tuple[str, tuple[tuple[float, ...], ...]], ...] = ()
    source: str = ""
    threads: int = 0  # CPU: the threads one device (one rank) had; `plan measure` runs its ranks so
    overlap: float = 1.0  # share of a collective that hides behind compute on the same device
    layer_overhead: float = 0.0  # seconds per layer of a decode step beyond its FLOPs and bytes
    _fits: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def gemm_efficiency(self, m: float, n: float, k: float) -> float:
        return _idw(self.gemm, (m, n, k))[0]

    def attention_efficiency(self, seq: float, head_dim: float) -> tuple[float, float]:
        fwd, bwd = _idw(self.attention, (seq, head_dim))
        return fwd, bwd

    def stream_bandwidth(self, tensor_bytes: float, tp: int = 1) -> float:
        """Achieved bytes/s of element-wise work whose tensors are `tensor_bytes` each, at the
        largest measured tensor-parallel degree up to `tp` (the smallest measured one below it)."""
        return _stream(self.elementwise, tensor_bytes, tp)

    def optimizer_seconds(self, params: float) -> float:
        """One AdamW step over `params` elements: linear between measured sizes, and in proportion
        beyond the largest (a streaming kernel's time grows with its bytes)."""
        pts = sorted(self.optimizer)
        if params >= pts[-1][0]:
            return pts[-1][1] * params / pts[-1][0]
        rate = _interp_log([(p, s / p) for p, s in pts], params)
        return rate * params

    def collective(self, kind: str) -> tuple[float, float] | None:
        """(latency per ring step, bandwidth) fitted to the measured times of `kind`, or None."""
        if kind not in self._fits:
            rows = dict(self.collectives).get(kind)
            self._fits[kind] = _fit_ring(kind, rows) if rows else None
        return self._fits[kind]


@lru_cache(maxsize=65536)
def _stream(rows, tensor_bytes: float, tp: int) -> float:
    degrees = sorted({r[0] for r in rows})
    at = max((d for d in degrees if d <= tp), default=degrees[0])
    return _interp_log([(b, bw) for d, b, bw in rows if d == at], tensor_bytes)


@lru_cache(maxsize=65536)  # a search asks for the same few shapes thousands of times
def _idw(rows, point) -> tuple[float, ...]:
    """Inverse-squared-distance weighted mean of the rows' values, distance in log space."""
    logp = [math.log(max(x, 1.0)) for x in point]
    total, acc = 0.0, [0.0] * (len(rows[0]) - len(point))
    for row in rows:
        d2 = sum((math.log(max(a, 1.0)) - b) ** 2 for a, b in zip(row, logp, strict=False))
        values = row[len(point) :]
        if d2 < 1e-12:
            return tuple(values)
        w = 1.0 / d2
        acc = [a + w * v for a, v in zip(acc, values, strict=True)]
        total += w
    return tuple(a / total for a in acc)


def _interp_log(rows, x: float) -> float:
    """Piecewise-linear in log(x), flat beyond the measured range."""
    pts = sorted(rows)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in pairwise(pts):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0)
    return pts[-1][1]


def _ring_steps_and_factor(kind: str, n: int) -> tuple[float, float]:
    """Latency steps and bytes-on-the-wire factor of a ring collective over n ranks (plan.comm's
    model; a send/recv is one step carrying the whole buffer)."""
    if kind == "send_recv":
        return 1.0, 1.0
    if kind == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    return float(n - 1), (n - 1) / n


def _fit_ring(kind: str, rows) -> tuple[float, float]:
    """Least squares of t = α·steps + factor·bytes / β over the measured rows (α, 1/β ≥ 0)."""
    xs = [_ring_steps_and_factor(kind, int(n)) for n, _, _ in rows]
    a = [(s, f * b) for (s, f), (_, b, _) in zip(xs, rows, strict=True)]
    t = [sec for _, _, sec in rows]
    s11 = sum(x * x for x, _ in a)
    s12 = sum(x * y for x, y in a)
    s22 = sum(y * y for _, y in a)
    r1 = sum(x * ti for (x, _), ti in zip(a, t, strict=True))
    r2 = sum(y * ti for (_, y), ti in zip(a, t, strict=True))
    det = s11 * s22 - s12 * s12
    alpha, inv_bw = ((r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det) if det > 0 else (0.0, 0.0)
    if inv_bw <= 0:  # latency-bound measurements: bandwidth from the largest message alone
        n, b, sec = max(rows, key=lambda r: r[1])
        steps, factor = _ring_steps_and_factor(kind, int(n))
        return max(alpha, 0.0), factor * b / max(sec - max(alpha, 0.0) * steps, 1e-9)
    if alpha < 0:
        alpha, inv_bw = 0.0, r2 / s22
    return alpha, 1.0 / inv_bw


def positive_number(x) -> bool:
    """A finite number > 0 (TOML reads `inf` and `nan` as floats: neither is a measurement)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def share(where: str, value) -> float:
    """A finite share between 0 and 1, or one line naming `where`."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
        raise ConfigError(f"{where}: a share between 0 and 1 is needed, got {value!r}")
    return float(value)


def _rows(where: str, value, width: int) -> tuple[tuple[float, ...], ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(
            f"{where}: a non-empty list of [{width} numbers] rows is needed (run `flopwise hardware calibrate` again)"
        )
    out = []
    for i, row in enumerate(value):
        if not isinstance(row, list) or len(row) != width or not all(positive_number(x) for x in row):
            raise ConfigError(f"{where}[{i}]: expected {width} positive numbers, got {row!r}")
        out.append(tuple(float(x) for x in row))
    return tuple(out)


def parse_calibration(where: str, data) -> Calibration:
    """A calibration table from a hardware TOML's `[NAME.calibration]`, every field checked."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a table is needed")
    known = {
        "dtype",
        "gemm",
        "attention",
        "elementwise",
        "optimizer",
        "collectives",
        "source",
        "threads",
        "overlap",
        "layer_overhead",
    }
    missing = [k for k in ("dtype", "gemm", "attention", "elementwise", "optimizer") if k not in data]
    if missing:
        raise ConfigError(
            f"{where}: missing {', '.join(missing)} (a partial file: run `flopwise hardware calibrate` again)"
        )
    extra = set(data) - known
    if extra:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(sorted(extra))} (known: {', '.join(sorted(known))})")
    colls = data.get("collectives", {})
    if not isinstance(colls, dict) or set(colls) - set(COLLECTIVES):
        raise ConfigError(f"{where}.collectives: a table with keys among {', '.join(COLLECTIVES)}")
    return Calibration(
        dtype=str(data["dtype"]),
        gemm=_rows(f"{where}.gemm", data["gemm"], 4),
        attention=_rows(f"{where}.attention", data["attention"], 4),
        elementwise=_rows(f"{where}.elementwise", data["elementwise"], 3),
        optimizer=_rows(f"{where}.optimizer", data["optimizer"], 2),
        collectives=tuple((k, _rows(f"{where}.collectives.{k}", v, 3)) for k, v in sorted(colls.items())),
        source=str(data.get("source", "")),
        threads=_threads(where, data.get("threads", 0)),
        overlap=share(f"{where}.overlap", data.get("overlap", 1.0)),
        layer_overhead=_seconds(f"{where}.layer_overhead", data.get("layer_overhead", 0.0)),
    )


def _seconds(where: str, value) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
        raise ConfigError(f"{where}: seconds >= 0 are needed, got {value!r}")
    return float(value)


def _threads(where: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{where}.threads: a whole number >= 0 is needed, got {value!r}")
    return value


def calibration_toml(c: Calibration) -> dict:
    """The TOML tree of a calibration (the inverse of parse_calibration)."""
    return {
        "dtype": c.dtype,
        "source": c.source,
        "threads": c.threads,
        "overlap": c.overlap,
        "layer_overhead": c.layer_overhead,
        "gemm": [list(r) for r in c.gemm],
        "attention": [list(r) for r in c.attention],
        "elementwise": [list(r) for r in c.elementwise],
        "optimizer": [list(r) for r in c.optimizer],
        "collectives": {k: [list(r) for r in rows] for k, rows in c.collectives},
    }
