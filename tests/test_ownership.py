"""Ownership by content: a command replaces or deletes only bytes flopwise recorded when it
wrote them, in the folder the record was written for; never through a symlink; after resolving the
path it was given; one writer per folder. Each breach below was reproduced on the code before (the
before/after table is in the closing note); every case leaves the user's bytes as they were and ends
in one line, exit 2."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, tiny_overrides

CSV_IN = FIXTURES / "chinchilla_svg_extracted_data.csv"


def _main(argv: list, capsys, monkeypatch) -> tuple[int, str]:
    """`flopwise ARGV` in this process through cli.main: its exit code and stderr."""
    from flopwise.cli import main

    monkeypatch.setattr(sys, "argv", ["flopwise", *map(str, argv)])
    capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code or 0
    return code, capsys.readouterr().err


def _refused(code: int, err: str, *words: str) -> None:
    """Exit 2 with one error line, its last, holding `words`."""
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err and lines and lines[-1].startswith("error: "), (code, err)
    assert [ln for ln in lines if ln.startswith("error: ")] == lines[-1:], err
    assert all(w in lines[-1] for w in words), (words, lines[-1])


def _bytes(paths) -> dict:
    return {
        str(p): (
            os.readlink(p)
            if Path(p).is_symlink()
            else hashlib.sha256(Path(p).read_bytes()).hexdigest()
            if Path(p).is_file()
            else None
        )
        for p in paths
    }


def _user(p: Path, text: str = "a user's file\n") -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def _train(run: Path, data: Path, capsys, monkeypatch, steps: int = 2, **extra) -> tuple[int, str]:
    return _main(
        [
            "train",
            *tiny_overrides(
                run, data, **{"train.steps": steps, "checkpoint.interval": 2, "train.eval_every": 2, **extra}
            ),
        ],
        capsys,
        monkeypatch,
    )


@pytest.fixture(scope="module")
def made(tiny_run, tmp_path_factory) -> Path:
    """A finished tiny run (the session's, copied) and its HF export, outside any user folder (read,
    never written, by the tests)."""
    from flopwise.interop.convert import export_hf

    root = tmp_path_factory.mktemp("made")
    shutil.copytree(tiny_run(6), root / "run")
    export_hf(root / "run", root / "hf")
    return root


# --- 1. symlinks are never written through ------------------------------------------------------


def test_a_run_whose_files_are_symlinks_to_a_users_is_refused(tiny_data, tmp_path, capsys, monkeypatch):
    """Before: a resume overwrote or truncated the three user files the links pointed at, exit 0."""
    run = tmp_path / "run"
    code, err = _train(run, tiny_data, capsys, monkeypatch)
    assert code == 0, err
    mine = []
    for name in ("metrics.jsonl", "config.toml", "loss.png"):
        mine.append(
            _user(tmp_path / "mine" / name, '{"step": 1, "note": "mine"}\n' if name == "metrics.jsonl" else "mine\n")
        )
        (run / name).unlink()
        (run / name).symlink_to(mine[-1])
    before = _bytes(mine + [run / "metrics.jsonl"])
    code, err = _train(run, tiny_data, capsys, monkeypatch, steps=4)
    _refused(code, err, "symbolic link")
    assert _bytes(mine + [run / "metrics.jsonl"]) == before


def test_a_symlinked_checkpoints_folder_is_refused_and_nothing_in_it_deleted(tiny_data, tmp_path, capsys, monkeypatch):
    """Before: retention deleted a user's folders named like checkpoint temporaries through the link."""
    run = tmp_path / "run"
    code, err = _train(run, tiny_data, capsys, monkeypatch)
    assert code == 0, err
    mine = tmp_path / "mine"
    shutil.copytree(run / "checkpoints", mine)
    theirs = [_user(mine / "step-00000009.tmp" / "thesis.tex"), _user(mine / "step-x.tmp" / "notes.txt")]
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").symlink_to(mine)
    before = _bytes(theirs)
    code, err = _train(run, tiny_data, capsys, monkeypatch, steps=6, **{"checkpoint.keep": 1})
    _refused(code, err, "checkpoints", "symbolic link")
    assert _bytes(theirs) == before and (mine / "step-00000002").is_dir()


def test_retention_never_deletes_through_a_link(tmp_path):
    """The checkpoint layer itself (whatever the command before it checked): a symlinked
    checkpoints folder is refused, and a link named like a temporary is left alone."""
    from flopwise.checkpoints import checkpoint
    from flopwise.errors import CheckpointError

    run, mine = tmp_path / "run", tmp_path / "mine"
    _user(mine / "step-00000001.tmp" / "thesis.tex")
    run.mkdir()
    (run / "checkpoints").symlink_to(mine)
    with pytest.raises(CheckpointError, match="symbolic link"):
        checkpoint.prune(run, keep=1)
    (run / "checkpoints").unlink()
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "step-00000002.tmp").symlink_to(mine / "step-00000001.tmp")
    checkpoint.prune(run, keep=1)
    assert (mine / "step-00000001.tmp" / "thesis.tex").read_text() == "a user's file\n"


# --- 2. a path is resolved before it is checked -----------------------------------------------


def _dotdot(tmp_path: Path, name: str) -> Path:
    """tmp_path/t/missing/../NAME: the writer lands on t/NAME (it creates `missing` on the way)."""
    (tmp_path / "t").mkdir(exist_ok=True)
    return tmp_path / "t" / "missing" / ".." / name


DOTDOT = {  # command -> (argv given the target path, the user's files under t/ it would replace)
    "train": (
        lambda p, m, d: ["train", *tiny_overrides(p, d, **{"train.steps": 2})],
        "run",
        ["config.toml", "metrics.jsonl"],
    ),
    "data-prepare": (
        lambda p, m, d: ["data", "prepare", "builtin:alice", "--out", p, "--train-tokenizer", 300],
        "data",
        ["index.json", "notes.txt"],
    ),
    "data-mix": (
        lambda p, m, d: ["data", "mix", *tiny_overrides(p, "builtin:alice", **{"data.tokenizer": '"bpe:300"'})],
        "run",
        ["data/notes.txt"],
    ),
    "convert-to-hf": (lambda p, m, d: ["convert", "to-hf", m / "run", p], "hf", ["model.safetensors", "config.json"]),
    "convert-from-hf": (lambda p, m, d: ["convert", "from-hf", m / "hf", p, "--force"], "run", ["flopwise-run.json"]),
    "checkpoint-export": (
        lambda p, m, d: ["checkpoint", "export", m / "run", "--out", p, "--force"],
        "run",
        ["flopwise-run.json"],
    ),
    "out-config": (lambda p, m, d: ["scale", "optimal", "--flops", "1e15", "--out-config", p], "config.toml", [""]),
    "plan-out-config": (lambda p, m, d: ["plan", 'model.preset="demo-tiny"', "--out-config", p], "config.toml", [""]),
    "ids-out": (
        lambda p, m, d: ["data", "contamination", d, "--tasks", "alice-lastword", "--ids-out", p],
        "ids.json",
        [""],
    ),
    "calibrate-out": (lambda p, m, d: ["hardware", "calibrate", "--out", p], "hw.toml", [""]),
    "scale-fit-out": (lambda p, m, d: ["scale", "fit", CSV_IN, "--bootstrap", 0, "--out", p], "law.json", [""]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DOTDOT))
def test_a_path_through_a_missing_folder_and_back_is_checked_where_it_lands(
    name, made, tiny_data, tmp_path, capsys, monkeypatch
):
    """Before: `DIR/missing/../target` skipped every check (nothing "exists" at a path through a
    missing folder), and the writer, creating `missing`, replaced the user's files in DIR/target."""
    import flopwise.measure.calibrate

    monkeypatch.setattr(
        flopwise.measure.calibrate, "calibrate_device", lambda *a, **k: pytest.fail("measured before checking")
    )
    argv_of, target, rels = DOTDOT[name]
    mine = [_user(tmp_path / "t" / target / rel if rel else tmp_path / "t" / target) for rel in rels]
    before = _bytes(mine)
    code, err = _main(argv_of(_dotdot(tmp_path, target), made, tiny_data), capsys, monkeypatch)
    _refused(code, err)
    assert _bytes(mine) == before


def test_real_path_takes_dotdot_after_symlinks_and_keeps_a_final_link(tmp_path):
    """`..` after a symlinked folder climbs from where the link points (as the OS does); `~` is
    expanded; a last name linking to a folder is that folder (the user named it), one linking to
    a file stays as given, so the checks refuse it and nothing is written through it."""
    from flopwise.files.ownership import real_path

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "a" / "b")
    (tmp_path / "file-link").symlink_to(_user(tmp_path / "a" / "f"))
    assert real_path(tmp_path / "link" / ".." / "x") == tmp_path.resolve() / "a" / "x"
    assert real_path(tmp_path / "no" / "such" / ".." / ".." / "x") == tmp_path.resolve() / "x"
    assert real_path(tmp_path / "link") == tmp_path.resolve() / "a" / "b"
    assert real_path(tmp_path / "file-link") == tmp_path.resolve() / "file-link"
    assert real_path("~/x") == Path(os.path.expanduser("~")).resolve() / "x"


# --- 3. a record proves ownership by content, for its own folder only -------------------------


def _record_of(p: Path) -> dict:
    b = p.read_bytes()
    return {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}


def test_a_hand_written_data_manifest_deletes_nothing(tmp_path, capsys, monkeypatch):
    """Before: `data prepare` deleted what a hand-written manifest listed, unchecked entries and
    whole listed folders included."""
    d = tmp_path / "data"
    mine = [_user(d / "train-00000.bin"), _user(d / "work" / "logs" / "thesis.tex"), _user(d / "notes.txt")]
    (d / "manifest.json").write_text(
        json.dumps(
            {
                "format": "flopwise-data-manifest/1",
                "complete": False,
                "files": {"notes.txt": _record_of(mine[2])},
                "unchecked": ["train-00000.bin"],
                "folders": ["work/logs"],
            }
        )
    )
    before = _bytes(mine + [d / "manifest.json"])
    code, err = _main(["data", "prepare", "builtin:alice", "--out", d, "--train-tokenizer", 300], capsys, monkeypatch)
    _refused(code, err, "manifest.json", "does not prove")
    assert _bytes(mine + [d / "manifest.json"]) == before


def test_a_crafted_hf_manifest_does_not_make_a_users_weights_replaceable(made, tmp_path, capsys, monkeypatch):
    """Before: a manifest recording the user's model.safetensors (right size and sha256) let
    `convert to-hf` overwrite it."""
    hf = tmp_path / "hf"
    mine = _user(hf / "model.safetensors", "my weights\n")
    (hf / "flopwise-manifest.json").write_text(
        json.dumps(
            {
                "format": "flopwise-hf-manifest/1",
                "complete": True,
                "files": {"model.safetensors": _record_of(mine)},
                "unchecked": [],
                "folders": [],
            }
        )
    )
    code, err = _main(["convert", "to-hf", made / "run", hf], capsys, monkeypatch)
    _refused(code, err, "flopwise-manifest.json")
    assert mine.read_text() == "my weights\n"


@pytest.mark.parametrize("fmt", ["flopwise-run/1", "flopwise-run/2"])
def test_a_crafted_run_record_does_not_make_a_users_files_replaceable(fmt, tiny_data, tmp_path, capsys, monkeypatch):
    """Before: a run record naming metrics.jsonl and config.toml made `train` replace the user's."""
    run = tmp_path / "run"
    mine = [_user(run / "metrics.jsonl", '{"step": 1, "loss": 9}\n'), _user(run / "config.toml", "# my config\n")]
    (run / "flopwise-run.json").write_text(
        json.dumps(
            {
                "format": fmt,
                "writes": ["config.toml", "metrics.jsonl", "loss.png", "checkpoints"],
                "files": {p.name: _record_of(p) for p in mine},
            }
        )
    )
    before = _bytes(mine)
    code, err = _train(run, tiny_data, capsys, monkeypatch)
    _refused(code, err, "flopwise-run.json")
    assert _bytes(mine) == before


@pytest.mark.slow
@pytest.mark.parametrize("edit", [False, True])
def test_a_run_folder_copied_as_a_template_is_not_flopwises(edit, tiny_data, tmp_path, capsys, monkeypatch):
    """A run folder copied elsewhere carries a record whose hashes match the copied files: it still
    proves nothing, because a record proves only the folder it was written for (its real path, or
    the same folder by device and inode after a move). The copy, edited or not, is the user's."""
    a, b = tmp_path / "a", tmp_path / "b"
    code, err = _train(a, tiny_data, capsys, monkeypatch)
    assert code == 0, err
    shutil.copytree(a, b, symlinks=True)
    if edit:
        with open(b / "config.toml", "a") as f:
            f.write("# my template note\n")
    files = [b / n for n in ("config.toml", "metrics.jsonl", "loss.png", "flopwise-run.json")]
    before = _bytes(files)
    code, err = _train(b, tiny_data, capsys, monkeypatch, **{"checkpoint.resume": '"none"'})
    _refused(code, err, "flopwise-run.json", "written for", str(a))
    assert _bytes(files) == before
    a.rename(tmp_path / "moved")  # the same folder moved: still flopwise's, so it resumes
    code, err = _train(tmp_path / "moved", tiny_data, capsys, monkeypatch, steps=4)
    assert code == 0, err


@pytest.mark.slow
def test_a_run_file_changed_since_flopwise_wrote_it_is_refused(tiny_data, tmp_path, capsys, monkeypatch):
    """Content, not names: a config.toml the user edited in a run folder flopwise wrote is theirs."""
    run = tmp_path / "run"
    code, err = _train(run, tiny_data, capsys, monkeypatch)
    assert code == 0, err
    with open(run / "config.toml", "a") as f:
        f.write("# tuned by hand\n")
    before = _bytes([run / "config.toml"])
    code, err = _train(run, tiny_data, capsys, monkeypatch, steps=4)
    _refused(code, err, "config.toml", "changed since flopwise wrote it")
    assert _bytes([run / "config.toml"]) == before


@pytest.mark.parametrize("edit", ["same-size", "appended", "replaced"])
def test_a_log_edited_between_two_appends_of_one_process_is_refused(edit, tmp_path):
    """`append` skips re-reading a file its own process last appended to (its size, inode and mtime
    unchanged, the record naming the bytes it wrote): an edit in between, of the same size or not,
    or the file replaced, is still refused, and the user's bytes stay."""
    from flopwise.errors import ConfigError
    from flopwise.files import rundir

    run = rundir.claim(tmp_path / "run", ["metrics.jsonl"])
    log = run / "metrics.jsonl"
    for i in range(3):
        rundir.append(run, "metrics.jsonl", f'{{"step": {i}}}\n'.encode())
    time.sleep(0.01)  # a coarse file-system clock: the edit's mtime differs from the last append's
    body = log.read_bytes()
    if edit == "same-size":
        log.write_bytes(body.replace(b'"step": 1', b'"step": 7'))
    elif edit == "appended":
        log.write_bytes(body + b"# mine\n")
    else:
        log.unlink()
        log.write_bytes(body)  # the same bytes in a new file: flopwise's record still holds them
    mine = log.read_bytes()
    if edit == "replaced":
        rundir.append(run, "metrics.jsonl", b'{"step": 3}\n')  # the bytes are flopwise's: appended
        assert log.read_bytes() == mine + b'{"step": 3}\n'
        return
    with pytest.raises(ConfigError, match="metrics.jsonl has changed since flopwise wrote it"):
        rundir.append(run, "metrics.jsonl", b'{"step": 3}\n')
    assert log.read_bytes() == mine


def test_an_output_file_is_replaced_only_while_its_seal_verifies(tmp_path):
    """A file at a user-named path carries its own record (a seal over its real path and bytes): a
    rerun replaces it; an edited one, or one copied elsewhere, is refused."""
    from flopwise.errors import ConfigError
    from flopwise.files.outputs import is_ours, write_csv, write_json, write_text

    for write in (
        lambda p: write_text(p, "a = 1\n", "--out-config"),
        lambda p: write_json(p, {"a": 1}, "--out", "test"),
        lambda p: write_csv(p, ["a"], [[1]], "--out", "test"),
    ):
        p = write(tmp_path / "x")
        p = write(p)  # its own: replaced
        assert is_ours(p)
        shutil.copy(p, tmp_path / "copy")
        assert not is_ours(tmp_path / "copy")
        p.write_bytes(p.read_bytes().replace(b"1", b"2"))
        with pytest.raises(ConfigError, match="did not write"):
            write(p)
        p.unlink()


@pytest.mark.parametrize("name", ["config.toml", "flopwise-run.json"])
def test_a_users_file_hard_linked_at_a_temporary_name_is_not_written(name, tmp_path):
    """Before: every atomic write went through `.NAME.flopwise-tmp` opened with O_TRUNC, so a user's
    file hard-linked at that name was overwritten with flopwise's bytes and renamed over NAME."""
    from flopwise.files import claim, replace

    run = tmp_path / "run"
    claim(run, ["config.toml"])
    mine = _user(tmp_path / "thesis.tex", "my thesis\n")
    os.link(mine, run / f".{name}.flopwise-tmp")
    replace(run, "config.toml", b"lr = 1\n")
    assert mine.read_text() == "my thesis\n" and (run / f".{name}.flopwise-tmp").read_text() == "my thesis\n"
    assert (run / "config.toml").read_bytes() == b"lr = 1\n"
    umask = os.umask(0o022)
    os.umask(umask)
    assert (run / "config.toml").stat().st_mode & 0o777 == 0o666 & ~umask  # as open() made it, not mkstemp's 0600


def test_a_temporary_name_proves_nothing_by_its_name(tmp_path):
    """A file at the manifest's temporary name counts as flopwise's only if its content is the
    folder's manifest (a write cut short by a kill); a user's file there makes the folder theirs,
    so a replacing command refuses it rather than deleting it."""
    from flopwise.files import ManifestKind, file_record, why_not_ours, write_manifest

    kind = ManifestKind("manifest.json", "test-manifest/1")
    out = tmp_path / "data"
    _user(out / "index.json", "{}")
    write_manifest(out, kind, {"index.json": file_record(out / "index.json")}, complete=True)
    assert why_not_ours(out, kind) is None
    left = out / ".manifest.json.k3j9x0qa.flopwise-tmp"
    left.write_bytes((out / "manifest.json").read_bytes())  # what a kill during a rewrite leaves
    assert why_not_ours(out, kind) is None
    mine = _user(out / ".manifest.json.flopwise-tmp", "my notes\n")
    assert "which flopwise did not write" in (why_not_ours(out, kind) or "")
    assert mine.read_text() == "my notes\n"


# --- 4. one writer per folder -----------------------------------------------------------------

HOLD = """
import sys, time
from flopwise.files.ownership import folder_lock
with folder_lock(sys.argv[1], "test"):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """Start a process holding a folder's lock; stopped at the end."""
    procs = []

    def hold(folder: Path) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "held"
        procs.append(p)
        return p

    yield hold
    for p in procs:
        p.kill()
        p.wait()


LOCKED = {  # command -> (argv given the folder, the folder whose lock it takes)
    "train": lambda f, m, d: ["train", *tiny_overrides(f, d, **{"train.steps": 2})],
    "data-prepare": lambda f, m, d: ["data", "prepare", "builtin:alice", "--out", f, "--train-tokenizer", 300],
    "data-mix": lambda f, m, d: ["data", "mix", *tiny_overrides(f, "builtin:alice", **{"data.tokenizer": '"bpe:300"'})],
    "convert-to-hf": lambda f, m, d: ["convert", "to-hf", m / "run", f],
    "convert-from-hf": lambda f, m, d: ["convert", "from-hf", m / "hf", f],
    "checkpoint-export": lambda f, m, d: ["checkpoint", "export", m / "run", "--out", f],
}


@pytest.mark.parametrize("name", list(LOCKED))
def test_a_second_writer_of_a_folder_is_refused_naming_the_holder(
    name, made, tiny_data, tmp_path, holder, capsys, monkeypatch
):
    """Before: two `flopwise train` into one folder both ran; one finished with the other's
    learning rate in its config.toml and both runs' rows in its metrics."""
    folder = tmp_path / "out"
    folder.mkdir()
    p = holder(folder)
    code, err = _main(LOCKED[name](folder, made, tiny_data), capsys, monkeypatch)
    _refused(code, err, f"PID {p.pid}", "another flopwise process")
    assert sorted(x.name for x in folder.iterdir()) == [".flopwise.lock"]


def _gone_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    return gone.pid


@pytest.mark.slow
def test_a_stale_lock_is_taken_over_in_one_line(tiny_data, tmp_path, capsys, monkeypatch, caplog):
    """A lock left by a process that is gone (killed: the kernel released its flock, its file stays)
    is taken over, said in one log line naming it; the lock is gone when the command ends."""
    run = tmp_path / "run"
    run.mkdir()
    pid = _gone_pid()
    (run / ".flopwise.lock").write_text(f"flopwise lock, held by PID {pid}\n")
    code, err = _train(run, tiny_data, capsys, monkeypatch)
    assert code == 0, err
    said = [r.getMessage() for r in caplog.records if "taking over the lock" in r.getMessage()]
    assert said == [f"{run}: taking over the lock of flopwise process {pid}, which is gone"], said
    assert not (run / ".flopwise.lock").exists()


USERS_LOCK = {  # how a user's bytes come to be at DIR/.flopwise.lock
    "plain file": lambda lock, mine: lock.write_text("my notes, named oddly\n"),
    "hard link": lambda lock, mine: os.link(_user(mine, "my thesis\n"), lock),
    "hard link to a lock text": lambda lock, mine: os.link(
        _user(mine, f"flopwise lock, held by PID {_gone_pid()}\n"), lock
    ),
}


@pytest.mark.parametrize("how", list(USERS_LOCK))
@pytest.mark.parametrize("name", ["train", "data-prepare", "convert-to-hf"])
def test_a_users_file_at_the_lock_name_is_neither_truncated_nor_deleted(
    name, how, made, tiny_data, tmp_path, capsys, monkeypatch
):
    """Before: a user's file hard-linked (or simply present) at DIR/.flopwise.lock was truncated to a
    PID and then deleted, by `data prepare` even when it refused the folder."""
    folder = tmp_path / "out"
    folder.mkdir()
    USERS_LOCK[how](folder / ".flopwise.lock", tmp_path / "mine.txt")
    before = _bytes([folder / ".flopwise.lock", tmp_path / "mine.txt"])
    code, err = _main(LOCKED[name](folder, made, tiny_data), capsys, monkeypatch)
    _refused(code, err, str(folder / ".flopwise.lock"), "nothing was written")
    assert _bytes([folder / ".flopwise.lock", tmp_path / "mine.txt"]) == before
    assert sorted(x.name for x in folder.iterdir()) == [".flopwise.lock"]


def test_a_lock_removed_under_its_holder_is_noticed_and_nothing_else_deleted(tmp_path):
    """Before: `rm DIR/.flopwise.lock` let a second writer in beside the first, both exit 0. Now the
    holder's next write through the run record stops in one line; a file someone puts at the name
    afterwards is not deleted when the holder ends."""
    from flopwise.errors import ConfigError
    from flopwise.files import claim, folder_lock, lock_lost, replace

    run = tmp_path / "run"
    with folder_lock(run, "run.dir"):
        claim(run, ["notes.json"])
        replace(run, "notes.json", b"{}")
        assert lock_lost(run) is None
        (run / ".flopwise.lock").unlink()
        with pytest.raises(ConfigError, match="removed while this process held it") as e:
            replace(run, "notes.json", b'{"a": 1}')
        assert "\n" not in str(e.value)
        _user(run / ".flopwise.lock", "a user's file\n")
    assert (run / ".flopwise.lock").read_text() == "a user's file\n"
    assert (run / "notes.json").read_bytes() == b"{}"


def test_a_run_folder_moved_under_its_holder_is_named_as_moved(tmp_path):
    """Before: a run folder moved while training stopped with "metrics.jsonl was not claimed" (and
    its next write made an empty folder at the old path). Now one line says the folder moved, and
    nothing is made at the old path."""
    from flopwise.errors import ConfigError
    from flopwise.files import claim, folder_lock, replace

    run, moved = tmp_path / "run", tmp_path / "moved"
    with folder_lock(run, "run.dir"):
        claim(run, ["metrics.jsonl"])
        replace(run, "metrics.jsonl", b"{}\n")
        run.rename(moved)
        with pytest.raises(ConfigError, match="was moved or renamed while this process wrote it") as e:
            replace(run, "metrics.jsonl", b'{"step": 1}\n')
        assert "\n" not in str(e.value)
        assert not run.exists()
    assert (moved / "metrics.jsonl").read_bytes() == b"{}\n"


@pytest.mark.slow
def test_two_trains_started_a_second_apart(tiny_data, tmp_path):
    """The reported case, as two processes: the second stops in one line naming the first's PID; the
    first's config and metrics are its own."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "flopwise", "train"]
    first = subprocess.Popen(
        [*cmd, *tiny_overrides(run, tiny_data, **{"train.steps": 400})],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not (run / ".flopwise.lock").exists() and time.time() < deadline:
            time.sleep(0.2)
        second = subprocess.run(
            [*cmd, *tiny_overrides(run, tiny_data, **{"train.steps": 2, "optim.lr": 0.5})],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        first.kill()
        first.wait()
    _refused(second.returncode, second.stderr, f"PID {first.pid}")
    assert "lr = 0.5" not in (run / "config.toml").read_text() if (run / "config.toml").exists() else True
