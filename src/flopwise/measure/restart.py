"""`flopwise hardware calibrate`'s recovery measurements: what a checkpoint save blocks a process and
what a restart costs on this machine, for the planner's reliability account (flopwise.hardware.restart_costs).

    parent:  measure_recovery(cfg, device, progress) -> Recovery
    child:   python -c PROBE_SCRIPT CONFIG.toml CHECKPOINT DEVICE   (one restart)

Write: flopwise's own save (checkpoints.checkpoint.save: DCP files, state, sha256 manifest, fsync,
rename), in one process, of a tiny model (its fixed cost) and of the config's model with its AdamW
state (the 12 bytes per parameter the planner counts), median of 3 each; the two points give a
fixed cost and a rate. Written under the system's temporary folder: set TMPDIR to the checkpoint
storage to measure that (the source says which folder was written).
Restart: a new Python process that imports what `python -m flopwise` imports and torch, builds the
config's model and optimizer on the device and loads that checkpoint, timed from its launch to the
end of the load (the faster of two: the first may pay cold file caches that a job restarted on the
same node does not); its own load time gives the read rate, the rest is the fixed part.
A real restart also detects the failure and meets its peers again (rendezvous): not in this.
It costs seconds, mostly the restarts (Python and torch start slowly on a small CPU), against the
minutes of the rest of calibrate (the figures: benchmarks/long/goodput.md).
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

from flopwise.checkpoints import checkpoint
from flopwise.config.schema import Config, load_config, to_toml
from flopwise.errors import FlopwiseError
from flopwise.hardware.restart_costs import Recovery
from flopwise.model.transformer import build_model
from flopwise.train.optim import build_optimizer

REPEATS = 3  # saves of each size
_RESTARTS = 2
_TINY_FEATURES = 64  # a 64 × 64 linear layer: 4,096 parameters, a save that is all fixed cost
_READY = "restart-probe loaded in"
# the child imports the CLI first, as `python -m flopwise train` does (its cost is the restart's); a
# program of its own, so that this module, which the CLI imports, does not import the CLI back
_PROBE_SCRIPT = (
    "import sys, flopwise.cli; from flopwise.measure.restart import restart_probe; restart_probe(*sys.argv[1:])"
)


def _save_seconds(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, int, Path]:
    """(median seconds, bytes written, the last checkpoint's folder) of REPEATS saves."""
    times, path = [], root
    for i in range(REPEATS):
        t0 = time.perf_counter()
        path = checkpoint.save(root, i + 1, model, optimizer, {}, keep=None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), sum(p.stat().st_size for p in path.iterdir()), path


def _restart_seconds(config: Path, ckpt: Path, device: torch.device) -> tuple[float, float]:
    """(launch to loaded, the load alone) of one child process, in seconds."""
    cmd = [sys.executable, "-c", _PROBE_SCRIPT, str(config), str(ckpt), str(device)]
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None  # piped above
        for line in proc.stdout:
            if line.startswith(_READY):
                total = time.perf_counter() - t0
                proc.wait()
                return total, float(line.split()[-1])
        tail = (proc.stderr.read().strip().splitlines() or ["no output"])[-1][:300]
    raise FlopwiseError(f"the restart probe failed (exit {proc.returncode}): {tail}")


def fit(small: tuple[float, int], large: tuple[float, int]) -> tuple[float, float]:
    """(fixed seconds, bytes per second) through two (seconds, bytes) points. A large save no slower
    than the small one (timing noise) bounds the rate at 10x its own average rather than infinity."""
    (t1, b1), (t2, b2) = small, large
    per_byte = max((t2 - t1) / (b2 - b1), 0.1 * t2 / b2)
    return max(0.0, t2 - per_byte * b2), 1 / per_byte


def measure_recovery(cfg: Config, device: torch.device, progress: Callable[[str], None]) -> Recovery:
    """The write and restart costs of `cfg`'s model on `device` (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="flopwise-calibrate-") as tmp:
        root = Path(tmp)
        tiny = torch.nn.Linear(_TINY_FEATURES, _TINY_FEATURES, bias=False, device=device)
        t_tiny, b_tiny, _ = _save_seconds(root / "tiny", tiny, build_optimizer(tiny, cfg.optim))
        model = build_model(cfg.model, device)
        params = sum(p.numel() for p in model.parameters())
        t_model, b_model, ckpt = _save_seconds(root / "model", model, build_optimizer(model, cfg.optim))
        write_latency, write_rate = fit((t_tiny, b_tiny), (t_model, b_model))
        progress(f"checkpoint write: {write_latency:.3g} s + {write_rate / 1e9:.3g} GB/s")
        del model
        config = root / "config.toml"
        config.write_text(to_toml(cfg))
        total, load = min(_restart_seconds(config, ckpt, device) for _ in range(_RESTARTS))
        progress(f"restart: {total:.3g} s")
    return Recovery(
        write_latency_s=round(write_latency, 4),
        write_bytes_per_s=round(write_rate),
        restart_fixed_s=round(max(0.0, total - load), 3),
        read_bytes_per_s=round(b_model / max(load, 1e-6)),
        source=f"flopwise hardware calibrate on {platform.node()} at {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, "
        f"a {params / 1e6:.3g}M-parameter model on {device.type}, written under {tempfile.gettempdir()}",
    )


def restart_probe(config: str, ckpt: str, device: str) -> None:
    """One restart: the model and optimizer built on `device`, the checkpoint loaded into them."""
    cfg = load_config(config)
    model = build_model(cfg.model, device)
    optimizer = build_optimizer(model, cfg.optim)
    t0 = time.perf_counter()
    checkpoint.load(Path(ckpt), model, optimizer)
    print(f"{_READY} {time.perf_counter() - t0!r}", flush=True)
