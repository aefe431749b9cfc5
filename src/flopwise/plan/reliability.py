"""Checkpoint cost, failure rate, optimal checkpoint interval and goodput. Pure Python.

- Checkpoint bytes: what flopwise's DCP checkpoint holds, fp32 weights + Adam m and v = 12 bytes
  per parameter (the 16-bit compute copy is re-derived on load).
- Write time: each device writes its share (bytes / devices) over its share of the storage
  bandwidth (`cluster.storage_gbps_per_gpu`); default 0.122 GB/s per GPU = the 2 TB/s sustained
  Llama 3 reported for Tectonic over 16,384 GPUs (Dubey et al. 2024 §3.3.1).
- Failures: default per-GPU MTBF 45,569 h, from Llama 3 405B's 466 job interruptions in 54 days
  on 16,384 H100s (Dubey et al. 2024 §3.3.4, Table 5); we apply it to any GPU unless
  `cluster.gpu_mtbf_hours` is set, and say so in the output. A cluster of n devices fails n times
  as often.
- Interval: Young 1974, τ = √(2δM); Daly 2006's higher-order form
  τ = √(2δM)·(1 + ⅓√(δ/2M) + δ/(18M)) − δ for δ < 2M, else M.
- Goodput: the share of wall time doing new work, 1 − δ/τ − (R + τ/2)/M to first order: each
  interval pays one write, each failure pays a restart R and on average half an interval redone.
  The expected wall-clock is the failure-free time over the goodput.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 466, 54, 16384
DEFAULT_GPU_MTBF_HOURS = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS
DEFAULT_STORAGE_GBPS_PER_GPU = 2000 / LLAMA3_GPUS
CHECKPOINT_BYTES_PER_PARAM = 12
FAILURE_SOURCE = (
    "Llama 3 405B: 466 job interruptions in 54 days on 16,384 H100 GPUs (Dubey et al. 2024), applied per GPU"
)


@dataclass(frozen=True, kw_only=True)
class Reliability:
    checkpoint_bytes: float
    write_s: float
    cluster_mtbf_h: float
    interval_young_s: float
    interval_daly_s: float
    restart_s: float
    goodput: float
    failures_expected: float  # over the training run
    wall_days: float  # expected wall-clock days with failures, checkpoints and restarts: failure-free days / goodput
    failure_source: str

    def to_json(self) -> dict:
        return asdict(self)


def daly_interval(write_s: float, mtbf_s: float) -> float:
    if write_s >= 2 * mtbf_s:
        return mtbf_s
    r = write_s / (2 * mtbf_s)
    return math.sqrt(2 * write_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - write_s


def goodput(interval_s: float, write_s: float, restart_s: float, mtbf_s: float) -> float:
    return max(0.0, 1 - write_s / interval_s - (restart_s + interval_s / 2) / mtbf_s)


def reliability(
    params: float,
    gpus: int,
    train_seconds: float,
    storage_gbps_per_gpu: float | None = None,
    gpu_mtbf_hours: float | None = None,
    restart_minutes: float = 10.0,
) -> Reliability:
    bw = (storage_gbps_per_gpu or DEFAULT_STORAGE_GBPS_PER_GPU) * 1e9
    ckpt = CHECKPOINT_BYTES_PER_PARAM * params
    write_s = ckpt / gpus / bw
    mtbf_h = (gpu_mtbf_hours or DEFAULT_GPU_MTBF_HOURS) / gpus
    mtbf_s = mtbf_h * 3600
    restart_s = restart_minutes * 60
    tau = daly_interval(write_s, mtbf_s)
    good = goodput(tau, write_s, restart_s, mtbf_s)
    wall = train_seconds / good if good > 0 else math.inf
    source = FAILURE_SOURCE if gpu_mtbf_hours is None else f"cluster.gpu_mtbf_hours={gpu_mtbf_hours:g}"
    return Reliability(
        checkpoint_bytes=ckpt,
        write_s=write_s,
        cluster_mtbf_h=mtbf_h,
        interval_young_s=math.sqrt(2 * write_s * mtbf_s),
        interval_daly_s=tau,
        restart_s=restart_s,
        goodput=good,
        failures_expected=wall / mtbf_s,
        wall_days=wall / 86400,
        failure_source=source,
    )
