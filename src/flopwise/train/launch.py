"""`flopwise train`'s job on this process: build the run (data, model, layout, resume point), then
train it. One rank of a torchrun/srun job does the same; only rank 0 prints (flopwise.log)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from flopwise.config.schema import Config
from flopwise.errors import FlopwiseError, TrainingStopped
from flopwise.files.ownership import folder_lock, real_path
from flopwise.train.build import build_run, subnormals_flushed
from flopwise.train.preflight import WillNotFit
from flopwise.train.run import RanksDiffer, Run
from flopwise.train.trainer import TrainResult, finished, train_loop
from flopwise.train.watch import peer_lost


def _is_main_process() -> bool:
    """Rank 0 of a torchrun/srun job, or a single process (the one that reports)."""
    return os.environ.get("RANK", "0") == "0"


def train(cfg: Config) -> TrainResult:
    """Build this rank's run from `cfg` and train it. A run the pre-flight refuses stops every
    rank of a job together with exit 2, once rank 0 has said why.
    run.dir is taken in its real absolute form (what every check and writer sees), and rank 0 holds
    its lock from its first write (after the pre-flight) to the end (one writer per folder; the other
    ranks never wait on it)."""
    started = time.perf_counter()
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"dir": str(real_path(cfg.run.dir))})})
    with subnormals_flushed(), contextlib.ExitStack() as held:
        result = _train(cfg, started, lambda: held.enter_context(folder_lock(cfg.run.dir, "run.dir")))
    if result.preempted is not None and result.is_main and (marker := os.environ.get(_PREEMPT_FILE)):
        Path(marker).write_text(
            f"{result.signal or 'a signal'} at step {result.preempted}: checkpoint {result.checkpoint}\n"
        )
    return result


# Where rank 0 notes a clean stop on a signal (step and checkpoint written), for a launcher to tell
# it from a crash: torchrun's agent itself exits 1 when SLURM signals it, whatever its workers did
# (examples/train.sbatch reads it and exits 0, so the job ends COMPLETED and `--requeue` continues).
_PREEMPT_FILE = "FLOPWISE_PREEMPT_FILE"


def _train(cfg: Config, started: float, lock: Callable[[], object]) -> TrainResult:
    try:
        built = build_run(cfg, lock)
    except (WillNotFit, RanksDiffer) as e:
        if not dist.is_initialized():
            raise
        if _is_main_process():  # before any rank exits: torchrun stops the others when one does
            print(f"error: {e}", file=sys.stderr, flush=True)
        dist.barrier()
        sys.stdout.flush()
        os._exit(2)  # all at once: a rank still shutting down when another has exited is stopped by torchrun
    except FlopwiseError as e:
        _say_once(e)
        raise
    except RuntimeError as e:  # rank 0 refused alone (its data, its run folder) and left: it said why
        if _is_main_process() or not peer_lost(e):
            raise
        raise TrainingStopped("rank 0 stopped while the run was built", quiet=True) from None
    return train_loop(built, started) if isinstance(built, Run) else finished(built, started)


_REFUSAL_KEY = "flopwise/refusal"
_SAME_REFUSAL_S = 30  # how long another rank waits for rank 0's refusal (the ranks build the run abreast)


def _say_once(e: FlopwiseError) -> None:
    """A refusal found while building a job's run, said once when every rank finds it (a checkpoint,
    the data's tokenizer, a setting the device lacks): before the process group exists it comes from
    the config and world every rank shares, so rank 0 says it; after, rank 0 posts it in the job's
    store before it leaves, and another rank stays quiet if rank 0 posts the same line in time (else
    it says its own)."""
    if not dist.is_initialized():
        e.quiet = not _is_main_process()
        return
    store = dist.distributed_c10d._get_default_store()
    if _is_main_process():
        store.set(_REFUSAL_KEY, str(e))
        return
    try:
        store.wait([_REFUSAL_KEY], timedelta(seconds=_SAME_REFUSAL_S))
        e.quiet = store.get(_REFUSAL_KEY).decode() == str(e)
    except RuntimeError:  # rank 0 refused nothing in time, or left with its store: say this rank's own
        pass
