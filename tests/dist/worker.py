"""Run many jobs inside one torchrun launch (a launch costs 10-30 s here; a job a second or two).

    torchrun --nproc-per-node N tests/dist/worker.py JOBS.json OUT.json

JOBS.json is a list of {"name", "kind", "overrides": [key=value, ...]}; rank 0 writes
{name: result} to OUT.json. Kinds are the functions in flopwise_dist_jobs.
"""

import json
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import jobs  # noqa: E402


def main(spec: str, out: str) -> None:
    import faulthandler, os
    faulthandler.dump_traceback_later(int(os.environ.get("WORKER_HANG_S", "500")), exit=True)
    dist.init_process_group("gloo")
    results = {}
    for job in json.loads(Path(spec).read_text()):
        try:
            results[job["name"]] = getattr(jobs, job["kind"])(job["overrides"])
        except Exception as e:  # one broken layout must not hide the others' results
            results[job["name"]] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        dist.barrier()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
