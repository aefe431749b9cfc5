"""Nothing lost: every command that writes, pointed at a folder of a user's files (some named as
flopwise's own outputs are: index.json, config.json, step-N, metrics.jsonl ...), leaves each of
those files byte for byte as it was, whatever the command's exit code."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flopwise.errors import ConfigError
from tests.conftest import FIXTURES, run_main, tiny_overrides

# a user's files, several named as what flopwise writes
SENTINELS = [
    "index.json",
    "config.json",
    "tokenizer.json",
    "config.toml",
    "metrics.jsonl",
    "manifest.json",
    "report.json",
    "recipe.json",
    "loss.png",
    "fit.png",
    "model.safetensors",
    "state.json",
    "prediction.json",
    "ids.json",
    "step-5",
    "train-00000.bin",
    "notes.txt",
    "src/thesis.tex",
    "checkpoints/step-00000001/notes.txt",
    "checkpoints/step-00000002",
    "checkpoints/step-00000003.tmp",
    "data/index.json",
    "data/notes.txt",
    "hf/config.json",
    "hf/model.safetensors",
    "ladder/notes.txt",
    "ladder/index.json",
]


def seed_user_tree(root: Path) -> dict[str, str]:
    """Sentinel files under `root`; returns {relative path: sha256}."""
    for i, rel in enumerate(SENTINELS):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(f"a user's {rel}, #{i}: not flopwise's\n".encode() * (i + 1))
    return hashes(root)


def hashes(root: Path) -> dict[str, str]:
    return {
        rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() if (root / rel).is_file() else "missing"
        for rel in SENTINELS
    }


@pytest.fixture(scope="module")
def trained(tiny_run, tmp_path_factory) -> Path:
    """A finished tiny run (2 checkpoints) and its HF export, made outside any user folder: a copy of
    the session's run, so a command that wrote into it could not reach the shared one."""
    from flopwise.interop.convert import export_hf

    root = tmp_path_factory.mktemp("made")
    shutil.copytree(tiny_run(6), root / "run")
    export_hf(root / "run", root / "hf")
    return root


def commands(u: Path, made: Path, data: Path) -> dict[str, list]:
    """Each writing command, aimed at the user's folder `u`."""
    return {
        "train": ["train", *tiny_overrides(u, data, **{"train.steps": 2, "checkpoint.interval": 1})],
        "train-prepares-data": [
            "train",
            *tiny_overrides(u, "builtin:alice", **{"train.steps": 1, "data.tokenizer": '"bpe:300"'}),
        ],
        "data-prepare": ["data", "prepare", "builtin:alice", "--out", u, "--train-tokenizer", 300],
        "data-contamination": ["data", "contamination", data, "--tasks", "alice-lastword", "--ids-out", u / "ids.json"],
        "checkpoint-export": ["checkpoint", "export", made / "run", "--out", u],
        "convert-to-hf": ["convert", "to-hf", made / "run", u / "hf"],
        "convert-from-hf": ["convert", "from-hf", made / "hf", u],
        "generate": ["generate", made / "run", "--prompt", "Alice", "--max-new-tokens", 4],
        "plan-out-config": [
            "plan",
            'model.preset="demo-tiny"',
            "--out-config",
            u / "config.toml",
            "--plot",
            u / "loss.png",
        ],
        "scale-fit": [
            "scale",
            "fit",
            FIXTURES / "chinchilla_svg_extracted_data.csv",
            "--bootstrap",
            0,
            "--out",
            u / "ids.json",
            "--plots",
            u,
        ],
        "scale-optimal-out-config": ["scale", "optimal", "--flops", "1e15", "--out-config", u / "config.toml"],
    }


SLOW = {  # multi-process or long: the slow set
    "scale-sweep": lambda u, made, data: ["scale", "sweep", "--out", u / "ladder", "--budgets", "2e10", "--sizes", 2],
    "plan-measure": lambda u, made, data: [
        "plan",
        "measure",
        *tiny_overrides(u / "measure", data),
        "--nproc",
        1,
        "--steps",
        1,
    ],
}


def _check(name: str, argv_of, trained: Path, tiny_data: Path, tmp_path: Path, cli, monkeypatch) -> None:
    u = tmp_path / "user"
    before = seed_user_tree(u)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # plan measure's ranks: the env each command had in its own process
    out = cli(*argv_of(u, trained, tiny_data), cwd=u)
    after = hashes(u)
    changed = {k for k in before if before[k] != after[k]}
    assert not changed, (
        f"{name} (exit {out.returncode}) changed {sorted(changed)}: {out.stdout[-800:]}{out.stderr[-800:]}"
    )
    assert "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("name", list(commands(Path("u"), Path("m"), Path("d"))))
def test_a_writing_command_leaves_every_user_file_intact(name, trained, tiny_data, tmp_path, cli, monkeypatch):
    _check(name, lambda u, made, data: commands(u, made, data)[name], trained, tiny_data, tmp_path, cli, monkeypatch)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(SLOW))
def test_a_slow_writing_command_leaves_every_user_file_intact(name, trained, tiny_data, tmp_path, cli, monkeypatch):
    _check(name, SLOW[name], trained, tiny_data, tmp_path, cli, monkeypatch)


# --- the same property where the checks once looked at names and places ---------------------
# symlinks: every user file is a link to one outside (written through before); dotdot: the folder is
# named through a folder that does not exist and back (DIR/missing/../user: checks skipped before);
# crafted: the folder holds records written by hand that list the user's files with their right
# sizes and hashes (trusted by their presence before); locked: another process holds the folders'
# locks. In each, every user byte must stay as it was, and nothing ends in a traceback.
VARIANTS = ("symlinks", "dotdot", "crafted", "locked")
HOLD = """
import contextlib, sys, time
from flopwise.files.ownership import folder_lock
with contextlib.ExitStack() as held:
    for f in sys.argv[1:]:
        held.enter_context(folder_lock(f, "test"))
    print("held", flush=True)
    time.sleep(600)
"""


def _record(p: Path) -> dict:
    return {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}


def _craft(u: Path) -> None:
    """Hand-written records in `u` that claim the user's files (what a copied or forged record says)."""
    rel = [r for r in SENTINELS if (u / r).is_file()]
    (u / "manifest.json").write_text(
        json.dumps(
            {
                "format": "flopwise-data-manifest/1",
                "complete": False,
                "files": {},
                "unchecked": rel,
                "folders": ["checkpoints", "src", "data", "hf", "ladder"],
            }
        )
    )
    (u / "flopwise-run.json").write_text(
        json.dumps(
            {
                "format": "flopwise-run/2",
                "writes": ["config.toml", "metrics.jsonl", "loss.png", "checkpoints", "data"],
                "files": {n: _record(u / n) for n in ("config.toml", "metrics.jsonl", "loss.png")},
            }
        )
    )
    (u / "hf" / "flopwise-manifest.json").write_text(
        json.dumps(
            {
                "format": "flopwise-hf-manifest/1",
                "complete": True,
                "unchecked": [],
                "folders": [],
                "files": {n: _record(u / "hf" / n) for n in ("config.json", "model.safetensors")},
            }
        )
    )


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(commands(Path("u"), Path("m"), Path("d"))))
def test_no_writing_command_loses_a_user_byte_through_links_paths_records_or_a_second_writer(
    name, variant, trained, tiny_data, tmp_path, cli
):
    u = tmp_path / "user"
    holder = None
    if variant == "symlinks":
        outside = tmp_path / "outside"
        seed_user_tree(outside)
        for rel in SENTINELS:
            (u / rel).parent.mkdir(parents=True, exist_ok=True)
            (u / rel).symlink_to(outside / rel)
        before, watched = hashes(outside), outside
    else:
        seed_user_tree(u)
        if variant == "crafted":
            _craft(u)
        before, watched = hashes(u), u
    links = {rel: os.readlink(u / rel) for rel in SENTINELS if (u / rel).is_symlink()}
    if variant == "locked":
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD, u, u / "hf", u / "data", u / "ladder"], stdout=subprocess.PIPE, text=True
        )
        assert holder.stdout.readline().strip() == "held"
    given = tmp_path / "missing" / ".." / "user" if variant == "dotdot" else u
    try:
        out = cli(*commands(given, trained, tiny_data)[name], cwd=tmp_path)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    changed = {k for k, v in hashes(watched).items() if before[k] != v}
    assert not changed, f"{name}/{variant} (exit {out.returncode}) changed {sorted(changed)}: {out.stderr[-800:]}"
    assert links == {rel: os.readlink(u / rel) for rel in links if (u / rel).is_symlink()}
    assert "Traceback" not in out.stderr, out.stderr[-2000:]


def test_to_hf_replaces_only_a_folder_it_exported(trained, tmp_path, cli):
    """A second export into its own folder replaces it; once the user adds or changes a file there,
    the folder is theirs and the export is refused in one line, with their files intact."""
    hf = tmp_path / "hf"
    for _ in range(2):
        out = cli("convert", "to-hf", trained / "run", hf, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
    (hf / "README.md").write_text("my model card")
    out = cli("convert", "to-hf", trained / "run", hf, cwd=tmp_path)
    assert out.returncode == 2 and "README.md" in out.stderr and "Traceback" not in out.stderr
    assert (hf / "README.md").read_text() == "my model card"


# --- user-testing follow-up: each breach below was reproduced before its fix ---------------------


def _one_line_exit_2(code: int, err: str, *words: str) -> None:
    """The command failed with exit 2 and one error line, its last (a progress line may precede it)."""
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err and lines[-1].startswith("error: "), (code, err)
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], err
    assert all(w in lines[-1] for w in words), (words, lines[-1])


def _ladder_base(tmp_path, data):
    from flopwise.config.schema import load_config

    return load_config(
        None, tiny_overrides(tmp_path / "base", data, **{"train.global_batch": 8, "train.micro_batch": 8})
    )


def test_scale_sweep_replaces_its_own_configs_and_table_but_never_a_users(tiny_data, tmp_path, capsys, monkeypatch):
    """Before: `scale sweep --out DIR` (and --emit) overwrote the user's DIR/runs.csv and
    DIR/configs/NAME.toml, and wrote configs without flopwise's mark."""
    from flopwise.files.outputs import TOML_HEADER
    from flopwise.scale.fit import read_points
    from flopwise.train.ladder import collect, plan_ladder, run_ladder

    out = tmp_path / "ladder"
    argv = [
        "scale",
        "sweep",
        *tiny_overrides(tmp_path / "base", tiny_data),
        "--budgets",
        "2e9",
        "--sizes",
        2,
        "--out",
        out,
        "--emit",
    ]
    for _ in range(2):  # the second run replaces the first's configs
        code, err = run_main(argv, capsys, monkeypatch)
        assert code == 0, err
    configs = sorted((out / "configs").iterdir())
    assert configs and all(p.read_text().startswith(TOML_HEADER) for p in configs)
    configs[-1].write_text("# my own ladder config\n")
    code, err = run_main(argv, capsys, monkeypatch)
    _one_line_exit_2(code, err, "--out", configs[-1].name)
    assert configs[-1].read_text() == "# my own ladder config\n"

    base = _ladder_base(tmp_path, tiny_data)
    mine = tmp_path / "mine"
    runs = plan_ladder(base, [2e9], sizes=2, spread=4.0, out=mine)
    (mine).mkdir()
    (mine / "runs.csv").write_text("my,own,table\n")
    with pytest.raises(ConfigError, match="--out .*runs.csv"):
        run_ladder(base, runs, mine)
    assert sorted(p.name for p in mine.iterdir()) == ["runs.csv"]  # refused before any data or training
    assert (mine / "runs.csv").read_text() == "my,own,table\n"

    theirs = tmp_path / "theirs"  # flopwise's own table is replaced, and `scale fit` reads it
    for r in runs:
        Path(r.config.run.dir).mkdir(parents=True)
        (Path(r.config.run.dir) / "metrics.jsonl").write_text(json.dumps({"step": r.steps, "val_loss": 3.5}) + "\n")
    for _ in range(2):
        table = collect(runs, theirs)
    pts = read_points(table)
    assert sorted(pts.params.tolist()) == sorted(r.params for r in runs) and set(pts.loss.tolist()) == {3.5}


def test_scale_sweep_refuses_a_budget_below_one_step(tiny_data, tmp_path, capsys, monkeypatch):
    """Before: `--budgets 1e3` gave steps=1, a run of ~1e8 FLOPs against a budget of 1e3."""
    from flopwise.train.ladder import plan_ladder

    out = tmp_path / "ladder"
    code, err = run_main(
        [
            "scale",
            "sweep",
            *tiny_overrides(tmp_path / "base", tiny_data),
            "--budgets",
            "1e3,2e9",
            "--out",
            out,
            "--emit",
        ],
        capsys,
        monkeypatch,
    )
    _one_line_exit_2(code, err, "--budgets", "smallest budget")
    assert not out.exists()
    smallest = float(err.split("smallest budget that gives each size a step is ")[1].split()[0])
    base = _ladder_base(tmp_path, tiny_data)
    runs = plan_ladder(base, [smallest], sizes=5, spread=8.0, out=out)
    tokens_per_step = base.train.global_batch * base.data.seq_len
    assert runs and all(r.steps >= 1 and 6 * r.params * tokens_per_step <= smallest for r in runs)


@pytest.mark.parametrize(
    "name",
    [
        "plan-out-config",
        "plan-plot",
        "scale-fit-out",
        "scale-fit-plots",
        "predict-task",
        "contamination",
        "calibrate",
        "data-prepare",
        "train",
        "sweep-emit",
        "sweep",
        "to-hf",
        "data-mix",
    ],
)
def test_an_output_under_a_file_is_one_line_exit_2(name, tiny_data, tmp_path, capsys, monkeypatch):
    """Before: each of these ended in a Python traceback (NotADirectoryError / FileExistsError).
    Paths under an existing *file* are what stop root (the tests run as root, which chmod does not
    stop); the EACCES case is the next test's. Nothing is created, and the work never starts."""
    blocker = tmp_path / "afile"
    blocker.write_text("a user's file where a folder would go\n")
    f = blocker / "sub"
    csv_in = FIXTURES / "chinchilla_svg_extracted_data.csv"
    tiny = tiny_overrides(f / "run", tiny_data)
    argv, option = {
        "plan-out-config": (["plan", 'model.preset="demo-tiny"', "--out-config", f / "x.toml"], "--out-config"),
        "plan-plot": (["plan", 'model.preset="demo-tiny"', "--plot", f / "x.png"], "--plot"),
        "scale-fit-out": (["scale", "fit", csv_in, "--bootstrap", 0, "--out", f / "law.json"], "--out"),
        "scale-fit-plots": (["scale", "fit", csv_in, "--bootstrap", 0, "--plots", f], "--plots"),
        "predict-task": (["scale", "predict-task", csv_in, "--flops", "1e20", "--out", f], "--out"),
        "contamination": (
            ["data", "contamination", tiny_data, "--tasks", "alice-lastword", "--ids-out", f / "ids.json"],
            "--ids-out",
        ),
        "calibrate": (["hardware", "calibrate", "--out", f / "hw.toml", "--nproc", 1], "--out"),
        "data-prepare": (["data", "prepare", "builtin:alice", "--out", f, "--train-tokenizer", 300], "--out"),
        "train": (["train", *tiny], "run.dir"),
        "sweep-emit": (["scale", "sweep", *tiny, "--budgets", "2e9", "--sizes", 2, "--out", f, "--emit"], "--out"),
        "sweep": (["scale", "sweep", *tiny, "--budgets", "2e9", "--sizes", 2, "--out", f], "--out"),
        "to-hf": (["convert", "to-hf", tmp_path / "no-such-checkpoint", f / "hf"], "OUT_DIR"),
        "data-mix": (["data", "mix", *tiny_overrides(f / "run", "builtin:alice")], "run.dir"),
    }[name]
    import flopwise.data.prepare
    import flopwise.measure.calibrate

    def never(*a, **k):
        raise AssertionError("the work started before the output was checked")

    monkeypatch.setattr(flopwise.measure.calibrate, "calibrate_device", never)
    monkeypatch.setattr(flopwise.data.prepare, "survey", never)
    code, err = run_main(argv, capsys, monkeypatch)
    _one_line_exit_2(code, err, option, "afile is a file, not a folder")
    assert blocker.read_text() == "a user's file where a folder would go\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_an_output_folder_the_os_refuses_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    """EACCES/EPERM/EROFS: root is not stopped by chmod, so the OS's refusal is simulated where the
    writers try the folder (tempfile.mkstemp, the probe `check_folder` creates). A write refused
    later (os.replace) is the same one line, and leaves neither a half file nor its temporary."""
    import errno
    import tempfile

    import flopwise.files.outputs
    from flopwise.files.outputs import write_text

    real = tempfile.mkstemp

    def refuse(*a, dir=None, **k):
        if str(dir).startswith(str(tmp_path / "ro")):
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))
        return real(*a, dir=dir, **k)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(flopwise.files.outputs.tempfile, "mkstemp", refuse)
    for argv, option in (
        (["plan", 'model.preset="demo-tiny"', "--out-config", tmp_path / "ro" / "x.toml"], "--out-config"),
        (["data", "prepare", "builtin:alice", "--out", tmp_path / "ro" / "d"], "--out"),
        (["hardware", "calibrate", "--out", tmp_path / "ro" / "hw.toml"], "--out"),
    ):
        code, err = run_main(argv, capsys, monkeypatch)
        _one_line_exit_2(code, err, option, "Permission denied", "permissions")
    assert list((tmp_path / "ro").iterdir()) == []

    kept = write_text(tmp_path / "x.toml", "a = 1\n", "--out-config")
    before = kept.read_bytes()

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(flopwise.files.outputs.os, "replace", full)
    with pytest.raises(ConfigError, match="--out-config .*No space left.*free space") as e:
        write_text(kept, "a = 2\n", "--out-config")
    assert (
        "\n" not in str(e.value)
        and kept.read_bytes() == before
        and sorted(tmp_path.iterdir()) == [tmp_path / "ro", kept]
    )


def test_an_os_refusal_no_writer_caught_is_still_one_line(capsys, monkeypatch):
    """The last line of defence: cli.main turns an OSError meaning "cannot write here" into one
    line with exit 2 (other OSErrors keep their traceback: they are bugs)."""
    import errno

    import flopwise.cli

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", "/somewhere/out.json")

    def broken(*a, **k):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(flopwise.cli, "app", denied)
    code, err = run_main(["any"], capsys, monkeypatch)
    _one_line_exit_2(code, err, "/somewhere/out.json", "Permission denied")
    monkeypatch.setattr(flopwise.cli, "app", broken)
    with pytest.raises(OSError, match="Input/output"):
        run_main(["any"], capsys, monkeypatch)


def test_data_prepare_force_never_replaces_a_file_and_the_refusal_lists_what_force_deletes(
    tmp_path, capsys, monkeypatch
):
    """Before: --force deleted a user's plain file at --out, and the refusal without --force did
    not say which files --force would delete."""
    text = tmp_path / "t.txt"
    text.write_text("some text to tokenize, and more text after it.\n" * 20)
    plain = tmp_path / "notes"
    plain.write_text("my notes\n")
    code, err = run_main(
        ["data", "prepare", text, "--out", plain, "--train-tokenizer", 300, "--force"], capsys, monkeypatch
    )
    _one_line_exit_2(code, err, "--out", "not a folder")
    assert plain.read_text() == "my notes\n"
    folder = tmp_path / "mine"
    for i in range(5):
        (folder / f"sub{i % 2}").mkdir(parents=True, exist_ok=True)
        (folder / f"sub{i % 2}" / f"f{i}.txt").write_text("mine")
    code, err = run_main(["data", "prepare", text, "--out", folder, "--train-tokenizer", 300], capsys, monkeypatch)
    _one_line_exit_2(code, err, "--force", "deleting its 5 files (sub0/f0.txt, sub0/f2.txt, sub0/f4.txt and 2 more)")
    assert len(list(folder.rglob("*.txt"))) == 5


@pytest.mark.parametrize("option", [("--filter", "nope"), ("--dedup", "nope"), ("--decontaminate", "nope")])
def test_data_prepare_checks_its_options_before_creating_anything(option, tmp_path, capsys, monkeypatch):
    """Before: --decontaminate nope left --out with manifest.json, tokenizer.json and work/."""
    text = tmp_path / "t.txt"
    text.write_text("some text to tokenize.\n" * 20)
    code, err = run_main(
        ["data", "prepare", text, "--out", tmp_path / "d", "--train-tokenizer", 300, *option], capsys, monkeypatch
    )
    _one_line_exit_2(code, err, "nope")
    assert not (tmp_path / "d").exists()


def test_data_mix_claims_the_run_folder_it_prepares_data_in(tmp_path, capsys, monkeypatch):
    """Before: `data mix` prepared <run.dir>/data without recording it as flopwise's, so the next
    `train` refused the folder; a user's data there was refused naming --out and --force, options
    data mix does not have."""
    from flopwise.config.schema import load_config
    from flopwise.train.build import claim_run_dir

    overrides = tiny_overrides(tmp_path / "run", "builtin:alice", **{"data.tokenizer": '"bpe:300"'})
    code, err = run_main(["data", "mix", *overrides], capsys, monkeypatch)
    assert code == 0, err
    claim_run_dir(load_config(None, overrides), tmp_path / "run", 1)  # what `train` does first: accepted
    user = tmp_path / "user"
    (user / "data").mkdir(parents=True)
    (user / "data" / "notes.txt").write_text("mine")
    for run_dir in (user, tmp_path / "run"):  # a user's data folder; a user's file in flopwise's
        if run_dir != user:
            (run_dir / "data" / "notes.txt").write_text("mine")
        code, err = run_main(
            ["data", "mix", *tiny_overrides(run_dir, "builtin:alice", **{"data.tokenizer": '"bpe:300"'})],
            capsys,
            monkeypatch,
        )
        _one_line_exit_2(code, err, "run.dir")
        assert "--force" not in err and "--out" not in err
        assert (run_dir / "data" / "notes.txt").read_text() == "mine"
