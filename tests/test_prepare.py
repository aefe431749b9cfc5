"""The datatrove prepare pipeline: identity with the single-process reference, resume after a
kill, and each filter/dedup stage measured against a planted corpus."""

import json
import os
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

from flopwise.data.shards import iter_documents, open_split, prepare, read_index, resolve_input, val_documents
from flopwise.data.steps import Whitespace
from flopwise.data.tokenizer import train_bpe
from flopwise.errors import DataError

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_shards_equal_the_single_process_reference(tmp_path):
    """2 workers, 3 tasks: the concatenated shards are byte-identical to encoding every document
    in one process, the split picks the same documents (val_documents over ordinals), the
    tokenizer is the one trained on all documents, and the held-out plays of the eval tasks are
    the val documents (demo.toml's settings: seed 1337, val_fraction 0.05)."""
    out = tmp_path / "sp"
    prepare(["builtin:shakespeare"], out, tokenizer="bpe:4096", val_fraction=0.05, seed=1337, workers=2, tasks=3)
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
        assert np.array_equal(tokens[10:len(ids) - 10], ids[10:-10])  # a slice across every shard
    from flopwise.eval.tasks import heldout_plays

    vtok = open_split(out, "val")
    held = [tok.decode(list(vtok[s:s + n - 1])) for s, n in meta["splits"]["val"]["documents"]]
    assert held == heldout_plays() == [docs[i] for i in sorted(val)]


def _files(d: Path) -> dict[str, bytes]:
    """Every file's bytes; report.json without its timings (the only part that may differ)."""
    files = {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}
    report = json.loads(files.pop("report.json"))
    report.pop("wall_seconds")
    for row in report["stages"]:
        row.pop("cpu_seconds")
    return files | {"report.json": report}


def test_killed_prepare_resumes_to_the_same_bytes(tmp_path):
    """SIGKILL a prepare after its first finished task; the rerun keeps the finished shards
    (datatrove's completion markers), runs the rest, and ends byte-identical to a clean run."""
    plays = tmp_path / "plays"
    plays.mkdir()
    for f in sorted(resolve_input("builtin:shakespeare").iterdir())[:12]:
        (plays / f.name).write_bytes(f.read_bytes())
    args = dict(tokenizer="bpe:512", val_fraction=0.1, seed=0, workers=1, tasks=6)
    clean = tmp_path / "clean"
    prepare([str(plays)], clean, **args)
    out = tmp_path / "killed"
    code = f"from flopwise.data.shards import prepare; prepare([{str(plays)!r}], {str(out)!r}, **{args!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": SRC},
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    done = out / "work" / "logs" / "tokenize" / "completions"
    deadline = time.time() + 120
    while not (done.is_dir() and any(done.iterdir())) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = sorted(p.name for p in done.iterdir())
    assert proc.returncode == -signal.SIGKILL and not (out / "index.json").exists() and 1 <= len(finished) < 6
    written = {f: (out / f"train-{f}.bin").stat().st_mtime_ns for f in finished}
    prepare([str(plays)], out, **args)
    assert _files(out) == _files(clean) and not (out / "work").exists()
    # the finished tasks were not run again: their shards are the ones the killed run wrote
    assert written == {f: (out / f"train-{f}.bin").stat().st_mtime_ns for f in finished}


# ---- planted corpus ----------------------------------------------------------------------------

def _prose(n_docs: int, words: int = 300) -> list[str]:
    """Ordinary prose: 300-word pieces of Alice, Wikipedia and Hamlet, wrapped 12 words a line."""
    texts = [resolve_input("builtin:alice").read_text(), resolve_input("builtin:enwiki").read_text(),
             (resolve_input("builtin:shakespeare") / "hamlet_gut.txt").read_text()]
    docs = []
    for k in range(n_docs):
        w = texts[k % 3].split()
        start = 500 + (k // 3) * words
        piece = w[start:start + words]
        docs.append("\n".join(" ".join(piece[j:j + 12]) for j in range(0, words, 12)))
    return docs


def _shingles(text: str) -> set:
    w = simplify_text(text).split()
    return {tuple(w[i:i + 5]) for i in range(len(w) - 4)}


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
        return [" ".join(w[at + i * k:at + (i + 1) * k]) for i in range(n)]

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
    stats = prepare([str(corpus)], out, tokenizer="bpe:1024", val_fraction=0.0, workers=1,
                    filters="gopher", dedup="exact,minhash")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokens = open_split(out, "train")
    kept = [tok.decode(list(tokens[s:s + n - 1])) for s, n in read_index(out)["splits"]["train"]["documents"]]
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
        prepare(["builtin:alice"], tmp_path / "o", filters="gopher,fineweb")
    with pytest.raises(DataError, match="--dedup bloom: unknown"):
        prepare(["builtin:alice"], tmp_path / "o", dedup="bloom")


def test_unfinished_prepare_folder_is_flopwise_s_own(tmp_path):
    """A folder with prepare's work marker (a run killed before index.json) may be resumed or
    replaced; a folder that merely has a `work/` subfolder is someone else's and is refused."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    (ours / "work").mkdir(parents=True)
    (ours / "work" / "flopwise-prepare").touch()
    (theirs / "work").mkdir(parents=True)
    (theirs / "work" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="no such file"):
        prepare([str(tmp_path / "missing.txt")], ours)
    with pytest.raises(DataError, match="--force"):
        prepare([str(tmp_path / "missing.txt")], theirs)
    assert (theirs / "work" / "notes.txt").read_text() == "mine"
