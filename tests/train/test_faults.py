"""Fault injection across torchrun ranks (gloo, 2 processes, `flopwise train` as users launch it):
a rank SIGKILLed mid-step and mid-checkpoint-write, SIGTERM, a NaN gradient on one rank, a
straggler, disk full, and a hung rank. Each asserts how the job ended, that nothing beyond the last
complete checkpoint was lost, and, where the run should recover exactly, that its final
checkpoint's tensor files are bit-identical to an uninterrupted run's."""

import json
import os
import subprocess
import sys
import time

import pytest

from flopwise.checkpoints import checkpoint
from tests.conftest import tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
STEPS = 8


def launch(run_dir, data, faults="", restarts=1, timeout=300, nproc=2, **extra) -> subprocess.CompletedProcess:
    """`flopwise train` under torchrun (`--standalone`: a free rendezvous port, so parallel test workers or
    other users of the machine never collide on a fixed one)."""
    kw = {"train.steps": STEPS, "train.eval_every": 0, "train.eval_batches": 1, "checkpoint.interval": 3, **extra}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLOPWISE_FAULTS": faults, "COLUMNS": "400"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(restarts),
        "--standalone",
        "-m",
        "flopwise",
        "train",
        *tiny_overrides(run_dir, data, **kw),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def hashes(ckpt) -> dict[str, str]:
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    return {k: v["sha256"] for k, v in files.items() if k.endswith(".distcp")}


def loader_and_rng(ckpt) -> tuple:
    s = checkpoint.read_state(ckpt)
    return s["loader"], s["rng"], s["step"]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    r = launch(run_dir, tiny_data)
    assert r.returncode == 0, r.stderr[-3000:]
    return checkpoint.latest(run_dir)


@pytest.mark.parametrize(
    "faults,async_save,resumed",
    [
        ("kill:step=5:rank=1", "false", (3,)),  # mid-step
        ("kill:step=7:rank=0", "true", (3, 6)),  # step 3 complete (the save at 6 waited for it), 6 maybe in flight
        ("kill:save=2:rank=0", "false", (3,)),
    ],
)  # mid checkpoint write
def test_sigkill_restarts_from_the_last_checkpoint_and_matches_bitwise(
    tiny_data, tmp_path, reference, faults, async_save, resumed
):
    t0 = time.perf_counter()
    r = launch(tmp_path, tiny_data, faults, **{"checkpoint.async": async_save})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exitcode: -9" in r.stderr  # the kill happened, torchrun restarted the job
    if "step=" in faults:  # the survivor says a peer died, not that it waited out the collective timeout
        assert "another rank's connection closed" in r.stderr and "timed out" not in r.stderr, r.stderr[-3000:]
    assert any(f"step-{s:08d} at step {s}" in r.stdout for s in resumed), r.stdout[-2000:]
    final = checkpoint.latest(tmp_path)
    assert final.name == f"step-{STEPS:08d}"
    assert hashes(final) == hashes(reference) and loader_and_rng(final) == loader_and_rng(reference)
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    print(f"{faults}: killed, restarted and finished in {time.perf_counter() - t0:.1f} s")


def test_sigkill_on_4_ranks_under_fsdp_matches_bitwise(tiny_data, tmp_path):
    """FSDP2 (ZeRO-3) on 4 ranks: sharded DTensor state written by every rank, one rank killed."""
    kw = {"parallel.zero": 3, "train.micro_batch": 2}
    ref = launch(tmp_path / "ref", tiny_data, restarts=0, nproc=4, **kw)
    assert ref.returncode == 0, ref.stderr[-3000:]
    r = launch(tmp_path / "killed", tiny_data, "kill:step=5:rank=3", nproc=4, **kw)
    assert r.returncode == 0 and "exitcode: -9" in r.stderr, r.stderr[-3000:]
    assert "step-00000003 at step 3" in r.stdout
    a, b = checkpoint.latest(tmp_path / "ref"), checkpoint.latest(tmp_path / "killed")
    assert len(hashes(a)) == 4 and hashes(a) == hashes(b) and loader_and_rng(a) == loader_and_rng(b)


def test_sigterm_checkpoints_exits_zero_and_resume_matches(tiny_data, tmp_path, reference):
    r = launch(tmp_path, tiny_data, "sigterm:step=4:rank=1", restarts=0)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "preempted by a signal to another rank at step 4" in r.stdout and "run the same command again" in r.stdout
    assert checkpoint.latest(tmp_path).name == "step-00000004"
    r = launch(tmp_path, tiny_data)
    assert r.returncode == 0 and "step-00000004 at step 4" in r.stdout
    assert hashes(checkpoint.latest(tmp_path)) == hashes(reference)


def test_nan_on_one_rank_is_skipped_by_all_and_a_straggler_is_named(tiny_data, tmp_path):
    r = launch(tmp_path, tiny_data, "slow:step=2:rank=1:seconds=0.6,nan_grad:step=4:rank=1", restarts=0)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 4, "event": "skipped_update", "reason": "non-finite loss or gradient norm"} in [
        {k: x[k] for k in ("step", "event", "reason") if k in x} for x in rows
    ]
    slow = next(x for x in rows if x["step"] == 2 and "rank_step_s" in x)
    assert slow["slowest_rank"] == 1 and slow["rank_step_s"][1] > slow["rank_step_s"][0] + 0.5
    assert checkpoint.verify(checkpoint.latest(tmp_path)) is None


def test_disk_full_on_one_rank_stops_every_rank_with_the_previous_checkpoint_intact(tiny_data, tmp_path):
    r = launch(tmp_path, tiny_data, "enospc:save=2:rank=1", restarts=0)
    assert r.returncode != 0
    assert "error: checkpoint step-00000006 not written" in r.stderr and "No space left on device" in r.stderr
    assert "[rank0]: Traceback" not in r.stderr and "[rank1]: Traceback" not in r.stderr  # (torchrun prints its own)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000003"]
    assert checkpoint.verify(tmp_path / "checkpoints" / "step-00000003") is None


@pytest.mark.waits  # the watchdog's 15 s timeout
def test_hung_rank_dumps_stacks_times_out_and_the_restart_finishes(tiny_data, tmp_path, reference):
    r = launch(
        tmp_path,
        tiny_data,
        "hang:step=5:rank=1",
        timeout=400,
        **{"watchdog.collective_timeout_s": 15, "watchdog.min_s": 2, "watchdog.hang_factor": 3},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "a collective timed out at step 5 after watchdog.collective_timeout_s=15" in r.stderr
    hung = (tmp_path / "hang-rank1.txt").read_text()
    assert "step 5 has run" in hung and "faults.py" in hung  # the stack shows where rank 1 is stuck
    assert "step 5 has run" in (tmp_path / "hang-rank0.txt").read_text()
    assert "step-00000003 at step 3" in r.stdout
    assert hashes(checkpoint.latest(tmp_path)) == hashes(reference)


def test_auto_interval_is_rank_0s_choice_when_ranks_time_differently(tiny_data, tmp_path):
    """checkpoint.interval=auto from each rank's own timings: rank 1 is a straggler for the first
    steps, so its median step time (and its Daly interval) differs from rank 0's. Rank 0 decides and
    broadcasts: every rank saves at the same steps (a disagreement would be a collective mismatch)."""
    slow = ",".join(f"slow:step={s}:rank=1:seconds=0.4" for s in range(1, 6))
    r = launch(
        tmp_path,
        tiny_data,
        slow,
        restarts=0,
        **{"train.steps": 14, "checkpoint.interval": '"auto"', "checkpoint.keep": 20, "cluster.gpu_mtbf_hours": 0.002},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    [line] = [x for x in r.stdout.splitlines() if "checkpoint.interval=auto" in x]
    every = int(line.split("every ")[1].split(" steps")[0].replace(",", ""))
    saved = sorted(int(p.name[5:]) for p in (tmp_path / "checkpoints").iterdir())
    assert saved == sorted({5, 14} | {s for s in range(6, 15) if s % every == 0})
    assert all(checkpoint.verify(tmp_path / "checkpoints" / f"step-{s:08d}") is None for s in saved)
