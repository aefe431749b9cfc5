"""Metrics: the device peak the MFU is measured against, metrics.jsonl, TensorBoard, the loss plot."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from flopwise.hardware import Hardware

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def measure_matmul_peak(dtype: str, device: torch.device, sizes=(1024, 2048), repeats: int = 5) -> float:
    """Best FLOP/s of square matmuls on this device: the 'measured ceiling' MFU is reported against."""
    best = 0.0
    for n in sizes:  # constant operands, not randn: the global RNG is training state (restored on resume)
        a = torch.full((n, n), 0.5, device=device, dtype=DTYPES[dtype])
        b = torch.full((n, n), 0.25, device=device, dtype=DTYPES[dtype])
        a @ b  # warm-up
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def device_peak(hw: Hardware, dtype: str, device: torch.device) -> tuple[float, str]:
    """(peak FLOP/s, where it came from): the catalogue for a named accelerator, else measured."""
    peak = hw.peak(dtype)
    if peak and device.type != "cpu":
        return peak, f"{hw.name} {dtype} dense peak (catalogue)"
    return measure_matmul_peak(dtype, device), f"measured {dtype} matmul ceiling on this {device.type}"


class MetricsWriter:
    """Appends one JSON object per record to metrics.jsonl; mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool, enabled: bool = True):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            prefix = f"{record['task']}/" if "task" in record else ""
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(prefix + k, v, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss_curve(metrics_path: Path, out_png: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="val loss", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png
