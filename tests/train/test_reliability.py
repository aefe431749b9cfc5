"""Reliability in one process: verified checkpoints, refused pickles and traversal, failed saves,
the NaN/spike guard, preemption, async saves, the auto interval and the watchdog. The same faults
across torchrun ranks (kill, restart, hang) are in test_faults.py."""

import io
import json
import os
import pickle
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
import transformers
from rich.console import Console

from flopwise.checkpoints import checkpoint
from flopwise.config.schema import GuardConfig, WatchdogConfig, load_config
from flopwise.errors import CheckpointError, ConfigError, TrainingStopped
from flopwise.eval.load import load_for_inference
from flopwise.interop.convert import export_hf
from flopwise.log import printing_to
from flopwise.train.faults import parse
from flopwise.train.guard import Guard, Verdict
from flopwise.train.launch import train
from flopwise.train.watch import Watch
from tests.conftest import flopwise, tiny_overrides


def run(tmp, data, faults="", monkeypatch=None, **kw):
    """Train; returns (result, console text)."""
    if monkeypatch is not None:
        monkeypatch.setenv("FLOPWISE_FAULTS", faults)
    buf = io.StringIO()
    with printing_to(Console(file=buf, width=300)):
        r = train(load_config(None, tiny_overrides(tmp, data, **kw)))
    return r, buf.getvalue()


def weights(path) -> dict[str, torch.Tensor]:
    return load_for_inference(path)[0].state_dict()


def same_weights(a, b) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def distcp_hashes(ckpt) -> dict[str, str]:
    """The sha256 of every tensor file: equal hashes = bitwise-equal weights and optimizer state."""
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    return {k: v["sha256"] for k, v in files.items() if k.endswith(".distcp")}


# ------------------------------------------------------------------------------------------------
# Checkpoint integrity


def test_manifest_records_checksums_config_hash_and_layout(tiny_run):
    ckpt = checkpoint.latest(tiny_run(6))
    m = json.loads((ckpt / "manifest.json").read_text())
    assert m["format"] == checkpoint.CHECKPOINT_FORMAT and m["step"] == 6 and len(m["config_hash"]) == 16
    assert m["layout"]["world_size"] == 1
    assert set(m["files"]) == {p.name for p in ckpt.iterdir()} - {"manifest.json"}
    assert all(len(f["sha256"]) == 64 for f in m["files"].values())


@pytest.mark.slow
def test_corrupt_latest_is_reported_and_the_previous_one_resumed(tiny_data, tiny_run, tmp_path):
    """The resumed run ends where the same run uninterrupted (tiny_run(6)) does, bit for bit."""
    run(tmp_path, tiny_data)  # checkpoints 3, 6 (in a folder of its own: it trains on there)
    latest = checkpoint.latest(tmp_path)
    blob = latest / "__0_0.distcp"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, so only the checksum sees it
    blob.write_bytes(bytes(data))
    assert checkpoint.is_complete(latest)  # sizes still match
    assert "sha256" in checkpoint.verify(latest)
    r, out = run(tmp_path, tiny_data)
    assert (
        "skipping damaged checkpoint step-00000006 (__0_0.distcp fails its sha256 checksum); using step-00000003" in out
    )
    assert "resumed from" in out and "step-00000003 at step 3" in out
    assert r.checkpoint.name == "step-00000006" and checkpoint.verify(r.checkpoint) is None
    assert distcp_hashes(r.checkpoint) == distcp_hashes(checkpoint.latest(tiny_run(6)))


def test_retention_never_deletes_the_last_complete_checkpoint_and_clears_stale_tmp(tmp_path):
    """A write cut short (the tensors of step 7 in step-00000007.tmp, flopwise's own) is cleared; a
    step folder without its manifest and a copied run's checkpoints are not this run's: kept."""
    from flopwise.model.transformer import build_model

    cfg = load_config(None, tiny_overrides(tmp_path / "run", tmp_path / "data"))
    model, run_dir = build_model(cfg.model, "cpu"), tmp_path / "run"
    root = run_dir / "checkpoints"
    checkpoint.save(run_dir, 6, model, None, {}, keep=None)
    checkpoint.begin(run_dir, 7, model, None)  # killed before finish: a partial write
    broken = root / "step-00000009"
    shutil.copytree(root / "step-00000006", broken)
    (broken / "manifest.json").unlink()  # interrupted before the manifest
    checkpoint.prune(run_dir, keep=1)
    assert [p.name for p in checkpoint.list_complete(run_dir)] == ["step-00000006"]
    assert not (root / "step-00000007.tmp").exists()
    assert checkpoint.verify(broken) == "no manifest (write interrupted)"
    copy = Path(shutil.copytree(run_dir, tmp_path / "copy"))
    checkpoint.save(copy, 8, model, None, {}, keep=None)
    checkpoint.prune(copy, keep=1)  # step 6 there was written for run/, not for copy/
    assert [p.name for p in checkpoint.list_complete(copy)] == ["step-00000006", "step-00000008"]


class Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.slow
def test_a_planted_pickle_is_refused_and_never_run(tiny_run_copy, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = checkpoint.latest(tiny_run_copy(6))
    evil = pickle.dumps(Boom())
    (ckpt / ".metadata").write_bytes(evil)
    manifest = json.loads((ckpt / "manifest.json").read_text())  # attacker also fixes the manifest
    manifest["files"][".metadata"] = {"bytes": len(evil), "sha256": checkpoint._sha256(ckpt / ".metadata")}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert "posix.system is not allowed" in checkpoint.verify(ckpt)
    with pytest.raises(CheckpointError, match="not allowed in checkpoint metadata"):
        checkpoint.resolve(ckpt)
    with pytest.raises(CheckpointError, match="refused"):  # loading directly goes through the same reader
        load_for_inference_unverified(ckpt)
    assert not (tmp_path / "PWNED").exists()


def load_for_inference_unverified(ckpt):
    from flopwise.checkpoints.export import checkpoint_config
    from flopwise.model.transformer import build_model

    model = build_model(checkpoint_config(ckpt, checkpoint.read_state(ckpt)).model, "cpu")
    checkpoint.load(ckpt, model)


def test_paths_in_manifest_or_dcp_metadata_cannot_leave_the_folder(tiny_run_copy):
    ckpt = checkpoint.latest(tiny_run_copy(6))
    m = json.loads((ckpt / "manifest.json").read_text())
    m["files"]["../../secret"] = {"bytes": 1, "sha256": "0"}
    (ckpt / "manifest.json").write_text(json.dumps(m))
    assert "outside the checkpoint folder" in checkpoint.verify(ckpt)
    md = checkpoint.read_dcp_metadata(ckpt)
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../../etc/passwd"
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        checkpoint.read_dcp_metadata(ckpt)


# ------------------------------------------------------------------------------------------------
# Failed saves


@pytest.mark.slow
@pytest.mark.parametrize("async_save", ["false", "true"])
def test_disk_full_stops_cleanly_and_keeps_the_previous_checkpoint(tiny_data, tmp_path, monkeypatch, async_save):
    with pytest.raises(CheckpointError) as e:
        run(tmp_path, tiny_data, "enospc:save=2", monkeypatch, **{"checkpoint.async": async_save})
    msg = str(e.value)
    assert "step-00000006 not written" in msg and "No space left on device" in msg
    assert "latest complete checkpoint is still step-00000003" in msg and "checkpoint.on_error=continue" in msg
    assert "\n" not in msg
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000003"]  # no partial folder
    assert checkpoint.verify(tmp_path / "checkpoints" / "step-00000003") is None


@pytest.mark.slow
def test_unwritable_checkpoint_dir_stops_cleanly(tiny_data, tmp_path):
    from flopwise.files.rundir import claim
    from flopwise.train.build import TRAIN_WRITES

    claim(tmp_path, TRAIN_WRITES)  # a flopwise run folder (a user's file at a claimed name is refused before training)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step-00000003.tmp").write_text("a file where the checkpoint's folder should be")
    with pytest.raises(CheckpointError, match="step-00000003 not written .*; there is no earlier checkpoint"):
        run(tmp_path, tiny_data)


@pytest.mark.slow
def test_disk_full_with_on_error_continue_trains_on(tiny_data, tmp_path, monkeypatch):
    r, out = run(tmp_path, tiny_data, "enospc:save=1", monkeypatch, **{"checkpoint.on_error": '"continue"'})
    assert "warning" in out and "step-00000003 not written" in out and "training goes on" in out
    assert r.steps == 6 and [p.name for p in checkpoint.list_complete(tmp_path)] == ["step-00000006"]


# ------------------------------------------------------------------------------------------------
# Guard


@pytest.mark.slow
def test_nan_gradient_skips_the_update(tiny_data, tmp_path, monkeypatch):
    r, out = run(
        tmp_path / "nan", tiny_data, "nan_grad:step=4", monkeypatch, **{"train.steps": 4, "checkpoint.interval": 0}
    )
    assert "step 4: non-finite loss or gradient norm" in out and "update skipped" in out
    ref, _ = run(
        tmp_path / "ref",
        tiny_data,
        "",
        monkeypatch,
        **{"train.steps": 4, "train.stop_after": 3, "checkpoint.interval": 0},
    )
    assert same_weights(r.checkpoint, ref.checkpoint)  # step 4 changed nothing
    events = [json.loads(x) for x in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 4, "event": "skipped_update", "reason": "non-finite loss or gradient norm"} in [
        {k: e[k] for k in ("step", "event", "reason") if k in e} for e in events
    ]


@pytest.mark.slow
def test_poisoned_batch_rolls_back_and_skips_the_data(tiny_data, tmp_path, monkeypatch):
    kw = {
        "train.steps": 36,
        "checkpoint.interval": 10,
        "train.eval_every": 0,
        "log.every": 100,
        "guard.window": 10,
        "guard.min_window": 5,
        "guard.skip_batches": 3,
    }
    r, out = run(tmp_path, tiny_data, "poison:step=30", monkeypatch, **kw)
    assert "step 30: loss spike" in out and "rolled back to step 20 and skipped 10 batches" in out
    [rec] = [json.loads(x) for x in (tmp_path / "skipped.jsonl").read_text().splitlines()]
    assert rec["step"] == 30 and rec["rolled_back_to"] == 20 and rec["batches"] == 10
    [windows], [documents] = rec["windows"].values(), rec["documents"].values()  # one source
    assert len(windows) == 10 * 8 and documents and all(isinstance(d, int) for d in documents)
    assert r.steps == 36 and r.losses[-1] < 6.0
    [state] = checkpoint.read_state(r.checkpoint)["loader"]["sources"]
    assert state["cursor"] + state["epoch"] * state["n_windows"] == (36 + 10) * 8  # the skipped data is gone
    with pytest.raises(TrainingStopped, match="guard.max_rollbacks=0"):
        run(tmp_path / "capped", tiny_data, "poison:step=30", monkeypatch, **{**kw, "guard.max_rollbacks": 0})


def test_guard_verdicts():
    g = Guard(GuardConfig(window=5, min_window=3, max_skips=2, spike_zscore=4))
    for x in (3.0, 2.9, 3.1):
        assert g.decide(x, False, g.is_spike(x)) == (Verdict.APPLY, "")
    assert not g.is_spike(3.2) and g.is_spike(5.0)
    assert g.decide(float("nan"), True, False)[0] is Verdict.SKIP
    assert g.decide(float("nan"), True, False) == (Verdict.ROLLBACK, "2 consecutive non-finite steps")
    assert g.decide(5.0, False, True)[0] is Verdict.ROLLBACK
    assert list(g.losses) == [3.0, 2.9, 3.1]  # skipped and spiking losses never enter the window
    g.rolled_back("loss spike", 7)
    h = Guard(GuardConfig(window=5, min_window=3))
    h.load_state_dict(g.state_dict())
    assert h.state_dict() == g.state_dict() == {"losses": [3.0, 2.9, 3.1], "skips": 0, "rollbacks": 1}


# ------------------------------------------------------------------------------------------------
# Preemption, async, auto interval, watchdog


@pytest.mark.slow
def test_sigterm_checkpoints_exits_and_resumes_exactly(tiny_data, tiny_run, tmp_path, monkeypatch):
    """The resumed run ends where the same run uninterrupted (tiny_run(8): its checkpoints at steps
    3 and 6 change no tensor, no random state) does, bit for bit."""
    kw = {"train.steps": 8, "checkpoint.interval": 0}
    r, _ = run(tmp_path / "split", tiny_data, "sigterm:step=5", monkeypatch, **kw)
    assert r.preempted == 5 and r.signal == "SIGTERM" and r.checkpoint.name == "step-00000005"
    resumed, out = run(tmp_path / "split", tiny_data, "", monkeypatch, **kw)
    assert "step-00000005 at step 5" in out
    ref = checkpoint.latest(tiny_run(8))
    assert distcp_hashes(resumed.checkpoint) == distcp_hashes(ref)
    a, b = checkpoint.read_state(resumed.checkpoint), checkpoint.read_state(ref)
    assert a["rng"] == b["rng"] and a["guard"] == b["guard"] and len(a["guard"]["losses"]) == 8


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_what_a_rerun_of_that_folder_may_do(tiny_data, tmp_path, monkeypatch):
    """A first Ctrl-C stops at the next sync point with a checkpoint (the summary counts the steps
    done), a second stops at once; then in that folder resume=none is refused before anything is
    touched, a checkpoint past train.steps is refused, and one at train.steps trains nothing."""
    kw = {"train.steps": 8, "checkpoint.interval": 0, "train.eval_every": 0}
    r, out = run(tmp_path / "r", tiny_data, "sigint:step=5", monkeypatch, **kw)
    assert (r.preempted, r.signal, r.steps, r.checkpoint.name) == (5, "SIGINT", 5, "step-00000005")
    assert "Ctrl-C again to stop now" in out
    with pytest.raises(KeyboardInterrupt):  # the second one comes before the step ends (one process stops there)
        run(tmp_path / "twice", tiny_data, "sigint:step=2, sigint:step=2", monkeypatch, **{**kw, "log.every": 10})
    metrics = (tmp_path / "r" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="holds an earlier run's checkpoints"):
        run(tmp_path / "r", tiny_data, "", monkeypatch, **{**kw, "checkpoint.resume": '"none"'})
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == metrics
    with pytest.raises(ConfigError, match="at step 5, past train.steps=4"):
        run(tmp_path / "r", tiny_data, "", monkeypatch, **{**kw, "train.steps": 4, "optim.warmup_steps": 1})
    done, out = run(tmp_path / "r", tiny_data, "", monkeypatch, **{**kw, "train.steps": 5})
    assert "nothing to train" in out and done.steps == 5 and not done.losses


def distcp_bytes(ckpt) -> int:
    return sum(p.stat().st_size for p in ckpt.glob("*.distcp"))


@pytest.mark.slow
def test_tied_embeddings_are_stored_once_and_resume_exactly(tiny_data, tiny_run, tmp_path, monkeypatch):
    """A tied head was stored twice, as itself and as the embedding (a 135M import: 652 MB
    where 538 MB hold it). Now a tied checkpoint is its untied twin less three embeddings (the head
    and its two AdamW moments: fp32 vocab x d_model each), the old writer's less one; the weight is
    shared again after a load, resume is bitwise, the HF export ties, and a checkpoint written the
    old way (both keys) still loads and resumes exactly."""
    kw = {"train.steps": 6, "checkpoint.interval": 3, "train.eval_every": 0}
    tied = {**kw, "model.tie_embeddings": "true"}
    emb = 512 * 64 * 4  # demo-tiny: vocab 512, d_model 64, fp32
    untied = checkpoint.latest(tiny_run(6))  # kw untied (tiny_run's evaluations change no size)
    ref, _ = run(tmp_path / "ref", tiny_data, **tied)
    saved = set(checkpoint.read_dcp_metadata(ref.checkpoint).state_dict_metadata)
    assert "model.tok_embeddings.weight" in saved and "model.output.weight" not in saved
    overhead = 4 * 2048  # four fewer entries (model.output.weight, its step and moments), each in its own record
    assert 3 * emb <= distcp_bytes(untied) - distcp_bytes(ref.checkpoint) < 3 * emb + overhead

    run(tmp_path / "split", tiny_data, **{**tied, "train.stop_after": 3})
    resumed, out = run(tmp_path / "split", tiny_data, **tied)
    assert "step-00000003 at step 3" in out
    assert distcp_hashes(resumed.checkpoint) == distcp_hashes(ref.checkpoint)
    model = load_for_inference(ref.checkpoint)[0]
    assert model.output.weight is model.tok_embeddings.weight

    with monkeypatch.context() as old:  # the writer of earlier releases: every state-dict key, the alias too
        old.setattr(checkpoint, "_ties", lambda modules: {})
        run(tmp_path / "old", tiny_data, **{**tied, "train.stop_after": 3})
    first = checkpoint.latest(tmp_path / "old")
    assert "model.output.weight" in checkpoint.read_dcp_metadata(first).state_dict_metadata
    assert emb <= distcp_bytes(first) - distcp_bytes(checkpoint.step_dir(tmp_path / "split", 3)) < emb + 2048
    continued, out = run(tmp_path / "old", tiny_data, **tied)
    assert "step-00000003 at step 3" in out
    assert distcp_hashes(continued.checkpoint) == distcp_hashes(ref.checkpoint)

    hf = export_hf(ref.checkpoint, tmp_path / "hf")
    exported = transformers.AutoModelForCausalLM.from_pretrained(hf)
    assert exported.config.tie_word_embeddings
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    assert torch.equal(exported.model.embed_tokens.weight, model.tok_embeddings.weight)


@pytest.mark.slow
def test_rerunning_a_finished_run_builds_and_loads_nothing(tiny_data, tmp_path, monkeypatch, cli):
    """`flopwise train` again in a finished run's folder took 82 s (a 135M model) to say
    there was nothing to do: it built the model and loaded the checkpoint first. The answer comes
    from the newest checkpoint's state.json now: no model is built, no tensor read; the same line,
    exit 0, and the summary of what the run recorded."""
    args = ["train", *tiny_overrides(tmp_path, tiny_data, **{"train.steps": 6})]
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    val = [
        r["val_loss"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r
    ]

    def refuse(*_args, **_kw):
        raise AssertionError("a model built or a tensor read to say there is nothing to do")

    with monkeypatch.context() as m:
        m.setattr("flopwise.model.transformer.Transformer.__init__", refuse)
        m.setattr("torch.distributed.checkpoint.load", refuse)
        again = cli(*args)
    said = " ".join((again.stdout + again.stderr).split())
    assert again.returncode == 0, said
    assert (
        "complete: the checkpoint is at step 6, where this run ends (train.steps, train.stop_after): "
        "nothing to train; raise them to continue" in said
    )
    assert "step-00000006" in said and f"{val[-1]:.4f}" in said  # the checkpoint, and the val loss it ended with
    more = cli("train", *tiny_overrides(tmp_path, tiny_data, **{"train.steps": 7}))  # not finished: trains step 7
    assert more.returncode == 0 and "step-00000006 at step 6" in more.stdout + more.stderr


@pytest.mark.slow
def test_async_checkpoints_resume_bitwise(tiny_data, tmp_path, monkeypatch):
    kw = {"train.steps": 8, "checkpoint.interval": 2, "checkpoint.async": "true"}
    run(tmp_path / "split", tiny_data, **{**kw, "train.stop_after": 5})
    assert [p.name for p in checkpoint.list_complete(tmp_path / "split")] == ["step-00000004", "step-00000005"]
    resumed, out = run(tmp_path / "split", tiny_data, **kw)
    assert "step-00000005 at step 5" in out
    assert len(resumed.async_save_s) == len(resumed.save_s) == 2  # steps 6 and 8, both written in the background
    ref, _ = run(tmp_path / "ref", tiny_data, **{**kw, "checkpoint.async": "false"})
    assert distcp_hashes(resumed.checkpoint) == distcp_hashes(ref.checkpoint)


@pytest.mark.slow
def test_auto_interval_from_the_measured_write(tiny_data, tmp_path):
    r, out = run(
        tmp_path, tiny_data, **{"train.steps": 12, "checkpoint.interval": '"auto"', "cluster.gpu_mtbf_hours": 0.001}
    )
    line = next(x for x in out.splitlines() if "checkpoint.interval=auto" in x)
    every = int(line.split("every ")[1].split(" steps")[0].replace(",", ""))
    assert "cluster.gpu_mtbf_hours=0.001 over 1 device(s)" in line and every >= 1
    expected = {5, 12} | {s for s in range(6, 12) if s % every == 0}
    assert {int(p.name[5:]) for p in checkpoint.list_complete(tmp_path)} == set(sorted(expected)[-2:])


def test_watchdog_dumps_every_thread_when_a_step_hangs(tmp_path):
    """Step 6 "hangs" until the watchdog has reported it: a fixed sleep (1.2 s) raced the limit on a busy
    machine, where the 10 ms steps before it stretch and the limit (3 × their median) with them."""
    from flopwise.files.rundir import claim

    claim(tmp_path, ["hang-rank0.txt"])  # a run folder's report: written only where train claimed it
    seen = []
    with Watch(WatchdogConfig(hang_factor=3, min_s=0.3), tmp_path, 0, torch.device("cpu"), seen.append) as w:
        for step in range(1, 6):
            w.beat(step)
            time.sleep(0.01)
        w.beat(6)
        deadline = time.monotonic() + 120
        while not seen and time.monotonic() < deadline:  # this step "hangs"
            time.sleep(0.05)
    text = (tmp_path / "hang-rank0.txt").read_text()
    assert text.startswith("rank 0: step 6 has run") and "test_watchdog_dumps_every_thread" in text
    assert text.count("Thread 0x") + text.count("Current thread 0x") >= 2  # the watchdog's own thread too
    assert len(seen) == 1 and "hang-rank0.txt" in seen[0]


@pytest.mark.slow
def test_a_slow_step_is_one_line_on_the_terminal_and_its_stacks_only_in_the_report(tiny_data, tmp_path):
    """A step past the watchdog's limit on one process (a 135M model's step past 300 s)
    printed every thread's stack, some 40 lines, on the terminal. Now one line names the step, the
    time and hang-rank0.txt, which holds the stacks (the slow step's sleep among them); a user runs
    `flopwise train`, so this runs it in a fresh process, where faulthandler reaches the real stderr."""
    r = flopwise(
        "train",
        *tiny_overrides(tmp_path, tiny_data, **{"watchdog.min_s": 1, "watchdog.hang_factor": 1.5}),
        env={"FLOPWISE_FAULTS": "slow:step=4:seconds=8"},  # past 1.5 x the median step even on a busy machine
    )
    assert r.returncode == 0, r.stderr
    terminal = (r.stdout + r.stderr).splitlines()
    report = tmp_path.resolve() / "hang-rank0.txt"
    line = re.compile(
        rf"watchdog: rank 0: step 4 has run [\d.]+ s \(median step [\d.]+ s\); "
        rf"every thread's stack is in {re.escape(str(report))}"
    )
    assert any(line.fullmatch(x.strip()) for x in terminal), [x for x in terminal if "watchdog" in x]
    stacks = [x for x in terminal if x.lstrip().startswith(('File "', "Thread 0x", "Current thread 0x"))]
    assert not stacks, stacks[:5]
    text = report.read_text()
    assert "rank 0: step 4 has run" in text and " in _process_fault" in text  # the main thread, in the slow fault


def test_a_watchdog_report_that_cannot_be_written_goes_to_stderr(tmp_path, capfd):
    """A folder train did not claim (or a full disk) takes no report: the one line says so and the
    stacks go to stderr, the one place left, instead of a traceback of the watchdog's thread."""
    seen = []
    with Watch(WatchdogConfig(hang_factor=3, min_s=0.3), tmp_path, 0, torch.device("cpu"), seen.append) as w:
        w.beat(1)
        deadline = time.monotonic() + 120
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
    err = capfd.readouterr().err
    assert len(seen) == 1 and "step 1 has run" in seen[0] and "cannot be written" in seen[0], seen
    assert "test_a_watchdog_report_that_cannot_be_written" in err and "Traceback" not in err
    assert not (tmp_path / "hang-rank0.txt").exists()


def test_fault_spec_errors_are_config_errors():
    assert parse("kill:step=3:rank=1, enospc:save=2")[1].save == 2
    for bad, frag in [
        ("explode:step=1", "unknown fault"),
        ("kill", "exactly one of"),
        ("kill:step=x", "must be a number"),
        ("kill:when=3", "expected step=N"),
    ]:
        with pytest.raises(ConfigError, match=frag):
            parse(bad)


def test_sigusr1_sets_the_stop_flag_and_handlers_are_restored(tmp_path):
    import signal

    before = signal.getsignal(signal.SIGUSR1)
    with Watch(WatchdogConfig(), tmp_path, 0, torch.device("cpu")) as w:
        assert not w.sync(False, torch.zeros(0))[0].stop
        os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's warning signal: the process must not die
        sync = w.sync(False, torch.zeros(0))[0]
        assert sync.stop and w.signal == "SIGUSR1" and sync.rank_s[0] >= 0
    assert signal.getsignal(signal.SIGUSR1) is before
