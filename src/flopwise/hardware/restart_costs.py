"""What recovering from a failure costs on one machine, as `flopwise hardware calibrate` measured it
(flopwise.measure.restart); the planner's reliability account reads it. Pure Python.

A hardware entry's `[NAME.recovery]` table:
- write_latency_s, write_bytes_per_s: one process's checkpoint save (flopwise's own: DCP files,
  state, sha256 manifest, fsync, rename) as a fixed cost plus bytes at a rate, fitted to a tiny
  save and one of a model with its AdamW state. Two numbers, not one bandwidth: a small save is
  almost all fixed cost, so its bytes per second would make a large model's write look hours long;
- restart_fixed_s, read_bytes_per_s: a new process's start, imports, model and optimizer build
  (the fixed part) and its checkpoint load (bytes at a rate), from a subprocess that restarts from
  that save. Not in it: detecting the failure and the launcher's rendezvous, which a real restart
  adds (benchmarks/long/goodput.py measures the whole of it under torchrun);
- source: where and when, and the folder whose file system was written.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from flopwise.errors import ConfigError
from flopwise.hardware.calibration import positive_number


@dataclass(frozen=True, kw_only=True)
class Recovery:
    write_latency_s: float
    write_bytes_per_s: float
    restart_fixed_s: float
    read_bytes_per_s: float
    source: str = ""

    def write_seconds(self, nbytes: float) -> float:
        """What saving `nbytes` blocks one process."""
        return self.write_latency_s + nbytes / self.write_bytes_per_s

    def restart_seconds(self, nbytes: float) -> float:
        """From a new process to training again with `nbytes` of checkpoint loaded."""
        return self.restart_fixed_s + nbytes / self.read_bytes_per_s


_RECOVERY_FIELDS = ("write_latency_s", "write_bytes_per_s", "restart_fixed_s", "read_bytes_per_s")


def parse_recovery(where: str, data) -> Recovery:
    """A recovery table from a hardware TOML's `[NAME.recovery]`, every field checked."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a table is needed")
    extra = set(data) - {*_RECOVERY_FIELDS, "source"}
    if extra:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(sorted(extra))} (known: {', '.join(_RECOVERY_FIELDS)}, source)"
        )
    for key in _RECOVERY_FIELDS:
        value = data.get(key)
        zero_ok = key in ("write_latency_s", "restart_fixed_s")
        if not (positive_number(value) or (zero_ok and value == 0 and not isinstance(value, bool))):
            raise ConfigError(
                f"{where}.{key}: a {'non-negative' if zero_ok else 'positive'} number is needed, got {value!r} "
                "(run `flopwise hardware calibrate` again)"
            )
    return Recovery(**{k: float(data[k]) for k in _RECOVERY_FIELDS}, source=str(data.get("source", "")))


def recovery_toml(r: Recovery) -> dict:
    """The TOML table of a recovery measurement (the inverse of parse_recovery)."""
    return asdict(r)
