"""The datatrove prepare pipeline: identity with the single-process reference, resume after a
kill, and each filter/dedup stage measured against a planted corpus."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from datatrove.data import Document
from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter
from datatrove.utils.text import simplify_text
from tokenizers import Tokenizer

from flopwise.data.prepare import prepare_data
from flopwise.data.prepare_steps import Whitespace
from flopwise.data.shards import iter_documents, open_split, read_index, resolve_input, val_documents
from flopwise.data.tokenizer import train_bpe
from flopwise.errors import DataError

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.mark.slow
def test_shards_equal_the_single_process_reference(tmp_path):
    """2 workers, 3 tasks: the concatenated shards are byte-identical to encoding every document
    in one process, the split picks the same documents (val_documents over ordinals), the
    tokenizer is the one trained on all documents, and the held-out plays of the eval tasks are
    the val documents (demo.toml's settings: seed 1337, val_fraction 0.05)."""
    out = tmp_path / "sp"
    prepare_data(["builtin:shakespeare"], out, tokenizer="bpe:4096", val_fraction=0.05, seed=1337, workers=2, tasks=3)
    docs = [text for _, text in iter_documents(["builtin:shakespeare"])]
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.to_str() == train_bpe(docs, 4096).to_str()
    eos = tok.token_to_id("<|endoftext|>")
    val = val_documents(len(docs), 0.05, 1337)
    streams = {"train": [], "val": []}
    for i, enc in enumerate(tok.encode_batch(docs, add_special_tokens=False)):
        streams["val" if i in val else "train"] += enc.ids + [eos]
    meta = read_index(out)
    assert meta["format"] == "flopwise-shards/2" and len(meta["splits"]["train"]["files"]) == 3
    for split, ids in streams.items():
        shards = b"".join((out / f["file"]).read_bytes() for f in meta["splits"][split]["files"])
        assert shards == np.asarray(ids, dtype=np.uint16).tobytes()
        tokens = open_split(out, split)
        assert len(tokens) == len(ids) and np.array_equal(np.asarray(tokens), ids)
        assert np.array_equal(tokens[10 : len(ids) - 10], ids[10:-10])  # a slice across every shard
    from flopwise.data.tasks import heldout_plays

    vtok = open_split(out, "val")
    held = [tok.decode(list(vtok[s : s + n - 1])) for s, n in meta["splits"]["val"]["documents"]]
    assert held == heldout_plays() == [docs[i] for i in sorted(val)]


def _files(d: Path) -> dict[str, bytes]:
    """Every file's bytes; report.json without its timings (the only part that may differ)."""
    files = {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}
    report = json.loads(files.pop("report.json"))
    report.pop("wall_seconds")
    for row in report["stages"]:
        row.pop("cpu_seconds")
    manifest = {}
    if "manifest.json" in files:  # it records report.json's bytes (timings included): compared without
        manifest = json.loads(files.pop("manifest.json"))
        manifest["files"].pop("report.json")
        manifest.pop("folder")  # the folder it was written for: the same in no two folders
    return files | {"report.json": report, "manifest.json": manifest}


def _killed_prepare(plays: Path, out: Path, args: dict) -> list[str]:
    """SIGKILL a prepare of `plays` into `out` after its first finished tokenize task; the finished
    tasks' names."""
    code = f"from flopwise.data.prepare import prepare_data; prepare_data([{str(plays)!r}], {str(out)!r}, **{args!r})"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": SRC},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    done = out / "work" / "logs" / "tokenize" / "completions"
    deadline = time.time() + 120
    while not (done.is_dir() and any(done.iterdir())) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    gone = time.time() + 30  # its datatrove workers share its folder lock until they are gone too
    while time.time() < gone:  # (bounded: a zombie nobody reaps has released the lock already)
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    finished = sorted(p.name for p in done.iterdir())
    assert proc.returncode == -signal.SIGKILL and not (out / "index.json").exists()
    assert finished
    return finished


def _twelve_plays(tmp_path: Path) -> Path:
    plays = tmp_path / "plays"
    plays.mkdir()
    for f in sorted(resolve_input("builtin:shakespeare").iterdir())[:12]:
        (plays / f.name).write_bytes(f.read_bytes())
    return plays


@pytest.mark.slow
def test_killed_prepare_resumes_to_the_same_bytes(tmp_path, caplog):
    """SIGKILL a prepare after its first finished task; the rerun keeps the finished shards
    (datatrove's completion markers), runs the rest, and ends byte-identical to a clean run. Not
    while someone has added a file to the unfinished folder: then it is refused and left as it was
    (one killed prepare serves both)."""
    plays = _twelve_plays(tmp_path)
    args = dict(tokenizer="bpe:512", val_fraction=0.1, seed=0, workers=1, tasks=6)
    clean = tmp_path / "clean"
    prepare_data([str(plays)], clean, **args)
    out = tmp_path / "killed"
    finished = _killed_prepare(plays, out, args)
    assert len(finished) < 6
    written = {f: (out / f"train-{f}.bin").stat().st_mtime_ns for f in finished}
    # the killed prepare's lock is taken over, and said in one line, by the first call after it
    for extra in (out / "diary.txt", out / "work" / "diary.txt"):
        extra.write_text("mine")
        before = _tree(out)
        with pytest.raises(DataError, match="--force"):
            prepare_data([str(plays)], out, **args)
        assert _tree(out) == before
        extra.unlink()
    said = [r.getMessage() for r in caplog.records if "taking over the lock" in r.getMessage()]
    assert len(said) == 1 and re.fullmatch(r".*: taking over the lock of flopwise process \d+, which is gone", said[0])
    prepare_data([str(plays)], out, **args)
    assert _files(out) == _files(clean) and not (out / "work").exists()
    # the finished tasks were not run again: their shards are the ones the killed run wrote
    assert written == {f: (out / f"train-{f}.bin").stat().st_mtime_ns for f in finished}


# ---- planted corpus ----------------------------------------------------------------------------


def _prose(n_docs: int, words: int = 300) -> list[str]:
    """Ordinary prose: 300-word pieces of Alice, Wikipedia and Hamlet, wrapped 12 words a line."""
    texts = [
        resolve_input("builtin:alice").read_text(),
        resolve_input("builtin:enwiki").read_text(),
        (resolve_input("builtin:shakespeare") / "hamlet_gut.txt").read_text(),
    ]
    docs = []
    for k in range(n_docs):
        w = texts[k % 3].split()
        start = 500 + (k // 3) * words
        piece = w[start : start + words]
        docs.append("\n".join(" ".join(piece[j : j + 12]) for j in range(0, words, 12)))
    return docs


def _shingles(text: str) -> set:
    w = simplify_text(text).split()
    return {tuple(w[i : i + 5]) for i in range(len(w) - 4)}


def _jaccard(a: str, b: str) -> float:
    x, y = _shingles(a), _shingles(b)
    return len(x & y) / len(x | y)


def _near_copy(text: str, target: float, tag: int) -> str:
    """Substitute words (every 7th position first, then in between) until the 5-gram Jaccard with
    `text` falls to `target`."""
    lines = [ln.split() for ln in text.split("\n")]
    flat = [(i, j) for i, ln in enumerate(lines) for j in range(len(ln))]
    order = flat[3::7] + [p for p in flat if p not in set(flat[3::7])]
    for n, (i, j) in enumerate(order):
        lines[i][j] = f"zq{tag}x{n}"
        copy = "\n".join(" ".join(ln) for ln in lines)
        if _jaccard(text, copy) <= target:
            return copy
    raise AssertionError("cannot reach the Jaccard target")


STOP = {"the", "be", "to", "of", "and", "that", "have", "with"}


def _low_quality() -> dict[str, str]:
    """Low-quality documents built from Alice's words (so only the planted defect differs from
    prose) -> the Gopher rule that must drop each (Rae et al. 2021 App. A)."""
    w = resolve_input("builtin:alice").read_text().split()[2000:]

    def lines(n: int, k: int = 10, at: int = 0) -> list[str]:
        return [" ".join(w[at + i * k : at + (i + 1) * k]) for i in range(n)]

    return {
        "Too short to be a document, but the words are fine.": "gopher_short_doc",
        " ".join(f"{x} #{i}" if i % 4 == 0 else x for i, x in enumerate(w[:300])): "gopher_too_many_hashes",
        "\n".join(f"- {line}" for line in lines(40)): "gopher_too_many_bullets",
        "\n".join(f"{line} ..." for line in lines(40, at=500)): "gopher_too_many_end_ellipsis",
        " ".join(f"{x} {i * 7919 % 10007}" for i, x in enumerate(w[1000:1300])): "gopher_below_alpha_threshold",
        " ".join(x for x in w[1500:1900] if x.lower().strip(",.;:!?'\"") not in STOP): "gopher_enough_stop_words",
        ("Buy cheap watches online today for you and me.\n" * 40) + "the end of it all": "dup_line_frac",
    }


LOW_QUALITY = _low_quality()


@pytest.mark.slow
def test_planted_corpus_each_stage_against_the_plant(tmp_path):
    normal = _prose(60)
    # copies equal after normalization: verbatim, and with doubled spaces and no commas
    exact_groups = [[normal[k], normal[k], normal[k].replace(" ", "  ").replace(",", "")] for k in range(5)]
    near = {0.95: [], 0.9: [], 0.5: []}
    for t, target in enumerate(near):
        for k in range(8):
            base = normal[5 + 8 * t + k]
            copy = _near_copy(base, target, 10 * t + k)
            assert target - 0.03 <= _jaccard(base, copy) <= target
            near[target].append((base, copy))
    docs = normal + [c for g in exact_groups for c in g[1:]] + [c for pairs in near.values() for _, c in pairs]
    docs += list(LOW_QUALITY)
    order = np.random.default_rng(0).permutation(len(docs))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for part in range(3):  # several files: dedup works across inputs
        with open(corpus / f"part{part}.jsonl", "w") as f:
            for i in order[part::3]:
                f.write(json.dumps({"text": docs[i]}) + "\n")

    # each low-quality document is dropped by the rule planted for it, no normal one is
    words = Whitespace()
    qual, rep = GopherQualityFilter(language=words), GopherRepetitionFilter(language=words)

    def verdict(text):
        for rule in (qual, rep):
            result = rule.filter(Document(text=text, id="0"))
            if result is not True:
                return result[1]
        return True

    assert {t: verdict(t) for t in LOW_QUALITY} == LOW_QUALITY
    assert sum(verdict(t) is True for t in normal) >= 0.95 * len(normal)

    out = tmp_path / "out"
    stats = prepare_data(
        [str(corpus)], out, tokenizer="bpe:1024", val_fraction=0.0, workers=1, filters="gopher", dedup="exact,minhash"
    )
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokens = open_split(out, "train")
    kept = [tok.decode(list(tokens[s : s + n - 1])) for s, n in read_index(out)["splits"]["train"]["documents"]]
    report = json.loads((out / "report.json").read_text())
    assert report == stats.report and report["documents_in"] == len(docs)
    stage = {row["stage"]: row for row in report["stages"]}

    # Gopher: every planted low-quality document dropped, under its rule; >= 95 % of prose kept
    assert not set(LOW_QUALITY) & set(kept)
    rules = {**stage["gopher_repetition"]["rules"], **stage["gopher_quality"]["rules"]}
    for rule in LOW_QUALITY.values():
        assert rules.get(rule, 0) >= 1
    dropped_by_gopher = stage["gopher_repetition"]["documents_removed"] + stage["gopher_quality"]["documents_removed"]
    assert dropped_by_gopher == len(LOW_QUALITY)
    # exact: one copy of each group kept, and exactly the planted copies removed
    for group in exact_groups:
        assert sum(kept.count(c) for c in set(group)) == 1
    assert stage["exact"]["documents_removed"] == sum(len(g) - 1 for g in exact_groups)
    assert stage["exact"]["clusters"] == len(exact_groups)
    # minhash: >= 90 % of the >= 0.9 pairs reduced to one document, at most one 0.5 pair (the
    # S-curve gives 1 - (1 - 0.5^8)^14 = 5.4 % per pair), nothing else removed
    high = [(a, b) for t in (0.95, 0.9) for a, b in near[t]]
    merged = sum((a in kept) + (b in kept) == 1 for a, b in high)
    assert merged >= 0.9 * len(high)
    merged_low = sum((a in kept) + (b in kept) == 1 for a, b in near[0.5])
    assert merged_low <= 1
    assert stage["minhash"]["documents_removed"] == merged + merged_low == stage["minhash"]["clusters"]
    assert report["documents_kept"] == len(kept) == stats.documents


def test_unknown_filter_and_dedup_names_are_one_line_errors(tmp_path):
    with pytest.raises(DataError, match="--filter fineweb: unknown"):
        prepare_data(["builtin:alice"], tmp_path / "o", filters="gopher,fineweb")
    with pytest.raises(DataError, match="--dedup bloom: unknown"):
        prepare_data(["builtin:alice"], tmp_path / "o", dedup="bloom")


def test_a_work_subfolder_does_not_make_a_folder_flopwise_s(tmp_path):
    """A folder that merely has a `work/` subfolder (or prepare's old marker file in it) is someone
    else's and is refused."""
    theirs, marked = tmp_path / "theirs", tmp_path / "marked"
    (theirs / "work").mkdir(parents=True)
    (theirs / "work" / "notes.txt").write_text("mine")
    (marked / "work").mkdir(parents=True)
    (marked / "work" / "flopwise-prepare").touch()
    (tmp_path / "in.txt").write_text(WORDS)
    for d in (theirs, marked):
        with pytest.raises(DataError, match="--force"):
            prepare_data([str(tmp_path / "in.txt")], d, tokenizer="bpe:300")
    assert (theirs / "work" / "notes.txt").read_text() == "mine"
    assert (marked / "work" / "flopwise-prepare").is_file()


# ---- what `data prepare --out DIR` may replace -------------------------------------------------
# A folder is replaced only if a manifest flopwise wrote there proves every file in it is flopwise's;
# inputs inside --out are refused, and --force never deletes them.

WORDS = "Some words to tokenize, and then some more words to tokenize. " * 60


def _tree(d: Path) -> dict[str, str]:
    """Every file under `d` (relative path -> sha256 of its bytes): equal before and after means untouched."""
    import hashlib

    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name != ".flopwise.lock"
    }  # a killed prepare's lock: taken over, then removed


def _cli_prepare(inputs, out, *extra):
    from typer.testing import CliRunner

    from flopwise.cli import app

    args = ["data", "prepare", *map(str, inputs), "--out", str(out), "--train-tokenizer", "300", "--workers", "1"]
    return CliRunner().invoke(app, args + list(extra))


def _refused(r) -> str:
    """The one-line DataError naming --force that a refusal must be (the CLI prints it, exit 2)."""
    assert isinstance(r.exception, DataError), (r.exit_code, r.output[-2000:], r.exception)
    msg = str(r.exception)
    assert "\n" not in msg and "--force" in msg, msg
    return msg


@pytest.fixture
def words(tmp_path) -> Path:
    f = tmp_path / "words.txt"
    f.write_text(WORDS)
    return f


def test_prepare_refuses_a_folder_with_foreign_index_and_tokenizer(tmp_path, words):
    """Files merely named index.json and tokenizer.json (an app's) do not make a folder flopwise's."""
    out = tmp_path / "thesis"
    (out / "src").mkdir(parents=True)
    (out / "index.json").write_text(json.dumps({"pages": ["intro", "methods"]}))
    (out / "tokenizer.json").write_text(json.dumps({"model": "someone else's"}))
    (out / "src" / "thesis.tex").write_text("\\chapter{Irreplaceable}")
    before = _tree(out)
    _refused(_cli_prepare([words], out))
    assert _tree(out) == before


def test_prepare_refuses_a_bare_work_marker(tmp_path, words):
    """An empty work/flopwise-prepare file (what used to mark an unfinished prepare) proves nothing."""
    out = tmp_path / "diary"
    (out / "work").mkdir(parents=True)
    (out / "work" / "flopwise-prepare").touch()
    (out / "diary.txt").write_text("Dear diary, today I lost everything.")
    before = _tree(out)
    _refused(_cli_prepare([words], out))
    assert _tree(out) == before


def test_prepare_never_deletes_its_inputs_inside_out(tmp_path, words):
    """Inputs inside --out (here: a corpus the user put into an earlier flopwise output) are refused
    before anything is removed; with --force the folder is replaced but the inputs survive."""
    out = tmp_path / "data"
    assert _cli_prepare([words], out).exit_code == 0
    corpus = out / "more" / "corpus.txt"
    corpus.parent.mkdir()
    corpus.write_text(WORDS.upper())
    before = _tree(out)
    msg = _refused(_cli_prepare([corpus], out))
    assert "input" in msg
    assert _tree(out) == before
    r = _cli_prepare([corpus], out, "--force")
    assert r.exit_code == 0, (r.output[-2000:], r.exception)
    assert corpus.read_text() == WORDS.upper()
    assert read_index(out)["sources"] == [str(corpus)]


def test_cli_prepare_splits_as_train_does_by_default(tmp_path, words):
    """`data prepare` without --seed/--val-fraction makes the split `flopwise train` of the embedded
    default makes (demo.toml's run.seed and data.val_fraction), the one the built-in Shakespeare
    tasks hold out; with seed 0 (its old default) a hand-prepared corpus held the tasks' plays."""
    from flopwise.config.schema import load_config

    out = tmp_path / "data"
    assert _cli_prepare([words], out).exit_code == 0
    demo = load_config("demo")
    assert (read_index(out)["seed"], read_index(out)["val_fraction"]) == (demo.run.seed, demo.data.val_fraction)


def test_prepare_replaces_its_own_earlier_output(tmp_path, words):
    """An earlier, untouched flopwise output is replaced without --force (here: another seed)."""
    out = tmp_path / "data"
    assert _cli_prepare([words], out, "--seed", "1").exit_code == 0
    first = _tree(out)
    r = _cli_prepare([words], out, "--seed", "2")
    assert r.exit_code == 0, (r.output[-2000:], r.exception)
    assert read_index(out)["seed"] == 2 and _tree(out) != first


def test_prepare_refuses_its_own_output_once_the_user_added_or_changed_a_file(tmp_path, words):
    """A flopwise folder with a file the user added, or a shard the user rewrote (same size), is no
    longer provably flopwise's: refused and left as it was."""
    out = tmp_path / "data"
    assert _cli_prepare([words], out).exit_code == 0
    (out / "notes.txt").write_text("my notes on this data")
    before = _tree(out)
    assert "notes.txt" in _refused(_cli_prepare([words], out, "--seed", "3"))
    assert _tree(out) == before
    (out / "notes.txt").unlink()
    shard = out / read_index(out)["splits"]["train"]["files"][0]["file"]
    raw = bytearray(shard.read_bytes())
    raw[0] ^= 1
    shard.write_bytes(bytes(raw))
    before = _tree(out)
    assert shard.name in _refused(_cli_prepare([words], out, "--seed", "3"))
    assert _tree(out) == before


def test_files_flopwise_adds_are_recorded_and_big_files_checked_by_their_ends(tmp_path, words, monkeypatch):
    """A file flopwise adds beside the data (a run's recipe.json) goes into the manifest, so the folder
    stays replaceable; a file above FULL_CHECK_BYTES is checked by size and the sha256 of its ends."""
    from flopwise.data.shards import DATA_MANIFEST
    from flopwise.files import ownership as manifests

    out = tmp_path / "data"
    monkeypatch.setattr(manifests, "FULL_CHECK_BYTES", 1000)
    monkeypatch.setattr(manifests, "ENDS_BYTES", 100)
    prepare_data([str(words)], out, tokenizer="bpe:300", workers=1)
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["files"]) == {p.name for p in out.iterdir()} - {"manifest.json"}
    shard = out / "train-00000.bin"
    assert (
        manifest["files"][shard.name]["bytes"] == shard.stat().st_size > 1000
        and "ends" in manifest["files"][shard.name]
    )
    manifests.add_to_manifest(out, DATA_MANIFEST, "recipe.json", b'{"seed": 0}')
    assert manifests.why_not_ours(out, DATA_MANIFEST) is None
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1  # a change in the last ENDS_BYTES is seen; one in the middle of a big shard is not read
    shard.write_bytes(bytes(raw))
    assert "train-00000.bin has changed" in manifests.why_not_ours(out, DATA_MANIFEST)
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    prepare_data([str(words)], out, tokenizer="bpe:300", workers=1, seed=5)
    assert read_index(out)["seed"] == 5 and not (out / "recipe.json").exists()
