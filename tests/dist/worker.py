"""Run many jobs inside one torchrun launch (a launch costs 10-30 s here; a job a second or two).

    torchrun --nproc-per-node N tests/dist/worker.py JOBS.json OUT.json

JOBS.json is a list of {"name", "kind", "overrides": [key=value, ...]}; rank 0 writes
{name: result} to OUT.json. Kinds are the functions in tests/dist/jobs.py.

A job that raises on a rank ends the launch at once: the rank writes the error to
OUT.json.rank<r>.error and exits non-zero, and torchrun stops the others. Carrying on is not
safe: the other ranks may be waiting in one of the job's collectives, which would hang them until
WORKER_HANG_S, a job's limit (or pair their next collective with the wrong one).
"""

import faulthandler
import gc
import json
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

sys.path.insert(0, str(Path(__file__).parent))
import jobs  # noqa: E402


def main(spec: str, out: str) -> None:
    hang_s = int(os.environ.get("WORKER_HANG_S", "300"))
    dist.init_process_group("gloo")
    results = {}
    for job in json.loads(Path(spec).read_text()):
        groups = set(_world.pg_map)
        # per job, not per launch: a launch of 40 jobs on a busy machine outlasts any fixed total
        faulthandler.dump_traceback_later(hang_s, exit=True)
        try:
            results[job["name"]] = getattr(jobs, job["kind"])(job["overrides"])
        except Exception as e:
            error = {"job": job["name"], "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            Path(f"{out}.rank{dist.get_rank()}.error").write_text(json.dumps(error))
            sys.stderr.flush()
            os._exit(1)
        dist.barrier()
        end_groups(groups)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def end_groups(kept: set) -> None:
    """Destroy the process groups a job made (its device mesh's, the saver's), as a job's own
    process would on exit. Kept, they pile up over a launch of 40 jobs: each gloo group holds its
    threads and a socket per peer, and such launches failed by chance on a busy machine (a Broken
    pipe constructing a later job's group; once a heap corruption abort)."""
    for pg in set(_world.pg_map) - kept:
        dist.destroy_process_group(pg)
    gc.collect()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
