"""Checkpoint cost, failure rate, checkpoint interval and goodput: predicted for a plan, and
measured from a run that failed. Pure Python.

- Checkpoint bytes: what flopwise's DCP checkpoint holds, fp32 weights + Adam m and v = 12 bytes
  per parameter (the 16-bit compute copy is re-derived on load); each device writes and reads its
  share (bytes / devices).
- Write time δ, the first source found: `cluster.storage_gbps_per_gpu`; the hardware entry's
  measured recovery (`flopwise hardware calibrate`: a fixed cost plus bytes at the rate one process
  wrote here, flopwise.hardware.restart_costs; devices that share a disk each get less); else 0.122 GB/s per GPU
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
  until a measured run with R = 0.8·M (benchmarks/long/goodput.md): there it predicted nearly nothing,
  where failures striking restarts and the exponential's tail are what matter. The Daly interval
  is (nearly) the maximum of the exact form; R scales the cost, it does not move the optimum.
  Expected wall-clock = failure-free time / goodput; expected failures = wall-clock / M.
- Measured goodput (`account`): from the times a run logged each step and the times its failures
  struck, wall time split into productive steps, lost work, restarts and checkpoint stalls.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise

from flopwise.hardware.restart_costs import Recovery

LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 466, 54, 16384
DEFAULT_GPU_MTBF_HOURS = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS
_DEFAULT_STORAGE_GBPS_PER_GPU = 2000 / LLAMA3_GPUS
_DEFAULT_RESTART_MINUTES = 10.0
CHECKPOINT_BYTES_PER_PARAM = 12
_FAILURE_SOURCE = (
    "Llama 3 405B: 466 job interruptions in 54 days on 16,384 H100 GPUs (Dubey et al. 2024), applied per GPU"
)
_WRITE_SOURCE = "Llama 3's 2 TB/s over 16,384 GPUs (Dubey et al. 2024), per GPU"
_RESTART_SOURCE = f"{_DEFAULT_RESTART_MINUTES:g} min, assumed"
Line = tuple[float, int]  # (time in seconds, step) of one logged step


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


def predict_reliability(
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
        write_s, write_source = share / (_DEFAULT_STORAGE_GBPS_PER_GPU * 1e9), _WRITE_SOURCE
    if restart_minutes is not None:
        restart_s, restart_source = restart_minutes * 60, f"cluster.restart_minutes={restart_minutes:g}"
    elif measured is not None:
        restart_s = measured.restart_seconds(share)
        restart_source = (
            f"measured: {measured.restart_fixed_s:.3g} s + a read at {measured.read_bytes_per_s / 1e9:.3g} GB/s per "
            f"device, without failure detection and rendezvous ({measured.source})"
        )
    else:
        restart_s, restart_source = _DEFAULT_RESTART_MINUTES * 60, _RESTART_SOURCE
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
        failure_source=_FAILURE_SOURCE if gpu_mtbf_hours is None else f"cluster.gpu_mtbf_hours={gpu_mtbf_hours:g}",
        write_source=write_source,
        restart_source=restart_source,
    )


@dataclass(frozen=True, kw_only=True)
class Account:
    """Where a failing run's wall time went (seconds), and the times the model needs, measured."""

    wall_s: float  # first logged step's start to the last step's log line
    step_s: float  # median step (consecutive lines, no failure between, no save)
    stall_s: float  # median checkpoint stall: a step followed by a save, less a step
    restart_s: float | None  # mean restart no failure cut short: last failure to the next step, less it (None: none)
    failures: int
    productive_s: float  # each step reached for the first time × step_s
    lost_s: float  # steps run again × step_s, plus the work (or write) under way when a failure struck
    stalls_s: float  # saves completed × stall_s
    restarts_s: float  # from each failure to the next logged step, less that step

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s

    @property
    def unaccounted_s(self) -> float:
        """Wall time no part holds: the parts are counts × medians, so step-time jitter, nothing else."""
        return self.wall_s - self.productive_s - self.lost_s - self.stalls_s - self.restarts_s

    def predicted(self, interval_steps: int, mtbf_s: float) -> float:
        """The planner's goodput fed this run's own step, write and restart times."""
        if self.restart_s is None:
            raise ValueError("no failure was followed by a logged step: the run measured no restart time")
        return goodput(interval_steps * self.step_s, self.stall_s, self.restart_s, mtbf_s)

    def to_json(self) -> dict:
        return {**asdict(self), "goodput": self.goodput, "unaccounted_s": self.unaccounted_s}


def measured_account(lines: Sequence[Line], kills: Sequence[float], interval: int) -> Account:
    """Measured goodput of a run that saved every `interval` steps, from the (time, step) of each
    logged step (every step logged, a save after the line of each multiple of `interval`) and the
    times failures struck. Step and stall times are the run's own medians, so a machine whose speed
    drifts between runs is measured as it was during this one; a failure's restart is timed from the
    failure itself, so the parts are measured independently and their sum checks the wall time."""
    segments = list(pairwise(lines))
    hits = _restart_segments(segments, kills)
    plain: list[float] = []
    saved: list[float] = []
    for i, ((t0, a), (t1, b)) in enumerate(segments):
        if b == a + 1 and i not in hits and not any(t0 < k < t1 for k in kills):
            (saved if a % interval == 0 else plain).append(t1 - t0)
    if not plain:
        raise ValueError("no two consecutive steps without a failure or a save between them: too short to measure")
    step = statistics.median(plain)
    stall = max(0.0, statistics.median(saved) - step) if saved else 0.0
    productive, lost, stalls, restarts, whole = step, 0.0, 0.0, 0.0, []
    reached = lines[0][1]
    for i, ((t0, a), (t1, b)) in enumerate(segments):
        if i in hits:
            first, last = max(hits[i][0], t0), max(hits[i][-1], t0)
            lost += first - t0  # the work (or write) under way
            restarts += t1 - first - step  # restarts, and any a later failure cut short
            whole.append(t1 - last - step)  # the restart after the last failure ran to its end
        elif a % interval == 0:
            stalls += stall
        if b > reached:
            productive, reached = productive + step, b
        else:
            lost += step
    return Account(
        wall_s=lines[-1][0] - lines[0][0] + step,
        step_s=step,
        stall_s=stall,
        restart_s=statistics.fmean(whole) if whole else None,
        failures=sum(len(h) for h in hits.values()),
        productive_s=productive,
        lost_s=lost,
        stalls_s=stalls,
        restarts_s=restarts,
    )


def _restart_segments(segments: list[tuple[Line, Line]], kills: Sequence[float]) -> dict[int, list[float]]:
    """{index of the segment between two logged steps that holds the restart: the failures in it}.
    Usually the segment a failure falls in; but a rank that survives can still log the step its dead
    peer had finished its part of, just after the failure: then the restart is the next segment, the
    one where the logged step goes back to the checkpoint's (and which holds no failure of its own)."""

    def back(i: int) -> bool:
        (_, a), (_, b) = segments[i]
        return b <= a

    def holds(i: int) -> bool:
        (t0, _), (t1, _) = segments[i]
        return any(t0 < k <= t1 for k in kills)

    hits: dict[int, list[float]] = {}
    for k in sorted(kills):
        i = next((i for i, ((t0, _), (t1, _)) in enumerate(segments) if t0 < k <= t1), None)
        if i is None:  # before the first logged step or after the last
            continue
        if not back(i) and i + 1 < len(segments) and back(i + 1) and not holds(i + 1):
            i += 1
        hits.setdefault(i, []).append(k)
    return hits
