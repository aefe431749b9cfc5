"""Nothing lost, third round (issue 53): refusals before the first write, weights that must stay
finite, ranks that must run one job, absurd sizes refused in one line. Each case is a real command
in a fresh folder; every byte that was there before is checked after, and a refusal is one line."""

import hashlib
import os
from pathlib import Path

import pytest

from tests.conftest import tiny_overrides


def tree_hashes(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `root` (a symlink by its target's name)."""
    out = {}
    for here, _, files in os.walk(root):
        for f in files:
            p = Path(here, f)
            rel = p.relative_to(root).as_posix()
            out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def one_line(r, code: int, *words: str) -> str:
    """The command refused with exit `code` in one line holding `words`, no traceback; that line."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code, r.stdout[-1500:] + r.stderr[-1500:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [ln for ln in lines if ln.startswith("error")]
    assert len(errors) == 1, r.stderr[-2000:]
    for w in words:
        assert w in errors[0], errors[0]
    return errors[0]


# --- 5: every refusal before the first write ------------------------------------------------


@pytest.fixture(scope="module")
def alice_docs(tmp_path_factory) -> Path:
    """Alice's chapters as raw text files (a validation split needs more than one document)."""
    from flopwise.data.shards import resolve_input

    docs = tmp_path_factory.mktemp("alice_raw")
    for i, chunk in enumerate(resolve_input("builtin:alice").read_text().split("CHAPTER")):
        if chunk.strip():
            (docs / f"part_{i:02d}.txt").write_text(chunk)
    return docs


@pytest.fixture(scope="module")
def raw_run(alice_docs, tmp_path_factory):
    """A run that prepared its own data (Alice, bpe:300) in run.dir/data, 2 steps, 1 checkpoint."""
    from flopwise.config.schema import load_config
    from flopwise.train.launch import train

    run = tmp_path_factory.mktemp("raw") / "run"
    over = {"train.steps": 2, "checkpoint.interval": 2, "train.eval_every": 0, "data.tokenizer": '"bpe:300"'}
    train(load_config(None, tiny_overrides(run, alice_docs, **over)))
    return run


@pytest.mark.parametrize(
    "change, words",
    [
        ({"data.tokenizer": '"bpe:256"'}, ("data.tokenizer 'bpe:300' there, 'bpe:256' here", "nothing was written")),
        ({"data.tokenizer": '"bpe:256"', "model.n_layers": 1}, ("is of another run", "model.n_layers")),
    ],
    ids=["tokenizer", "tokenizer-and-model"],
)
def test_a_resume_refused_by_its_checkpoint_leaves_the_data_it_was_trained_on(change, words, raw_run, alice_docs, cli):
    """The README tour run where the quickstart ran: refused before the data is prepared again (each
    case in the fixture's own folder: a copy is another run folder, whose checkpoints are not its own)."""
    run = raw_run
    before = tree_hashes(run)
    over = {"train.steps": 4, "checkpoint.interval": 2, "train.eval_every": 0, **change}
    r = cli("train", *tiny_overrides(run, alice_docs, **over))
    one_line(r, 2, *words)
    assert "preparing data" not in r.stderr + r.stdout
    assert tree_hashes(run) == before


# --- 9: weights that must stay finite ---------------------------------------------------------


@pytest.mark.parametrize(
    "setting, words",
    [
        ({"optim.lr": 3e38}, ("stopped at step 1:", "made weights non-finite", "Lower optim.lr")),
        ({"optim.lr": 1e30}, ("stopped at step 4:", "cannot make progress", "optim.lr")),
        ({"model.init_std": 1e30}, ("stopped at step 3:", "cannot make progress", "model.init_std")),
    ],
    ids=["lr-overflows-weights", "lr-overflows-activations", "init_std"],
)
def test_a_run_that_breaks_its_weights_stops_in_one_line_with_no_broken_checkpoint(
    setting, words, tiny_data, tmp_path, cli
):
    """optim.lr=1e30 made every weight NaN at step 1 and wrote NaN checkpoints, exit 0; init_std=1e30
    skipped every update and ended exit 0 with nothing trained."""
    run = tmp_path / "run"
    over = {"train.steps": 6, "checkpoint.interval": 4, "train.eval_every": 0, "optim.warmup_steps": 0, **setting}
    r = cli("train", *tiny_overrides(run, tiny_data, **over))
    one_line(r, 2, *words)
    assert not list((run / "checkpoints").glob("step-*")), "a checkpoint of broken weights was written"


# --- 6: the ranks of one job run one job ----------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.multinode
def test_two_agents_given_different_configs_stop_before_any_step(tiny_data, tmp_path):
    """The multi-node launch of docs/scaling-out.md with optim.lr differing between the two agents:
    both exited 0 with diverged replicas before; now every rank stops with exit 2 before step 1, rank
    0 naming the key and the rank in one line, and the run folder holds no checkpoint or metrics."""
    import subprocess
    import sys

    run, port = tmp_path / "run", _free_port()
    agents = []
    for lr in ("1e-3", "2e-3"):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=job{port}",
            "--max-restarts=0",
            "-m",
            "flopwise",
            "train",
            *tiny_overrides(run, tiny_data, **{"optim.lr": lr, "train.steps": 2}),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    results = [a.communicate(timeout=300) for a in agents]
    codes = [a.returncode for a in agents]
    assert all(c != 0 for c in codes), results
    lines = [ln for out, err in results for ln in (out + err).splitlines() if ln.startswith("error")]
    assert len(lines) == 1, results
    assert "optim.lr=0.001 on rank 0, 0.002 on rank 1" in lines[0], lines
    assert not (run / "metrics.jsonl").exists() and not list(run.glob("checkpoints/step-*"))


# --- 11: absurd sizes, refused in one line before anything is built ---------------------------


@pytest.fixture(scope="module")
def hf_folder(tiny_run, tmp_path_factory) -> Path:
    """The session's tiny run (2 layers) exported to a Hugging Face folder."""
    from flopwise.interop.convert import export_hf

    out = tmp_path_factory.mktemp("hf") / "hf"
    export_hf(tiny_run(6), out)
    return out


def _claiming(hf: Path, where: Path, layers: int, weights: bool = True) -> Path:
    """A copy of `hf` whose config.json claims `layers` layers (without its weights: a bare config)."""
    import json
    import shutil

    shutil.copytree(hf, where)
    if not weights:
        for f in where.glob("*.safetensors*"):
            f.unlink()
    cfg = json.loads((where / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers}))
    return where


@pytest.mark.parametrize("layers", [1_000_000_000, 3, 1])
def test_a_config_counting_other_layers_than_its_weights_is_refused_before_building(layers, hf_folder, tmp_path, cli):
    """A config.json claiming 1e9 layers built the meta model until killed; now the count is
    checked against the blocks in the safetensors headers (2 here) first."""
    hf = _claiming(hf_folder, tmp_path / "hf", layers)
    before = tree_hashes(hf)
    r = cli("convert", "from-hf", hf, tmp_path / "out")
    one_line(r, 2, f"counts {layers:,} layers", "blocks 0-1 (2 of them)")
    assert not (tmp_path / "out").exists() and tree_hashes(hf) == before


def test_a_bare_config_of_absurd_size_is_refused_before_building(hf_folder, tmp_path, cli):
    hf = _claiming(hf_folder, tmp_path / "hf", 1_000_000_000, weights=False)
    one_line(cli("convert", "from-hf", hf, tmp_path / "out"), 2, "no model.safetensors")


def test_plan_answers_for_the_largest_cluster_and_refuses_beyond_it(cli):
    """plan cluster.gpus=1e9 counted every number up to 1e9 for its divisors and did not finish."""
    one_line(cli("plan", "cluster.gpus=1000000000"), 2, "cluster.gpus", "1048576")
    r = cli("plan", "cluster.gpus=1048576", "train.global_batch=1048576")
    assert "Traceback" not in r.stderr and r.returncode in (0, 2), r.stderr[-2000:]


# --- 8: a handed Hugging Face folder is read only inside itself --------------------------------


@pytest.mark.parametrize("name", ["chat_template.jinja", "special_tokens_map.json", "model.safetensors"])
def test_a_handed_folder_linking_outside_itself_is_refused_and_nothing_is_copied(name, hf_folder, tmp_path, cli):
    """A symlinked chat_template.jinja (or special_tokens_map.json, model.safetensors) was followed
    and copied into the checkpoint: a handed folder could make a user republish ~/.aws/credentials."""
    import shutil

    secret = tmp_path / "home" / "credentials"
    secret.parent.mkdir()
    secret.write_text("aws_secret_access_key = not-for-publishing\n")
    hf = tmp_path / "hf"
    shutil.copytree(hf_folder, hf)
    if (hf / name).exists():
        shutil.move(hf / name, tmp_path / "home" / name)  # a real file of the right kind, outside
        (hf / name).symlink_to(tmp_path / "home" / name if name == "model.safetensors" else secret)
    else:
        (hf / name).symlink_to(secret)
    before = tree_hashes(tmp_path / "home")
    r = cli("convert", "from-hf", hf, tmp_path / "out")
    one_line(r, 2, f"{name} is a symbolic link to", "outside the folder")
    assert not (tmp_path / "out").exists() and tree_hashes(tmp_path / "home") == before


def test_a_hub_cache_snapshot_linking_into_its_blobs_is_read(hf_folder, tmp_path, cli):
    """The hub cache's own layout (snapshots/REV/NAME -> ../../blobs/HASH) stays inside the download."""
    repo = tmp_path / "models--me--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in hf_folder.iterdir():
        (blobs / f.name).write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    r = cli("convert", "from-hf", snap, tmp_path / "out")
    assert r.returncode == 0, r.stderr[-2000:]


# --- 10: a run holds the data it reads ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.waits
def test_data_prepare_into_the_folder_a_running_train_reads_is_refused_naming_the_run(alice_docs, tmp_path, cli):
    """`data prepare` into the data.path of a running train was allowed: the run went on from its
    old memory-mapped shards and copied the new tokenizer.json into every later checkpoint."""
    import signal
    import subprocess
    import sys
    import time

    from flopwise.data.prepare import prepare_data

    data, run = tmp_path / "data", tmp_path / "run"
    prepare_data([str(alice_docs)], data, tokenizer="bpe:300", val_fraction=0.1, seed=0)
    before = tree_hashes(data)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLOPWISE_FAULTS": "slow:step=2:seconds=120"}
    train = subprocess.Popen(
        [sys.executable, "-m", "flopwise", "train", *tiny_overrides(run, data, **{"train.steps": 3})],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").exists():  # step 1 logged: the run reads its data
            assert train.poll() is None and time.monotonic() < deadline, train.stderr.read() if train.stderr else ""
            time.sleep(0.2)
        r = cli("data", "prepare", alice_docs, "--out", data, "--train-tokenizer", 400)
        one_line(r, 2, f"the run in {run.resolve()} (PID {train.pid})", "reads this folder", "nothing was written")
        assert tree_hashes(data) == before
    finally:
        os.killpg(train.pid, signal.SIGKILL)
        train.wait()


# --- 12: a full disk is one line naming the output and the space it needs -------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (a disk that fills up), mounted for the test; skipped where mounting is not allowed."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.parametrize("command", ["to-hf", "export"])
@pytest.mark.parametrize("when", ["before", "while-writing"])
def test_an_export_into_a_full_disk_is_one_line_and_leaves_nothing(
    command, when, small_disk, tiny_run, cli, monkeypatch
):
    """convert to-hf into a full disk was a SafetensorError traceback and left a partial folder that
    blocked the rerun; checkpoint export said "unexpected pos 704 vs 598". `while-writing`: the
    space check before writing is told there is room, so the real write fills the real disk."""
    import flopwise.checkpoints.export as export
    import flopwise.interop.convert as convert

    if when == "while-writing":
        module = convert if command == "to-hf" else export
        real = module.check_space
        monkeypatch.setattr(module, "check_space", lambda o, out, n, e=None: real(o, out, n, e) if e else None)
    out = small_disk / "out"
    argv = ["convert", "to-hf", tiny_run(6), out] if command == "to-hf" else ["checkpoint", "export", tiny_run(6)]
    r = cli(*argv, *([] if command == "to-hf" else ["--out", out]))
    line = one_line(r, 2, str(out), "no space left there: it needs", "MB are free")
    assert ("partial output was removed" if when == "while-writing" else "nothing was written") in line
    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) if out.exists() else []
    assert left in ([], ["flopwise-run.json"]), left  # at most the run record that claims checkpoints/


# --- smaller: SIGHUP, the takeover message ---------------------------------------------------------


def test_sighup_checkpoints_and_stops_like_sigterm(tiny_data, tmp_path, monkeypatch):
    """A closed ssh session (SIGHUP) killed a run with no checkpoint; SIGTERM saved one."""
    from flopwise.config.schema import load_config
    from flopwise.train.launch import train

    monkeypatch.setenv("FLOPWISE_FAULTS", "sighup:step=2")
    r = train(load_config(None, tiny_overrides(tmp_path / "run", tiny_data, **{"train.steps": 4})))
    assert r.preempted == 2 and r.signal == "SIGHUP" and r.checkpoint.name == "step-00000002"


# --- the property: whatever a user put in the folders, every byte of it stays -----------------

# names flopwise writes or reads, and shapes of its temporary and step folders
_NAMES = [
    "config.toml",
    "metrics.jsonl",
    "loss.png",
    "skipped.jsonl",
    "flopwise-run.json",
    ".flopwise.lock",
    ".config.toml.x1y2z3.flopwise-tmp",
    ".metrics.jsonl.abcdef.flopwise-tmp",
    "notes.txt",
    "checkpoints/my-eval.json",
    "checkpoints/step-00000001-before-lr-change/state.json",
    "checkpoints/step-00000002.keep/notes.txt",
    "checkpoints/step-00000004/my-eval.json",
    "checkpoints/step-00000009.tmp/x.distcp",
]
_DATA_NAMES = ["notes.txt", ".flopwise.lock", ".index.json.abc123.flopwise-tmp", "extra/shard.bin"]


def _place(rng, folder: Path, names: list[str], outside: Path) -> dict[Path, tuple[str, object]]:
    """Some of `names` in `folder` as a user's plain file, hard link or symlink to a file of theirs
    outside; what each must still be afterwards."""
    placed: dict[Path, tuple[str, object]] = {}
    for i, name in enumerate(rng.sample(names, rng.randint(1, 4))):
        p = folder / name
        p.parent.mkdir(parents=True, exist_ok=True)
        kind = rng.choice(["file", "hardlink", "symlink"])
        theirs = outside / f"{folder.name}-{i}.txt"
        theirs.write_bytes(f"the user's own {name} #{i}\n".encode() * rng.randint(1, 50))
        if kind == "file":
            p.write_bytes(theirs.read_bytes())
        elif kind == "hardlink":
            os.link(theirs, p)
        else:
            p.symlink_to(theirs)
        placed[p] = (kind, theirs)
    return placed


def _intact(placed: dict[Path, tuple[str, object]], before: dict[str, str]) -> list[str]:
    """What changed: a user's name gone or replaced, or their bytes changed (outside or in)."""
    import hashlib

    bad = []
    for p, (kind, theirs) in placed.items():
        if kind == "symlink" and not (p.is_symlink() and os.readlink(p) == str(theirs)):
            bad.append(f"{p} (symlink)")
        elif kind != "symlink" and (p.is_symlink() or not p.is_file()):
            bad.append(f"{p} ({kind} gone)")
        elif kind != "symlink" and hashlib.sha256(p.read_bytes()).hexdigest() != before[str(theirs)]:
            bad.append(f"{p} ({kind} rewritten)")
    return bad + [f"{t} (outside)" for t, h in before.items() if hashlib.sha256(Path(t).read_bytes()).hexdigest() != h]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_no_mix_of_user_files_links_and_copies_loses_a_byte_to_train_and_resume(seed, tiny_data, tmp_path, cli):
    """Random mixes of a user's files, hard links, symlinks, temporary names and step-* copies: in a
    prepared data folder before a run, and in its run folder after its first command (2 steps, a
    checkpoint each), then the run resumed to 4 steps (retention deleting step folders): whatever each
    command does (trains, or refuses in one line), every byte of the user's is as it was."""
    import hashlib
    import random
    import shutil

    rng = random.Random(seed)
    outside, run, data = tmp_path / "home", tmp_path / "run", tmp_path / "data"
    outside.mkdir()
    shutil.copytree(tiny_data, data)
    placed = _place(rng, data, _DATA_NAMES, outside)
    for steps in (2, 4):  # seeds 0-1 refuse the resume (a symlink at the lock's name), 2-3 resume and prune
        over = {"train.steps": steps, "checkpoint.interval": 1, "checkpoint.keep": 1, "train.eval_every": 0}
        r = cli("train", *tiny_overrides(run, data, **over))
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        if r.returncode:
            one_line(r, 2)
        if steps == 2:
            assert r.returncode == 0, r.stderr[-2000:]  # a user's files in the data folder do not stop a run
            free = [n for n in _NAMES if not (run / n).exists() and not (run / n).is_symlink()]
            placed |= _place(rng, run, free, outside)
            before = {str(t): hashlib.sha256(t.read_bytes()).hexdigest() for _, t in placed.values()}
        assert not _intact(placed, before), (_intact(placed, before), r.stderr[-1500:])


_EXPORT_NAMES = [
    "notes.txt",
    ".flopwise.lock",
    "flopwise-run.json",
    "flopwise-manifest.json",
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    ".model.safetensors.abc123.flopwise-tmp",
    "checkpoints/step-00000002/my-eval.json",
    "checkpoints/notes.txt",
]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_no_mix_of_user_files_loses_a_byte_to_exports_or_a_killed_train(seed, tiny_data, tmp_path, cli):
    """The property's other folders and moments: a user's files, links and temporary names in the
    folders `checkpoint export` and `convert to-hf` write (each exports, or refuses in one line), and
    in a run folder while a train is killed (SIGKILL after its first new checkpoint) and resumed."""
    import hashlib
    import random
    import signal
    import subprocess
    import sys
    import time

    rng = random.Random(seed)
    outside, run = tmp_path / "home", tmp_path / "run"
    outside.mkdir()
    over = {"train.steps": 2, "checkpoint.interval": 1, "checkpoint.keep": 2, "train.eval_every": 0}
    assert cli("train", *tiny_overrides(run, tiny_data, **over)).returncode == 0
    placed: dict[Path, tuple[str, object]] = {}
    for name in ("export", "hf"):
        (tmp_path / name).mkdir()
        placed |= _place(rng, tmp_path / name, _EXPORT_NAMES, outside)
    free = [n for n in _NAMES if n != ".flopwise.lock" and not (run / n).exists() and not (run / n).is_symlink()]
    placed |= _place(rng, run, free, outside)
    before = {str(t): hashlib.sha256(t.read_bytes()).hexdigest() for _, t in placed.values()}
    for argv in (
        ("checkpoint", "export", run, "--out", tmp_path / "export"),
        ("convert", "to-hf", run, tmp_path / "hf"),
    ):
        r = cli(*map(str, argv))
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        if r.returncode:
            one_line(r, 2)
        assert not _intact(placed, before), (argv, _intact(placed, before), r.stderr[-1500:])
    over["train.steps"] = 40
    cmd = [sys.executable, "-m", "flopwise", "train", *tiny_overrides(run, tiny_data, **over)]
    train = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    deadline = time.monotonic() + 120
    while train.poll() is None and not (run / "checkpoints" / "step-00000004").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    train.send_signal(signal.SIGKILL)
    train.wait()
    assert not _intact(placed, before), (_intact(placed, before), train.stderr.read()[-1500:] if train.stderr else "")
    r = cli("train", *tiny_overrides(run, tiny_data, **over))
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    if r.returncode:
        one_line(r, 2)
    assert not _intact(placed, before), (_intact(placed, before), r.stderr[-1500:])
