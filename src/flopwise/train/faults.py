"""Deterministic fault injection, for the reliability tests and for rehearsing a cluster's runbook.

    FLOPWISE_FAULTS="kill:step=4:rank=1, nan_grad:step=5, enospc:save=2"

Each fault is `kind:key=value:...`. Where: `step=N` (during step N, 1-based, after its forward and
backward) or `save=N` (during this process's N-th checkpoint write). `rank=R` limits it to one rank
(default: all); `attempt=A` to one torchrun attempt (TORCHELASTIC_RESTART_COUNT, default 0), so a
restarted job does not fail again in the same place. Each fault fires once. Kinds:

  kill      SIGKILL this process (a node or GPU dying)        sigterm   SIGTERM to itself (preemption)
  hang      block forever (a stuck rank or collective)        slow      sleep `seconds` (a straggler)
  sigint    SIGINT to itself (Ctrl-C)                         sighup    SIGHUP to itself (a closed ssh session)
  nan_grad  a NaN in one gradient                             poison    replace the batch by random tokens
  enospc    the checkpoint write fails with "No space left on device"

Unset, nothing here runs: production code asks `at(...)` and gets False.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor

from flopwise.errors import ConfigError

KINDS = ("kill", "sigterm", "sigint", "sighup", "hang", "slow", "nan_grad", "poison", "enospc")
ENV = "FLOPWISE_FAULTS"


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int | None = None
    save: int | None = None
    rank: int | None = None
    attempt: int = 0
    seconds: float = 1.0


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, *pairs = item.split(":")
        if kind not in KINDS:
            raise ConfigError(f"{ENV}: unknown fault {kind!r} (allowed: {', '.join(KINDS)})")
        kw: dict = {}
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key not in ("step", "save", "rank", "attempt", "seconds") or not value:
                raise ConfigError(f"{ENV}: {item!r}: expected step=N, save=N, rank=R, attempt=A or seconds=S")
            try:
                kw[key] = float(value) if key == "seconds" else int(value)
            except ValueError:
                raise ConfigError(f"{ENV}: {item!r}: {key} must be a number") from None
        if (kw.get("step") is None) == (kw.get("save") is None):
            raise ConfigError(f"{ENV}: {item!r}: give exactly one of step=N or save=N")
        faults.append(Fault(kind, **kw))
    return faults


@dataclass
class Faults:
    """The faults that apply to this rank and attempt."""

    faults: list[Fault] = field(default_factory=list)
    saves: int = 0

    @classmethod
    def from_env(cls, rank: int) -> Faults:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return cls([f for f in parse(os.environ.get(ENV, "")) if f.attempt == attempt and f.rank in (None, rank)])

    def at(self, kind: str, step: int) -> bool:
        """Whether a data fault hits step `step`; each fires once (a rolled-back run meets new data)."""
        hit = [f for f in self.faults if f.kind == kind and f.step == step]
        self.faults = [f for f in self.faults if f not in hit]
        return bool(hit)

    def fire(self, step: int) -> None:
        """The process-level faults of step `step`."""
        for f in [f for f in self.faults if f.step == step and f.kind not in ("poison", "nan_grad")]:
            self.faults.remove(f)
            _process_fault(f)

    def writer(self, path: Path) -> FileSystemWriter:
        """DCP's file writer, failing inside the write of the save numbered in a save=N fault."""
        self.saves += 1
        due = [f for f in self.faults if f.save == self.saves]
        return _FaultyWriter(path, due) if due else FileSystemWriter(path)


def _process_fault(f: Fault) -> None:
    if f.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif f.kind in ("sigterm", "sigint", "sighup"):
        os.kill(os.getpid(), getattr(signal, f.kind.upper()))
    elif f.kind == "hang":
        while True:
            time.sleep(3600)
    elif f.kind == "slow":
        time.sleep(f.seconds)


class _FaultyWriter(FileSystemWriter):
    def __init__(self, path: Path, faults: list[Fault]):
        super().__init__(path)
        self.faults = faults

    def write_data(self, plan, planner):
        for f in self.faults:
            if f.kind == "enospc":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
            _process_fault(f)
        return super().write_data(plan, planner)


def poison(batch: torch.Tensor, vocab_size: int, seed: int) -> torch.Tensor:
    """A batch of uniformly random token ids: data the model has never seen the like of."""
    return torch.randint(0, vocab_size, batch.shape, generator=torch.Generator().manual_seed(seed))


def nan_grad(modules: list[torch.nn.Module]) -> None:
    """Set one element of this rank's first non-empty gradient (shard) to NaN."""
    for m in modules:
        for p in m.parameters():
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if g is not None and g.numel():
                g.view(-1)[0] = float("nan")
                return
