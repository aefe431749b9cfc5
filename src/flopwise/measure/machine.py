"""`flopwise hardware calibrate`'s choices made: the device and the ranks its options ask for, the
config whose shapes are measured, then the calibration written into a hardware file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from flopwise.errors import FlopwiseError
from flopwise.files.outputs import check_writable
from flopwise.hardware.catalogue import Hardware
from flopwise.measure.calibrate import (
    Progress,
    calibrate_device,
    calibration_config,
    require_native_dtype,
    save_hardware,
)


def calibration_device(device: str) -> torch.device:
    """`--device` cpu, cuda or auto (CUDA where there is one)."""
    if device not in ("auto", "cpu", "cuda"):
        raise FlopwiseError(f"--device {device}: choose cpu, cuda or auto")
    if device == "cuda" and not torch.cuda.is_available():
        raise FlopwiseError("--device cuda: no CUDA device here; use --device cpu")
    return torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")


def calibrate_machine(
    path: str,
    overrides: list[str],
    out: Path,
    nproc: int | None = None,
    device: str = "auto",
    on_start: Callable[[], None] = lambda: None,
    progress: Progress = lambda what: None,
    total: Callable[[int], object] = lambda n: None,
) -> Hardware:
    """Measure this machine on the config's shapes and write its entry into `out` (checked writable
    first). `nproc`: ranks for the collectives (default: 2 on a CPU, every GPU on CUDA). `on_start`
    is called once everything is accepted, just before the first measurement."""
    check_writable(out, "--out")
    dev = calibration_device(device)
    ranks = nproc or (torch.cuda.device_count() if dev.type == "cuda" else 2)
    cfg = calibration_config(path, overrides, dev)
    require_native_dtype(cfg.train.dtype, dev)
    on_start()
    hw = calibrate_device(cfg, dev, ranks, progress, total)
    save_hardware(hw, out)
    return hw
