"""examples/train.sbatch under a real SLURM (scripts/slurm-local.sh start: slurmctld + slurmd on
this machine, a CPU partition): it trains to completion; a preemption signal (`scancel
--signal=TERM`, or `--signal=TERM@N` before the time limit) checkpoints and ends the job with exit
0; `scontrol requeue` continues it to the same final state, bit for bit, as a job never stopped.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("FLOPWISE_SLURM_STATE", "/tmp/flopwise-slurm"))


def _slurm_up() -> str | None:
    """Why the SLURM tests cannot run here, or None when they can."""
    if shutil.which("sbatch") is None:
        return "SLURM is not installed (scripts/slurm-local.sh start installs and starts it)"
    r = subprocess.run(
        ["sinfo", "-h", "-o", "%T"],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "SLURM_CONF": str(STATE / "slurm.conf")},
    )
    if r.returncode != 0 or "idle" not in r.stdout and "alloc" not in r.stdout:
        return f"SLURM is not running at {STATE} (scripts/slurm-local.sh start): {r.stderr.strip()[:200]}"
    return None


WHY_NOT = _slurm_up()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.slurm,
    pytest.mark.waits,
    pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or ""),
]


def slurm(*args: str, env: dict[str, str] | None = None) -> str:
    r = subprocess.run(list(args), check=False, capture_output=True, text=True, env=env or ENV, timeout=60)
    assert r.returncode == 0, f"{args}: {r.stderr}"
    return r.stdout


ENV = {
    **os.environ,
    "SLURM_CONF": str(STATE / "slurm.conf"),
    "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
}


def submit(where: Path, name: str, args: list[str], *sbatch: str, faults: str = "") -> str:
    """sbatch examples/train.sbatch on one node from `where`; the job id. The faults travel in
    sbatch's own environment (`--export=ALL`): a value given in --export is cut at its first comma."""
    return slurm(
        "sbatch",
        "--parsable",
        "--nodes",
        "1",
        "--job-name",
        name,
        "--chdir",
        str(where),
        "--export=ALL",
        *sbatch,
        str(ROOT / "examples" / "train.sbatch"),
        *args,
        env={**ENV, "FLOPWISE_FAULTS": faults},
    ).strip()


def job(jid: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", slurm("scontrol", "show", "job", jid)))


def wait(jid: str, timeout: float = 300, restarts: int = 0) -> dict[str, str]:
    """The job's fields once it has ended (after `restarts` requeues)."""
    deadline = time.monotonic() + timeout
    while (j := job(jid))["JobState"] not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") or int(
        j["Restarts"]
    ) < restarts:
        assert time.monotonic() < deadline, f"job {jid} still {j['JobState']} after {timeout} s"
        time.sleep(1)
    return j


def wait_for_step(metrics: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and f'"step": {step},' in metrics.read_text()):
        assert time.monotonic() < deadline, f"no step {step} in {metrics} after {timeout} s"
        time.sleep(0.2)


def tensors(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, flattened, read with torch's own converter."""
    out = tmp / f"{ckpt.parent.parent.name}.pt"
    dcp_to_torch_save(ckpt, out)

    def flat(tree, prefix=""):
        for k, v in tree.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            elif isinstance(v, torch.Tensor):
                yield f"{prefix}{k}", v

    return dict(flat(torch.load(out, weights_only=True)))


def args(data, steps: int = 10) -> list[str]:
    """The demo's tiny model; run.dir is the script's own (runs/<job name>)."""
    extra = {"train.steps": steps, "train.eval_every": 0, "checkpoint.interval": 5}
    return [a for a in tiny_overrides("-", data, **extra) if not a.startswith("run.dir=")]


def test_sbatch_trains_and_requeue_after_scancel_is_bitwise(tiny_data, tmp_path):
    """One job trains 10 steps to completion; a second, `scancel --signal=TERM` at step 2-3, ends
    COMPLETED with exit 0 and a checkpoint of the step it stopped at; `scontrol requeue` resumes it
    from there, and its final checkpoint's tensors equal the first job's exactly."""
    full = submit(tmp_path, "full", args(tiny_data))
    stopped = submit(tmp_path, "stopped", args(tiny_data), faults="slow:step=3:seconds=15")
    j = wait(full)
    assert (j["JobState"], j["ExitCode"]) == ("COMPLETED", "0:0"), (tmp_path / f"full-{full}.out").read_text()[-3000:]
    wait_for_step(tmp_path / "runs" / "stopped" / "metrics.jsonl", 2)
    slurm("scancel", "--signal=TERM", stopped)
    j = wait(stopped)
    log = (tmp_path / f"stopped-{stopped}.out").read_text()
    assert (j["JobState"], j["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    m = re.search(r"flopwise: preempted by SIGTERM at step (\d+): checkpoint \S+step-0+(\d+); exit 0", log)
    assert m and m[1] == m[2] and int(m[1]) < 10, log[-3000:]

    slurm("scontrol", "requeue", stopped)
    # SLURM holds a requeued job 2 min; released at once, it can be allocated in the second its last run
    # ended, and slurmd refuses it ("Killing non-startable batch JobId=27: Job credential revoked",
    # WEXITSTATUS 1: a CI run, 2026-12-06): a credential made in the second of the revocation counts as
    # revoked. A few seconds on, it starts.
    slurm("scontrol", "update", f"JobId={stopped}", "StartTime=now+3")
    j = wait(stopped, restarts=1)
    log = (tmp_path / f"stopped-{stopped}.out").read_text()
    assert (j["JobState"], j["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert re.search(rf"resumed from \S+step-0+{m[1]} at step {m[1]} \(written by layout dp2\)", log), log[-3000:]
    a = tensors(tmp_path / "runs" / "full" / "checkpoints" / "step-00000010", tmp_path)
    b = tensors(tmp_path / "runs" / "stopped" / "checkpoints" / "step-00000010", tmp_path)
    assert a.keys() == b.keys() and len(a) > 10
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_time_limit_signal_checkpoints_and_exits_0(tiny_data, tmp_path):
    """`--time=2 --signal=TERM@70`: SLURM signals 70 s before the limit (its timer ticks every
    30 s: 20-50 s into the job); flopwise checkpoints at the next sync point and the job ends
    COMPLETED, exit 0, before its limit. (Steps 2-4 sleep 20 s each, so the signal lands in a step;
    torchrun gives its workers 30 s after passing SIGTERM on, so no single step may take longer.)"""
    slow = ",".join(f"slow:step={s}:seconds=20" for s in (2, 3, 4))
    jid = submit(tmp_path, "limit", args(tiny_data), "--time=2", "--signal=TERM@70", faults=slow)
    j = wait(jid, timeout=200)
    log = (tmp_path / f"limit-{jid}.out").read_text()
    assert (j["JobState"], j["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    m = re.search(r"flopwise: preempted by SIGTERM at step (\d+): checkpoint \S+step-0+(\d+); exit 0", log)
    assert m and m[1] == m[2], log[-3000:]
    assert "Traceback" not in log and "ChildFailedError" not in log, log[-3000:]  # the agent's quiet stop


def _documented_command() -> list[str]:
    """The CPU command of examples/train.sbatch's header (docs/scaling-out.md shows the same), as written."""
    header = (ROOT / "examples" / "train.sbatch").read_text().split("#   CPUs: ", 1)[1]
    first, second = header.splitlines()[:2]
    words = (first.rstrip("\\").strip() + " " + second.lstrip("#").strip()).split()
    return words[words.index("examples/train.sbatch") + 1 :]


def test_documented_example_completes_and_a_config_error_is_not_retried(tmp_path):
    """The header's CPU example, verbatim, completes on its first submission (issue 54: it failed on
    seq_len, then warm-up, then the batch); a config error stops the job at the pre-flight check,
    once, with exit 2 and its one line: no rank starts, torchrun retries nothing."""
    bad = submit(tmp_path, "bad", ["model.preset=demo-tiny", "train.steps=10"])
    good = submit(tmp_path, "good", _documented_command())
    j = wait(bad)
    log = (tmp_path / f"bad-{bad}.out").read_text()
    assert (j["JobState"], j["ExitCode"]) == ("FAILED", "2:0"), log[-3000:]
    assert log.splitlines()[1:] == [
        "error: config error: data.seq_len=256 exceeds model.max_seq_len=128; lower data.seq_len or raise "
        "model.max_seq_len"
    ], log[-3000:]
    j = wait(good, timeout=400)
    log = (tmp_path / f"good-{good}.out").read_text()
    assert (j["JobState"], j["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert "step 10/10" in log and (tmp_path / "runs" / "good" / "checkpoints" / "step-00000010").is_dir(), log
