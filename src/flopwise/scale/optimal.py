"""`flopwise scale optimal`: a compute budget (FLOPs, or device-hours at an MFU on a catalogue
device) allocated under each scaling law asked for, and a training TOML of the first allocation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from flopwise.errors import ConfigError
from flopwise.files.outputs import check_writable, write_text
from flopwise.hardware.catalogue import get_hardware
from flopwise.scale.fit import fitted_law
from flopwise.scale.laws import Allocation, allocate, allocation_config


@dataclass(frozen=True)
class Budget:
    flops: float
    allocations: list[Allocation]  # one per law, in the order asked


def budget_flops(flops: float | None, gpu_hours: float | None, hardware: str, mfu: float) -> float:
    """The budget in FLOPs: given, or `gpu_hours` at `mfu` of the device's 16-bit dense peak."""
    if (flops is None) == (gpu_hours is None):
        raise ConfigError("give exactly one of --flops or --gpu-hours (with --hardware and --mfu)")
    if gpu_hours is None:
        assert flops is not None  # exactly one given, checked above
        return flops
    if not (math.isfinite(gpu_hours) and gpu_hours > 0):
        raise ConfigError(f"--gpu-hours {gpu_hours:g}: expected a finite number of device-hours > 0")
    hw = get_hardware(hardware, option="--hardware")
    if not (peak := hw.peak_16bit):
        raise ConfigError(
            f"--hardware {hw.name}: no 16-bit dense peak in the catalogue to turn --gpu-hours into "
            "FLOPs; choose an accelerator (e.g. h100-sxm) or give --flops"
        )
    return gpu_hours * 3600 * peak * mfu


def optimal_allocations(
    flops: float | None,
    gpu_hours: float | None = None,
    hardware: str = "h100-sxm",
    mfu: float = 0.40,
    laws: list[str] | None = None,
    inference_tokens: float = 0.0,
    unique_tokens: float | None = None,
    vocab_size: int = 32000,
    seq_len: int = 4096,
    out_config: Path | None = None,
) -> Budget:
    """Model size, tokens, shape, batch and LR under each law (default: Chinchilla Approach 3);
    `out_config` (checked writable first) gets a training TOML of the first."""
    if out_config:
        check_writable(out_config, "--out-config")
    budget = budget_flops(flops, gpu_hours, hardware, mfu)
    allocs = [
        allocate(budget, name, inference_tokens, unique_tokens, vocab_size, fitted_law(name))
        for name in laws or ["chinchilla-3"]
    ]
    if out_config:
        write_text(out_config, allocation_config(allocs[0], seq_len), "--out-config")
    return Budget(budget, allocs)
