"""`flopwise scale optimal`: a compute budget (FLOPs, or device-hours at an MFU on a catalogue
device) allocated under each scaling law asked for, at each lifetime inference demand asked for
(priced by the serving plan), and a training TOML of the first allocation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from flopwise.errors import ConfigError
from flopwise.files.outputs import check_writable, write_text
from flopwise.hardware.catalogue import Hardware, get_hardware
from flopwise.plan.memory import model_state_bytes
from flopwise.scale.fit import fitted_law
from flopwise.scale.laws import Allocation, allocate, allocation_config
from flopwise.scale.lifetime import Lifetime, flops_per_device_hour, lifetime_allocations


@dataclass(frozen=True)
class Budget:
    flops: float
    allocations: list[Allocation]  # one per law (and demand), in the order asked
    lifetimes: list[Lifetime] = field(default_factory=list)  # with --inference-tokens: each one's life
    written: str | None = None  # with --out-config: what the file holds (devices, and why so many)


def budget_flops(flops: float | None, gpu_hours: float | None, hardware: str, mfu: float) -> float:
    """The budget in FLOPs: given, or `gpu_hours` at `mfu` of the device's 16-bit dense peak."""
    if (flops is None) == (gpu_hours is None):
        raise ConfigError("give exactly one of --flops or --gpu-hours (with --hardware and --mfu)")
    if gpu_hours is None:
        assert flops is not None  # exactly one given, checked above
        return flops
    if not (math.isfinite(gpu_hours) and gpu_hours > 0):
        raise ConfigError(f"--gpu-hours {gpu_hours:g}: expected a finite number of device-hours > 0")
    return gpu_hours * flops_per_device_hour(get_hardware(hardware, option="--hardware"), mfu, "--gpu-hours")


_MAX_DAYS = 30  # the wall-clock a default device count keeps a run under
_STATES_SHARE = 0.5  # of the devices' memory the sharded model states may take (the rest: activations)


def training_devices(a: Allocation, hw: Hardware, mfu: float) -> tuple[int, str]:
    """The devices a written config plans for, when --gpus is not given, and why: the fewest whole
    nodes (a power of two of them) that hold the model states (ZeRO-3 over all devices) in half their
    memory and train the allocation's FLOPs at `mfu` within _MAX_DAYS."""
    hours = a.flops / flops_per_device_hour(hw, mfu, "--out-config")
    per_node = hw.devices_per_node
    nodes = 1
    while True:
        gpus = nodes * per_node
        states = model_state_bytes(a.shape.params, zero=3, shard=gpus).total
        if states <= _STATES_SHARE * hw.memory_bytes and hours / gpus <= 24 * _MAX_DAYS:
            break
        nodes *= 2
    why = (
        f"the fewest nodes (a power of two) that hold the model states in half their memory and train in "
        f"{_MAX_DAYS} days or less"
    )
    return gpus, why


def optimal_allocations(
    flops: float | None,
    gpu_hours: float | None = None,
    hardware: str = "h100-sxm",
    mfu: float = 0.40,
    laws: list[str] | None = None,
    inference_tokens: list[float] | None = None,
    unique_tokens: float | None = None,
    vocab_size: int = 32000,
    seq_len: int = 4096,
    out_config: Path | None = None,
    serving: list[str] | None = None,
    gpus: int | None = None,
) -> Budget:
    """Model size, tokens, shape, batch and LR under each law (default: Chinchilla Approach 3);
    with `inference_tokens` (each a lifetime demand T), the allocation that trains and serves T
    for the fewest device-hours on `hardware` in the `serving` regime (serve.* keys);
    `out_config` (checked writable first) gets a training TOML of the first, planned for `gpus`
    devices of `hardware` (default: `training_devices`)."""
    if out_config:
        check_writable(out_config, "--out-config")
    if serving and not inference_tokens:
        raise ConfigError(f"{serving[0]}: the serving regime prices --inference-tokens; give --inference-tokens T")
    budget = budget_flops(flops, gpu_hours, hardware, mfu)
    names = laws or ["chinchilla-3"]
    lifetimes = []
    if inference_tokens:
        lifetimes = lifetime_allocations(
            budget, names, inference_tokens, unique_tokens, vocab_size, hardware, mfu, serving or []
        )
        allocs = [lt.allocation for lt in lifetimes]
    else:
        allocs = [allocate(budget, name, 0.0, unique_tokens, vocab_size, fitted_law(name)) for name in names]
    written = None
    if out_config:
        hw = get_hardware(hardware, option="--hardware")
        first = allocs[0]
        gpus, why = (gpus, "--gpus") if gpus else training_devices(first, hw, mfu)
        write_text(out_config, allocation_config(first, seq_len, vocab_size, hw.name, gpus), "--out-config")
        days = first.flops / flops_per_device_hour(hw, mfu, "--out-config") / gpus / 24
        written = (
            f"wrote {out_config}: {first.law} on {gpus} × {hw.name} ({why}; {days:,.1f} days at MFU {mfu:.0%}), "
            f"plan.tokens = {first.tokens:.3g}, the layout left to `flopwise plan {out_config}`"
        )
    return Budget(budget, allocs, lifetimes, written)
