"""torchrun, without a traceback for an outcome that is not a crash, and without restarting a
refusal: `python -m flopwise.train.agent ARGS` takes torchrun's own arguments (examples/train.sbatch
starts it on each node).

torchrun prints a Python traceback when it is signalled (SignalException: SLURM's warning before
the time limit, `scancel --signal=TERM`), though its ranks then checkpoint and exit 0, and a
ChildFailedError report when a rank exits non-zero, also when the job was refused in one line
(exit 2: rank 0 said why, the others left quietly or were stopped by torchrun). Here those two end
with their exit code and no report; any other failure is torchrun's report, as ever. And a
refusal found once the ranks run (a checkpoint, the data's tokenizer, a setting the device lacks)
is deterministic: `--max-restarts` would only say it again, so it ends the job at once. A job
that succeeded on several nodes ends without a TCPStore stack (`_Agent.run`).
"""

from __future__ import annotations

import logging
import signal
import sys

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher import api as launcher
from torch.distributed.run import parse_args, run

REFUSED = 2  # flopwise's exit code for a user error, said in one line by the rank that found it


def refused(codes: set[int]) -> bool:
    """Whether ranks' exit codes are a refusal: one rank exited 2 and any other did too or was
    stopped by torchrun (SIGTERM) before it could."""
    return REFUSED in codes and codes <= {REFUSED, -signal.SIGTERM}


class _Agent(LocalElasticAgent):
    """torchrun's agent, except that a worker group that failed with a refusal is not restarted
    (torch's loop, SimpleElasticAgent._invoke_run, restarts a failed group while restarts remain),
    and a successful job does not close its rendezvous."""

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """torch's run; after a success, the rendezvous is left as it is: every node has passed the
        exit barrier, and closing it (launch_agent's next step) reaches a store whose host, another
        node's agent, may have exited already: a 28-frame TCPStore stack on a successful job's stderr."""
        result = super().run(role)
        if not result.is_failed():  # only its heartbeats stop (c10d's handler; the others have none)
            handler = self._worker_group.spec.rdzv_handler
            handler.shutdown = getattr(handler, "_stop_heartbeats", lambda: True)  # type: ignore[method-assign]
        return result

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.is_failed() and refused({f.exitcode for f in result.failures.values()}):
            self._remaining_restarts = 0
        return result


def _not_a_refusal(record: logging.LogRecord) -> bool:
    """torchrun's own line for a rank that exited 2 is left out: that rank said why, in one line."""
    said = record.msg == _FAILED and isinstance(record.args, tuple) and record.args[0] == REFUSED
    return not said


_FAILED = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"  # torch 2.13's multiprocessing/api.py


def main(argv: list[str] | None = None) -> int:
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_not_a_refusal)
    launcher.LocalElasticAgent = _Agent  # type: ignore[misc]  # the class torch's launch_agent builds, in this process
    try:
        run(parse_args(argv))
    except SignalException as e:  # the ranks were passed the signal and say how they stopped
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        if not refused({f.exitcode for f in e.failures.values()}):
            raise
        return REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
