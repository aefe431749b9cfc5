"""Run many jobs inside one torchrun launch (a launch costs 10-30 s here; a job a second or two).

    torchrun --nproc-per-node N tests/dist/worker.py JOBS.json OUT.json

JOBS.json is a list of {"name", "kind", "overrides": [key=value, ...]}; rank 0 writes
{name: result} to OUT.json, after each job the results so far, with "_seconds": {name: wall seconds}
(rank 0's, for finding the launch's slow jobs). Kinds are the functions in tests/dist/jobs.py.

A job that raises on a rank ends the launch at once: the rank writes the error to
OUT.json.rank<r>.error and exits non-zero, and torchrun stops the others. Carrying on is not
safe: the other ranks may be waiting in one of the job's collectives, which would hang them until
WORKER_HANG_S, a job's limit (or pair their next collective with the wrong one).
"""

import faulthandler
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import jobs  # noqa: E402


def main(spec: str, out: str) -> None:
    hang_s = int(os.environ.get("WORKER_HANG_S", "300"))
    dist.init_process_group("gloo")
    results: dict = {"_seconds": {}}
    for job in json.loads(Path(spec).read_text()):
        t0 = time.perf_counter()
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
        results["_seconds"][job["name"]] = round(time.perf_counter() - t0, 2)
        if dist.get_rank() == 0:  # after every job: a launch that dies later keeps what it finished
            Path(f"{out}.tmp").write_text(json.dumps(results))
            os.replace(f"{out}.tmp", out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
