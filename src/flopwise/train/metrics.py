"""Metrics: the device peak the MFU is measured against, metrics.jsonl, TensorBoard, the loss plot."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flopwise.errors import ConfigError
from flopwise.files import rundir
from flopwise.files.outputs import png_bytes, pyplot, read_records
from flopwise.hardware.catalogue import Hardware, identify_gpu

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# Square products big enough to saturate the device: a CPU peaks by 1-2K, an H200 needs 8K (1-2K
# products reach under half its 989 TFLOP/s, which made MFU read 2.2x too high there).
_CEILING_SIZES = {"cpu": (512, 1024, 2048), "cuda": (8192,)}


def measure_matmul_peak(
    dtype: str, device: torch.device, sizes: tuple[int, ...] | None = None, repeats: int = 5, budget_s: float = 5.0
) -> float:
    """Best FLOP/s of square matmuls on this device over `sizes` and `repeats`: a ceiling measured
    in the training dtype with this process's threads. Once `budget_s` is spent no further product is
    timed (each size gets one): bf16 on a CPU without bf16 instructions took 5.5 minutes over all of
    them (2026-12-07, an AVX2 EPYC, where the 512s already showed its 1 GFLOP/s); 1-3 s elsewhere."""
    best, start = 0.0, time.perf_counter()
    for n in sizes or _CEILING_SIZES.get(device.type, _CEILING_SIZES["cpu"]):
        if best and time.perf_counter() - start > budget_s:
            break
        # constant operands, not randn: the global RNG is training state (restored on resume)
        a = torch.full((n, n), 0.5, device=device, dtype=DTYPES[dtype])
        b = torch.full((n, n), 0.25, device=device, dtype=DTYPES[dtype])
        a @ b  # warm-up
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = max(best, 2 * n**3 / (time.perf_counter() - t0))
            if time.perf_counter() - start > budget_s:
                break
        del a, b
    return best


# A CPU's ceilings by (machine, threads, torch, dtype): timing the products costs 1-3 s, which every
# process a run starts (each torchrun rank, each restart, a sweep's runs) would otherwise spend again
# on the same CPU. Kept in this process and in ceilings_file() for the processes after it; raised, in
# both, when a re-measurement (checked_peak: a step beat it) finds more.
_cpu_ceilings: dict[str, float] = {}


def ceilings_file() -> Path:
    """FLOPWISE_CACHE_DIR, else $XDG_CACHE_HOME/flopwise, else ~/.cache/flopwise: cpu-ceilings.json."""
    base = os.environ.get("FLOPWISE_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "flopwise"
    )
    return Path(base) / "cpu-ceilings.json"


def _cpu_key(dtype: str) -> str:
    """What a ceiling depends on: the CPU, its cores, this process's threads, torch's kernels, the dtype."""
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), name)
    return f"{name} | {os.cpu_count()} cores | {torch.get_num_threads()} threads | torch {torch.__version__} | {dtype}"


def _stored_ceilings() -> dict[str, float]:
    """The file's ceilings; an unreadable or malformed file is no ceilings (they are measured again)."""
    try:
        raw = json.loads(ceilings_file().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {k: float(v) for k, v in raw.items() if isinstance(v, int | float) and 0 < v < math.inf}


def _keep_ceiling(key: str, flops: float) -> float:
    """`flops` or the larger ceiling already kept for `key`, kept in this process and the file (by a
    rename of a fresh file, so a reader never sees half of one). A file that cannot be written costs
    the next process one measurement, nothing else: that error is not the run's."""
    best = _cpu_ceilings[key] = max(flops, _cpu_ceilings.get(key, 0.0))
    path = ceilings_file()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        stored = _stored_ceilings()
        if stored.get(key, 0.0) < best:
            with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
                tmp = Path(f.name)
                json.dump({**stored, key: best}, f, indent=1, sort_keys=True)
            try:
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
    return best


def _cpu_ceiling(dtype: str) -> float:
    key = _cpu_key(dtype)
    if key not in _cpu_ceilings:
        stored = _stored_ceilings().get(key)
        _cpu_ceilings[key] = stored or _keep_ceiling(key, measure_matmul_peak(dtype, torch.device("cpu")))
    return _cpu_ceilings[key]


@dataclass(frozen=True)
class Peak:
    """The per-device FLOP/s MFU divides by, and where it came from (printed and logged beside MFU)."""

    flops: float
    source: str
    measured: bool  # a ceiling timed here (re-measured if a step beats it), not a catalogue figure


def device_peak(catalogue: dict[str, Hardware], dtype: str, device: torch.device) -> Peak:
    """A GPU identified by its driver name gets the catalogue's dense peak for `dtype`; a CPU, or a
    GPU the catalogue does not know, a ceiling measured here (a CPU's once per machine, thread count
    and torch: see ceilings_file)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        what = f"{props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB"
        entry = identify_gpu(props.name, props.total_memory)
        peak = catalogue[entry].peak(dtype) if entry in catalogue else None
        if peak:
            return Peak(peak, f"{entry} {dtype} dense peak, catalogue ({what})", False)
        return Peak(
            measure_matmul_peak(dtype, device, repeats=10),
            f"measured {dtype} matmul ceiling: {what} is not in the catalogue",
            True,
        )
    # named with where it is kept: every run on this machine divides by the same figure, so their MFUs compare
    where = f"measured {dtype} matmul ceiling on this {device.type}, once per machine: {ceilings_file()}"
    return Peak(_cpu_ceiling(dtype), where, True)


def mfu_basis(dtype: str, float8: str) -> str | None:
    """What MFU divides by when the blocks' linears run in float8 (None otherwise): still model
    FLOPs over the train.dtype peak, so runs with and without float8 compare; the float8 matmuls'
    own peak is twice that, so MFU here measures the speed-up, not how busy the float8 units are."""
    return None if float8 == "none" else f"{dtype} dense peak (float8 {float8} linears)"


def checked_peak(peak: Peak, achieved: float, dtype: str, device: torch.device, tries: int = 3) -> Peak:
    """`peak` again, or a re-measured ceiling when a step's achieved model FLOP/s per device reached
    a measured one (it was timed while something else used the machine): the best of up to `tries`
    measurements and the old figure. A catalogue peak is never re-measured."""
    if not peak.measured or achieved < peak.flops:
        return peak
    best = peak.flops
    for _ in range(tries):
        best = max(best, measure_matmul_peak(dtype, device, repeats=10))
        if best > achieved:
            break
    if device.type == "cpu":  # the runs this process and the processes after it start divide by it too
        best = _keep_ceiling(_cpu_key(dtype), best)
    return Peak(best, peak.source, True)


def check_tensorboard(enabled: bool) -> None:
    """log.tensorboard needs the tensorboard package (an extra): say so before the run folder is made."""
    if not enabled:
        return
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError(
            "log.tensorboard=true needs tensorboard: pip install 'flopwise[tensorboard]' (or set log.tensorboard=false)"
        ) from None


class MetricsWriter:
    """Appends one JSON object per record to metrics.jsonl; mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool, enabled: bool = True):
        self.enabled = enabled
        self.run_dir = run_dir
        self.tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        rundir.append(self.run_dir, "metrics.jsonl", (json.dumps(record) + "\n").encode())
        if self.tb is not None:
            prefix = f"{record['task']}/" if "task" in record else ""
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(prefix + k, v, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def plot_loss_curve(metrics_path: Path, title: str = "") -> bytes:
    """The loss curve of a metrics file, as PNG bytes (the run folder's writer stores them)."""
    plt = pyplot()

    records = read_records(metrics_path)
    records = [r for r in records if isinstance(r.get("step"), (int, float))]  # not a note the user added
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:  # a single point is a marker (a line through one point draws nothing)
        ax.plot(*zip(*train, strict=True), "o" if len(train) == 1 else "-", label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="val loss", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = png_bytes(fig)
    plt.close(fig)
    return png
