"""`flopwise train`'s job on this process: build the run (data, model, layout, resume point), then
train it. One rank of a torchrun/srun job does the same; only rank 0 prints (flopwise.log)."""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist

from flopwise.build import build_run, subnormals_flushed
from flopwise.config import Config
from flopwise.train.preflight import WillNotFit
from flopwise.train.trainer import TrainResult
from flopwise.train.trainer import train as train_run


def is_main_process() -> bool:
    """Rank 0 of a torchrun/srun job, or a single process (the one that reports)."""
    return os.environ.get("RANK", "0") == "0"


def train(cfg: Config) -> TrainResult:
    """Build this rank's run from `cfg` and train it. A run the pre-flight refuses stops every
    rank of a job together with exit 2, once rank 0 has said why."""
    started = time.perf_counter()
    with subnormals_flushed():
        return _train(cfg, started)


def _train(cfg: Config, started: float) -> TrainResult:
    try:
        run = build_run(cfg)
    except WillNotFit as e:
        if not dist.is_initialized():
            raise
        if is_main_process():  # before any rank exits: torchrun stops the others when one does
            print(f"error: {e}", file=sys.stderr, flush=True)
        dist.barrier()
        sys.stdout.flush()
        os._exit(2)  # all at once: a rank still shutting down when another has exited is stopped by torchrun
    return train_run(run, started)
