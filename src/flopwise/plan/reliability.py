"""Checkpoint cost, failure rate, checkpoint interval and goodput of a planned run. Pure Python.

- Checkpoint bytes: what flopwise's DCP checkpoint holds, fp32 weights + Adam m and v = 12 bytes
  per parameter (the 16-bit compute copy is re-derived on load); each device writes and reads its
  share (bytes / devices).
- Write time δ, the first source found: `cluster.storage_gbps_per_gpu`; the hardware entry's
  measured recovery (`flopwise hardware calibrate`: a fixed cost plus bytes at the rate one process
  wrote here, flopwise.recovery; devices that share a disk each get less); else 0.122 GB/s per GPU
  = the 2 TB/s sustained Llama 3 reported for Tectonic over 16,384 GPUs (Dubey et al. 2024 §3.3.1).
- Restart time R: `cluster.restart_minutes`; the measured recovery (a process's start, imports,
  build and its share of the checkpoint read at the measured rate; without failure detection and
  the launcher's rendezvous, which a real restart adds); else 10 minutes, assumed.
- Failures: default per-GPU MTBF 45,569 h, from Llama 3 405B's 466 job interruptions in 54 days
  on 16,384 H100s (Dubey et al. 2024 §3.3.4, Table 5); we apply it to any GPU unless
  `cluster.gpu_mtbf_hours` is set, and say so in the output. A cluster of n devices fails n times
  as often.
- Interval: Young 1974, τ = √(2δM); Daly 2006's higher-order form
  τ = √(2δM)·(1 + ⅓√(δ/2M) + δ/(18M)) − δ for δ < 2M, else M.
- Goodput, the share of wall time doing new work: Daly 2006 ("A higher order estimate of the
  optimum checkpoint interval for restart dumps", FGCS 22, §3), failures a Poisson process of mean
  gap M in wall time that strikes during work, writes and restarts alike. An interval of τ of work
  and its write δ then takes M·e^{R/M}·(e^{(τ+δ)/M} − 1) of wall time on average, so goodput is τ
  over that. Expanded for τ, δ, R ≪ M it is 1 − δ/τ − (R + τ/2)/M: each interval pays a write,
  each failure a restart and half an interval redone. That first-order form was this planner's
  until a measured run with R = 0.8·M (benchmarks/RESULTS.md): there it predicted nearly nothing,
  where failures striking restarts and the exponential's tail are what matter. The Daly interval
  is (nearly) the maximum of the exact form; R scales the cost, it does not move the optimum.
  Expected wall-clock = failure-free time / goodput; expected failures = wall-clock / M.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from flopwise.recovery import Recovery

LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 466, 54, 16384
DEFAULT_GPU_MTBF_HOURS = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS
DEFAULT_STORAGE_GBPS_PER_GPU = 2000 / LLAMA3_GPUS
DEFAULT_RESTART_MINUTES = 10.0
CHECKPOINT_BYTES_PER_PARAM = 12
FAILURE_SOURCE = (
    "Llama 3 405B: 466 job interruptions in 54 days on 16,384 H100 GPUs (Dubey et al. 2024), applied per GPU"
)
WRITE_SOURCE = "Llama 3's 2 TB/s over 16,384 GPUs (Dubey et al. 2024), per GPU"
RESTART_SOURCE = f"{DEFAULT_RESTART_MINUTES:g} min, assumed"


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
    write_source: str  # where write_s came from: a config key, a measurement on a machine, or Llama 3's storage
    restart_source: str

    def to_json(self) -> dict:
        return asdict(self)


def daly_interval(write_s: float, mtbf_s: float) -> float:
    if write_s >= 2 * mtbf_s:
        return mtbf_s
    r = write_s / (2 * mtbf_s)
    return math.sqrt(2 * write_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - write_s


def goodput(interval_s: float, write_s: float, restart_s: float, mtbf_s: float) -> float:
    """Expected share of wall time doing new work with `interval_s` of work between writes (Daly 2006,
    see the module docstring): τ / (M·e^{R/M}·(e^{(τ+δ)/M} − 1))."""
    if math.isinf(mtbf_s):  # no failures: the writes alone
        return interval_s / (interval_s + write_s) if interval_s > 0 else 0.0
    x, r = (interval_s + write_s) / mtbf_s, restart_s / mtbf_s
    if x + r > 700:  # e^700 ~ 1e304: nothing gets done, and the exponentials would overflow
        return 0.0
    return interval_s / (mtbf_s * math.exp(r) * math.expm1(x)) if x > 0 else 0.0


def reliability(
    params: float,
    gpus: int,
    train_seconds: float,
    storage_gbps_per_gpu: float | None = None,
    gpu_mtbf_hours: float | None = None,
    restart_minutes: float | None = None,
    measured: Recovery | None = None,
) -> Reliability:
    """The reliability account of a run of `train_seconds` failure-free on `gpus` devices; the write
    and restart times from the config's keys, else from `measured` (the hardware entry's recovery
    measurement), else from the constants, each source named."""
    ckpt = CHECKPOINT_BYTES_PER_PARAM * params
    share = ckpt / gpus
    if storage_gbps_per_gpu is not None:
        write_s, write_source = (
            share / (storage_gbps_per_gpu * 1e9),
            f"cluster.storage_gbps_per_gpu={storage_gbps_per_gpu:g}",
        )
    elif measured is not None:
        write_s = measured.write_seconds(share)
        write_source = (
            f"measured: {measured.write_latency_s:.3g} s + {measured.write_bytes_per_s / 1e9:.3g} GB/s per device "
            f"({measured.source})"
        )
    else:
        write_s, write_source = share / (DEFAULT_STORAGE_GBPS_PER_GPU * 1e9), WRITE_SOURCE
    if restart_minutes is not None:
        restart_s, restart_source = restart_minutes * 60, f"cluster.restart_minutes={restart_minutes:g}"
    elif measured is not None:
        restart_s = measured.restart_seconds(share)
        restart_source = (
            f"measured: {measured.restart_fixed_s:.3g} s + a read at {measured.read_bytes_per_s / 1e9:.3g} GB/s per "
            f"device, without failure detection and rendezvous ({measured.source})"
        )
    else:
        restart_s, restart_source = DEFAULT_RESTART_MINUTES * 60, RESTART_SOURCE
    mtbf_h = (gpu_mtbf_hours or DEFAULT_GPU_MTBF_HOURS) / gpus
    mtbf_s = mtbf_h * 3600
    tau = daly_interval(write_s, mtbf_s)
    good = goodput(tau, write_s, restart_s, mtbf_s)
    wall = train_seconds / good if good > 0 else math.inf
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
        failure_source=FAILURE_SOURCE if gpu_mtbf_hours is None else f"cluster.gpu_mtbf_hours={gpu_mtbf_hours:g}",
        write_source=write_source,
        restart_source=restart_source,
    )
