"""Nothing lost, nothing cut: `checkpoint export --out RUN` and `convert from-hf HF RUN` add their
step beside the checkpoints already in RUN (never prune one; the same step number is refused in
one line unless --force), and a `.metadata` damaged in any field is refused in one line, so
`verify` refuses it, `latest` falls back to the previous checkpoint and `prune` goes on.

Before: exporting step 2 into a run with steps 1 and 7 deleted step 1; `convert from-hf` into a
run with steps 5 and 6 pruned the step 0 it had just written and printed a path that no longer
existed; an existing step of the same number was replaced without a word; a `.metadata` whose
tensor entry lacked `chunks` raised AttributeError from `verify()` (and from `latest()`)."""

import hashlib
import json
import os
import pickle

import pytest
import torch
from typer.testing import CliRunner

from flopwise.checkpoints import checkpoint
from flopwise.checkpoints.export import export_checkpoint
from flopwise.cli import app
from flopwise.config.schema import load_config, to_toml
from flopwise.errors import CheckpointError, ConfigError
from flopwise.files import rundir
from flopwise.model.transformer import build_model
from tests.conftest import tiny_overrides

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _cfg(tmp_path):
    return load_config(None, tiny_overrides(tmp_path / "run", tmp_path / "data"))


def _save(run, step, cfg, tmp_path, keep=2):
    """A checkpoint of a flopwise run folder (its `checkpoints` claimed, as `flopwise train` does)."""
    rundir.claim(run, ["checkpoints"])
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")  # copied, never parsed, by export
    return checkpoint.save(
        run,
        step,
        build_model(cfg.model, "cpu"),
        None,
        {"config": to_toml(cfg), "mine": step},
        files={"tokenizer.json": tok},
        keep=keep,
    )


def _steps(run) -> list[str]:
    return [p.name for p in checkpoint.list_complete(run)]


def _digest(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _one_line(e) -> bool:
    return bool(str(e)) and "\n" not in str(e)


# --- export / import into a run that already has checkpoints ------------------------------------


def test_export_adds_its_step_beside_the_runs_checkpoints(tmp_path):
    cfg = _cfg(tmp_path)
    src = _save(tmp_path / "src", 2, cfg, tmp_path)
    out = tmp_path / "dest"
    kept = {s: _digest(_save(out, s, cfg, tmp_path)) for s in (1, 7)}
    dest = export_checkpoint(src, out)
    assert dest == checkpoint.step_dir(out, 2) and dest.is_dir() and checkpoint.verify(dest) is None
    assert _steps(out) == ["step-00000001", "step-00000002", "step-00000007"]
    assert {s: _digest(checkpoint.step_dir(out, s)) for s in (1, 7)} == kept


def test_export_onto_an_existing_step_is_refused_unless_forced(tmp_path):
    cfg = _cfg(tmp_path)
    src = _save(tmp_path / "src", 2, cfg, tmp_path)
    out = tmp_path / "dest"
    before = _digest(_save(out, 2, cfg, tmp_path))
    with pytest.raises(CheckpointError, match="step-00000002 already exists.*--force") as e:
        export_checkpoint(src, out)
    assert _one_line(e.value)
    assert _digest(checkpoint.step_dir(out, 2)) == before
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]  # no .tmp left behind
    dest = export_checkpoint(src, out, force=True)
    assert checkpoint.verify(dest) is None and checkpoint.read_state(dest)["exported_from"] == str(src)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]


def test_export_never_takes_a_folder_it_did_not_write(tmp_path):
    """In a flopwise run, a step-N folder without a manifest is someone's, not a checkpoint: refused
    even with --force; a user's step-N.tmp beside it is neither reused nor deleted."""
    cfg = _cfg(tmp_path)
    src = _save(tmp_path / "src", 2, cfg, tmp_path)
    out = tmp_path / "dest"
    rundir.claim(out, ["checkpoints"])  # a flopwise run folder, in which someone left these
    mine = checkpoint.step_dir(out, 2)
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    scratch = mine.with_name(mine.name + ".tmp")
    scratch.mkdir()
    (scratch / "draft.txt").write_text("also mine")
    for force in (False, True):
        with pytest.raises(CheckpointError, match="not a flopwise checkpoint") as e:
            export_checkpoint(src, out, force=force)
        assert _one_line(e.value)
    (mine / "notes.txt").unlink()
    mine.rmdir()
    dest = export_checkpoint(src, out)
    assert checkpoint.verify(dest) is None and (scratch / "draft.txt").read_text() == "also mine"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002", "step-00000002.tmp"]


def test_export_and_import_refuse_a_checkpoints_folder_flopwise_did_not_write(tmp_path):
    """A user's `checkpoints/` (no flopwise-run.json claims it) is refused in one line, untouched;
    a new output folder is claimed, so `flopwise train run.dir=OUT` resumes what was written."""
    from flopwise.interop.convert import import_hf

    cfg = _cfg(tmp_path)
    src = _save(tmp_path / "src", 2, cfg, tmp_path)
    user = tmp_path / "user"
    (user / "checkpoints").mkdir(parents=True)
    (user / "checkpoints" / "notes.txt").write_text("mine")
    for write in (lambda: export_checkpoint(src, user), lambda: import_hf(_tiny_hf(tmp_path / "hf"), user)):
        with pytest.raises(ConfigError, match="checkpoints") as e:
            write()
        assert _one_line(e.value)
    assert [p.name for p in user.rglob("*")] == ["checkpoints", "notes.txt"]
    fresh = tmp_path / "fresh"
    export_checkpoint(src, fresh)
    assert "checkpoints" in rundir.claimed(fresh)
    from flopwise.train.build import TRAIN_WRITES

    rundir.claim(fresh, TRAIN_WRITES)  # what `flopwise train run.dir=fresh` claims first: accepted


def _tiny_hf(folder):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )
    model.save_pretrained(folder)
    return folder


def test_import_hf_adds_step_0_beside_the_runs_checkpoints(tmp_path):
    from flopwise.interop.convert import import_hf

    hf = _tiny_hf(tmp_path / "hf")
    cfg = _cfg(tmp_path)
    out = tmp_path / "run"
    kept = {s: _digest(_save(out, s, cfg, tmp_path)) for s in (5, 6)}
    ckpt = import_hf(hf, out)
    assert ckpt == checkpoint.step_dir(out, 0) and ckpt.is_dir() and checkpoint.verify(ckpt) is None
    assert _steps(out) == ["step-00000000", "step-00000005", "step-00000006"]
    assert {s: _digest(checkpoint.step_dir(out, s)) for s in (5, 6)} == kept
    before = _digest(ckpt)
    with pytest.raises(CheckpointError, match="step-00000000 already exists.*--force") as e:
        import_hf(hf, out)
    assert _one_line(e.value) and _digest(ckpt) == before
    again = import_hf(hf, out, force=True)
    assert again == ckpt and checkpoint.verify(again) is None
    assert _steps(out) == ["step-00000000", "step-00000005", "step-00000006"]


def test_the_cli_prints_paths_that_exist_and_refuses_in_one_line(tmp_path):
    hf = _tiny_hf(tmp_path / "hf")
    cfg = _cfg(tmp_path)
    out = tmp_path / "run"
    for s in (5, 6):
        _save(out, s, cfg, tmp_path)
    runner = CliRunner()
    r = runner.invoke(app, ["convert", "from-hf", str(hf), str(out)], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    printed = r.output.split("wrote ", 1)[1].split()[0]
    assert os.path.isdir(printed) and _steps(out) == ["step-00000000", "step-00000005", "step-00000006"]
    r = runner.invoke(app, ["convert", "from-hf", str(hf), str(out)])
    assert r.exit_code != 0 and isinstance(r.exception, CheckpointError) and "--force" in str(r.exception)
    r = runner.invoke(app, ["convert", "from-hf", str(hf), str(out), "--force"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output

    r = runner.invoke(
        app,
        ["checkpoint", "export", str(checkpoint.step_dir(out, 5)), "--out", str(tmp_path / "exp")],
        env={"COLUMNS": "400"},
    )
    assert r.exit_code == 0, r.output
    assert checkpoint.step_dir(tmp_path / "exp", 5).is_dir()
    r = runner.invoke(app, ["checkpoint", "export", str(checkpoint.step_dir(out, 5)), "--out", str(out)])
    assert r.exit_code != 0 and isinstance(r.exception, CheckpointError) and "--force" in str(r.exception)
    r = runner.invoke(
        app,
        ["checkpoint", "export", str(checkpoint.step_dir(out, 0)), "--out", str(tmp_path / "exp")],
        env={"COLUMNS": "400"},
    )
    assert r.exit_code == 0, r.output
    # step 0 sits below step 5 there: the hint names the folder to resume from, not run.dir
    assert "checkpoint.resume=" in r.output and _steps(tmp_path / "exp") == ["step-00000000", "step-00000005"]


# --- damaged DCP metadata: refused, never an AttributeError ---------------------------------------


def _rewrite_metadata(ckpt, mutate) -> None:
    """Change `.metadata` as objects (the test's own file: trusted) and re-sign it in the manifest,
    so the damage reaches the metadata reader instead of the checksum."""
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    mutate(md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][".metadata"] = {
        "bytes": (ckpt / ".metadata").stat().st_size,
        "sha256": checkpoint._sha256(ckpt / ".metadata"),
    }
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _entry(md):
    return md.state_dict_metadata[sorted(md.state_dict_metadata)[0]]


def _storage(md):
    return next(iter(md.storage_data.values()))


DAMAGE = {
    "entry-without-chunks": lambda md: delattr(_entry(md), "chunks"),
    "entry-without-size": lambda md: delattr(_entry(md), "size"),
    "entry-without-properties": lambda md: delattr(_entry(md), "properties"),
    "chunks-a-tuple": lambda md: setattr(_entry(md), "chunks", tuple(_entry(md).chunks)),
    "chunk-without-offsets": lambda md: delattr(_entry(md).chunks[0], "offsets"),
    "size-a-string": lambda md: setattr(_entry(md), "size", "32"),
    "size-of-floats": lambda md: setattr(_entry(md), "size", (2.0,) * len(_entry(md).size)),
    "size-of-bools": lambda md: setattr(_entry(md), "size", (True,) * len(_entry(md).size)),
    "dtype-a-string": lambda md: setattr(_entry(md).properties, "dtype", "float32"),
    "dtype-none": lambda md: setattr(_entry(md).properties, "dtype", None),
    "dtype-quantized": lambda md: setattr(_entry(md).properties, "dtype", torch.qint8),
    "chunk-stored-nowhere": lambda md: md.storage_data.pop(next(iter(md.storage_data))),
    "chunk-stored-in-too-few-bytes": lambda md: setattr(_storage(md), "length", 4),
    "storage-without-offset": lambda md: delattr(_storage(md), "offset"),
    "storage-offset-a-string": lambda md: setattr(_storage(md), "offset", "0"),
    "storage-length-negative": lambda md: setattr(_storage(md), "length", -1),
    "storage-meta-a-size": lambda md: setattr(md, "storage_meta", torch.Size([1])),
    "storage-key-not-an-index": lambda md: setattr(md, "storage_data", {"x": list(md.storage_data.values())[-1]}),
    "planner-path-a-string": lambda md: md.planner_data.__setitem__(sorted(md.planner_data)[0], "model"),
    "entries-key-not-a-string": lambda md: md.state_dict_metadata.__setitem__(
        7, md.state_dict_metadata.pop(sorted(md.state_dict_metadata)[0])
    ),
    "metadata-without-storage-data": lambda md: delattr(md, "storage_data"),
}


@pytest.fixture
def two_steps(tmp_path):
    cfg = _cfg(tmp_path)
    run = tmp_path / "run"
    first, second = (_save(run, s, cfg, tmp_path) for s in (1, 2))
    return run, first, second


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_metadata_is_refused_and_latest_falls_back(two_steps, damage):
    run, first, second = two_steps
    _rewrite_metadata(second, DAMAGE[damage])
    why = checkpoint.verify(second)
    assert isinstance(why, str) and ".metadata" in why and "\n" not in why
    with pytest.raises(CheckpointError) as e:
        checkpoint.read_dcp_metadata(second)
    assert _one_line(e.value)
    assert checkpoint.latest(run, verify_checksums=False) == first  # checkpoint.verify="size"
    assert checkpoint.latest(run) == first
    checkpoint.prune(run, 1)  # retention skips the damaged folder; it does not crash
    assert first.is_dir()


def test_metadata_is_scanned_once_per_content_and_again_once_it_changes(two_steps, tmp_path, monkeypatch):
    """A resume reads `.metadata` several times (latest's verify, the load's own read, DCP's reader);
    the pure-Python opcode walk runs once per content (before: once per read). Bytes that change
    under the same path are walked again and refused."""
    run, first, second = two_steps
    walked: list[int] = []
    walk = checkpoint._scan_pickle
    monkeypatch.setattr(checkpoint, "_scan_pickle", lambda raw: (walked.append(len(raw)), walk(raw))[-1])
    monkeypatch.setattr(checkpoint, "_SOUND_METADATA", set())  # this process's earlier reads aside
    model = build_model(_cfg(tmp_path).model, "cpu")
    assert checkpoint.latest(run) == second
    checkpoint.load(second, model)
    checkpoint.read_dcp_metadata(second)
    assert walked == [(second / ".metadata").stat().st_size]
    _rewrite_metadata(second, DAMAGE["chunk-stored-nowhere"])
    with pytest.raises(CheckpointError, match="stored nowhere"):
        checkpoint.read_dcp_metadata(second)
    assert len(walked) == 2
    assert checkpoint.latest(run) == first


def test_a_system_error_from_the_unpickler_is_a_refusal(two_steps, monkeypatch):
    """Whatever a damaged stream makes the unpickler raise (SystemError included) is a refusal."""
    run, first, second = two_steps

    def boom(self):
        raise SystemError("deallocated bytearray object has exported buffers")

    monkeypatch.setattr(checkpoint._MetadataUnpickler, "load", boom)
    with pytest.raises(CheckpointError, match="refused") as e:
        checkpoint.read_dcp_metadata(second)
    assert _one_line(e.value)


def test_a_bytearray_opcode_is_refused_before_the_unpickler_allocates_it(two_steps, capsys):
    """One bit turns MEMOIZE (0x94) into BYTEARRAY8 (0x96): the next 8 bytes become a length of
    petabytes. Before: CPython 3.11 failed that allocation and freed the half-built bytearray with
    its export count unset, printing (on some machines raising) "SystemError: deallocated
    bytearray object has exported buffers". After: the opcode is refused before anything is built."""
    import pickletools

    run, first, second = two_steps
    raw = (second / ".metadata").read_bytes()
    pos = next(
        p
        for op, _, p in pickletools.genops(raw)
        if op.name == "MEMOIZE" and int.from_bytes(raw[p + 1 : p + 9], "little") > 2**40
    )
    flipped = raw[:pos] + bytes([raw[pos] ^ 0x02]) + raw[pos + 1 :]
    (second / ".metadata").write_bytes(flipped)  # re-signed, as an attacker would
    manifest = json.loads((second / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"bytes": len(flipped), "sha256": checkpoint._sha256(second / ".metadata")}
    (second / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    for _ in range(5):  # the unset count is whatever memory held: try more than once
        with pytest.raises(CheckpointError, match="(?i)bytearray8") as e:
            checkpoint.read_dcp_metadata(second)
        assert _one_line(e.value)
        assert checkpoint.latest(run, verify_checksums=False) == first
    assert "SystemError" not in capsys.readouterr().err


# --- user-testing follow-up: failed or refused writes leave nothing behind ---------------------


def test_convert_from_hf_of_a_damaged_folder_writes_nothing(tmp_path):
    """Before: `convert from-hf BAD OUT` with a truncated safetensors file failed after claiming
    OUT, leaving OUT/flopwise-run.json (and the folder) behind."""
    from flopwise.interop.convert import import_hf

    hf = _tiny_hf(tmp_path / "hf")
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = tmp_path / "out"
    with pytest.raises((CheckpointError, ConfigError)) as e:
        import_hf(hf, out)
    assert _one_line(e.value) and not out.exists()
    run = tmp_path / "run"  # a flopwise run folder keeps exactly what it had
    cfg = _cfg(tmp_path)
    _save(run, 3, cfg, tmp_path)
    before = {p.relative_to(run).as_posix(): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises((CheckpointError, ConfigError)):
        import_hf(hf, run)
    assert {p.relative_to(run).as_posix(): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_checkpoint_writes_under_a_file_are_one_line_naming_the_option(tmp_path):
    """Before: a run folder, --out or OUT under an existing file ended in NotADirectoryError /
    FileExistsError tracebacks (train's claim, export, from-hf). Paths under a file are what stop
    root, which these tests run as (chmod does not)."""
    from flopwise.interop.convert import import_hf

    cfg = _cfg(tmp_path)
    src = _save(tmp_path / "src", 2, cfg, tmp_path)
    hf = _tiny_hf(tmp_path / "hf")
    blocker = tmp_path / "afile"
    blocker.write_text("mine")
    for write, option in (
        (lambda: rundir.claim(blocker / "run", ["checkpoints"]), "run.dir"),
        (lambda: export_checkpoint(src, blocker / "run"), "--out"),
        (lambda: import_hf(hf, blocker / "run"), "OUT"),
    ):
        with pytest.raises(ConfigError, match=f"^{option} .*afile is a file, not a folder") as e:
            write()
        assert _one_line(e.value)
    assert blocker.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "hf", "src", "tokenizer.json"]


def test_a_ctrl_c_during_the_write_stops_the_run_and_leaves_no_folder(tmp_path):
    """A second Ctrl-C landing inside DCP's write (which wraps it, like any failure, in a
    CheckpointException) is a KeyboardInterrupt again, not "checkpoint not written ... free space"
    (a CheckpointError with the wrong advice, seen under `pytest -n 2`); the half-written folder is
    removed either way."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Interrupted(FileSystemWriter):
        def write_data(self, plan, planner):
            raise KeyboardInterrupt

    model = torch.nn.Linear(4, 4)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.begin(tmp_path, 1, model, None, Interrupted)
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


# --- retention and resume by content, not by the name step-* --------------------------------------


def _tree(root) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file()
    }


def test_retention_deletes_only_what_a_manifest_of_this_run_lists(tmp_path, caplog):
    """Before: retention deleted a user's `step-00000003.keep/` and `step-00000006-before-lr-change/`
    (copies of real checkpoints) and a `my-eval.json` inside a real step folder, without a word."""
    import shutil

    cfg, run = _cfg(tmp_path), tmp_path / "run"
    root = run / "checkpoints"
    _save(run, 3, cfg, tmp_path, keep=None)
    _save(run, 6, cfg, tmp_path, keep=None)
    shutil.copytree(root / "step-00000003", root / "step-00000003.keep")
    shutil.copytree(root / "step-00000006", root / "step-00000006-before-lr-change")
    (root / "step-00000003" / "my-eval.json").write_text('{"acc": 0.5}')
    (root / "step-00000004.tmp").mkdir()  # a user's folder named like a partial write
    (root / "step-00000004.tmp" / "notes.txt").write_text("mine")
    mine = {k: v for k, v in _tree(root).items() if not k.startswith(("step-00000003/", "step-00000006/"))}
    mine["step-00000003/my-eval.json"] = _tree(root)["step-00000003/my-eval.json"]
    _save(run, 9, cfg, tmp_path, keep=1)
    _save(run, 12, cfg, tmp_path, keep=1)
    assert {k: v for k, v in _tree(root).items() if k in mine} == mine
    assert sorted(p.name for p in (root / "step-00000003").iterdir()) == ["my-eval.json"]
    assert not (root / "step-00000006").exists() and not (root / "step-00000009").exists()
    assert checkpoint.latest(run, own=True) == checkpoint.step_dir(run, 12)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoints: ")]
    named = ("step-00000003 left in place", "step-00000003.keep is not", "before-lr-change is not", ".tmp is not")
    assert all(sum(n in m for m in said) == 1 for n in named), said  # each named, once


def test_a_copy_named_like_a_step_or_from_another_run_is_never_the_resume_point(tmp_path, caplog):
    """Before: a user's `step-00000006-before-lr-change/` became the resume point (it sorts after
    step-00000003), as did a step folder copied in from another run."""
    import shutil

    cfg, run = _cfg(tmp_path), tmp_path / "run"
    _save(run, 3, cfg, tmp_path)
    other = _save(tmp_path / "other", 9, cfg, tmp_path)
    shutil.copytree(checkpoint.step_dir(run, 3), run / "checkpoints" / "step-00000006-before-lr-change")
    shutil.copytree(other, run / "checkpoints" / "step-00000009")
    said: list[str] = []
    assert checkpoint.resume_point(run, True, said.append) == checkpoint.step_dir(run, 3)
    assert said == [
        "skipping damaged checkpoint step-00000009 (written for another run folder, or before "
        "checkpoints named their run (checkpoint.resume=PATH reads it)); using step-00000003"
    ]
    assert any("before-lr-change is not a flopwise checkpoint" in r.getMessage() for r in caplog.records)


def test_when_no_checkpoint_verifies_resume_stops_naming_each_and_why(tmp_path, monkeypatch):
    """Before: checkpoint.resume=auto started from scratch in the same folder (exit 0) when no
    checkpoint verified, then replaced them; an unreadable shard was reported as "missing"."""
    cfg, run = _cfg(tmp_path), tmp_path / "run"
    for s in (3, 6):
        _save(run, s, cfg, tmp_path, keep=None)
    shard = next((checkpoint.step_dir(run, 6)).glob("__*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # recoverable bytes, but not the ones written
    shard.write_bytes(bytes(data))
    real = checkpoint._sha256
    flaky = checkpoint.step_dir(run, 3) / shard.name

    def read(path):
        if path == flaky:
            raise OSError(5, "Input/output error")  # a transient read failure
        return real(path)

    monkeypatch.setattr(checkpoint, "_sha256", read)
    before = _tree(run)
    with pytest.raises(CheckpointError) as e:
        checkpoint.resume_point(run, True, lambda msg: None)
    msg = str(e.value)
    assert _one_line(e.value) and "checkpoint.resume=none" in msg and "new run.dir" in msg, msg
    assert f"step-00000006: {shard.name} fails its sha256 checksum" in msg, msg
    assert f"step-00000003: {shard.name} unreadable (Input/output error)" in msg, msg
    assert _tree(run) == before
    assert checkpoint.resume_point(tmp_path / "new", True, lambda msg: None) is None  # nothing there: a fresh start


@pytest.mark.slow
def test_train_never_silently_restarts_over_checkpoints_that_fail(tmp_path, tiny_data, capsys, monkeypatch):
    """The reported case end to end: both checkpoints of a run damaged, `flopwise train` again with
    checkpoint.resume=auto stops in one line, exit 2, and leaves the run folder as it was."""
    from tests.conftest import run_main

    run = tmp_path / "run"
    args = ["train", *tiny_overrides(run, tiny_data, **{"train.steps": 4, "checkpoint.interval": 2})]
    code, err = run_main(args, capsys, monkeypatch)
    assert code == 0, err
    for step in (2, 4):
        shard = next(checkpoint.step_dir(run, step).glob("__*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    before = _tree(run)
    args = ["train", *tiny_overrides(run, tiny_data, **{"train.steps": 6, "checkpoint.interval": 2})]
    code, err = run_main(args, capsys, monkeypatch)
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err and lines[-1].startswith("error: "), err
    assert "step-00000004: " in lines[-1] and "step-00000002: " in lines[-1] and "checksum" in lines[-1]
    assert _tree(run) == before
