"""`flopwise train`'s job on this process: build the run (data, model, layout, resume point), then
train it. One rank of a torchrun/srun job does the same; only rank 0 prints."""

from __future__ import annotations

import os
import time

from rich.console import Console

from flopwise.build import build_run
from flopwise.config import Config
from flopwise.train.trainer import TrainResult
from flopwise.train.trainer import train as train_run


def is_main_process() -> bool:
    """Rank 0 of a torchrun/srun job, or a single process (the one that reports)."""
    return os.environ.get("RANK", "0") == "0"


def train(cfg: Config, console: Console | None = None) -> TrainResult:
    """Build this rank's run from `cfg` and train it (other ranks print nothing)."""
    started = time.perf_counter()
    console = (console or Console()) if is_main_process() else Console(quiet=True)
    return train_run(build_run(cfg, console), console, started)
