"""A user's tokenizer.json cannot cut documents or crash flopwise: a truncation or padding block is
switched off with a warning that names it (token shards need whole documents), and a file the
`tokenizers` library panics on (pyo3's PanicException is a BaseException) is a one-line DataError.

Tokenizer files are built offline: a tiny byte-level BPE trained on the test documents, its JSON
then edited."""

import json
import os
import pickle
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from typer.testing import CliRunner

from flopwise.cli import app
from flopwise.data.tokenizer import EOS, load_tokenizer, train_bpe
from flopwise.errors import DataError

WORDS = (
    "alice rabbit queen hatter tea garden croquet door key bottle cake mushroom caterpillar cat "
    "grin duchess baby pepper trial tarts jury king knave court dream river sister book"
).split()
TRUNCATION = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
PADDING = {
    "strategy": "BatchLongest",
    "direction": "Right",
    "pad_to_multiple_of": None,
    "pad_id": 0,
    "pad_type_id": 0,
    "pad_token": EOS,
}
# stride >= max_length: the library panics in Encoding::truncate on any input longer than max_length
BAD_STRIDE = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 4}
# strips one "Ġ" from each end of every token: a token that is a lone space panics (slice 1..0)
STRIP = {"type": "Strip", "content": "Ġ", "start": 1, "stop": 1}


def documents(n: int = 50) -> list[str]:
    rng = random.Random(0)
    return [
        " ".join(
            " ".join(rng.choice(WORDS) for _ in range(rng.randrange(6, 14))).capitalize() + "."
            for _ in range(rng.randrange(4, 9))
        )
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """(documents.jsonl, base tokenizer.json with no truncation/padding)."""
    d = tmp_path_factory.mktemp("tok")
    docs = documents()
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        docs,
        trainer=trainers.BpeTrainer(
            vocab_size=320,
            min_frequency=2,
            special_tokens=[EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.save(str(d / "base.json"))
    return d / "docs.jsonl", d / "base.json"


def edited(base: Path, out: Path, **fields) -> Path:
    tree = json.loads(base.read_text())
    tree.update(fields)
    out.write_text(json.dumps(tree))
    return out


def reference_tokens(base: Path, docs: list[str]) -> int:
    """Tokens of whole documents (+ EOS each) by the tokenizer with no truncation or padding, read
    straight with `tokenizers`."""
    tok = Tokenizer.from_file(str(base))
    assert tok.truncation is None and tok.padding is None
    return sum(len(tok.encode(t, add_special_tokens=False).ids) + 1 for t in docs)


def prepare_cli(docs: Path, out: Path, tokenizer: Path):
    return CliRunner().invoke(
        app,
        [
            "data",
            "prepare",
            str(docs),
            "--out",
            str(out),
            "--tokenizer",
            str(tokenizer),
            "--workers",
            "1",
            "--val-fraction",
            "0.1",
        ],
    )


@pytest.mark.parametrize("field,block", [("truncation", TRUNCATION), ("padding", PADDING)])
def test_truncation_or_padding_block_keeps_whole_documents_and_warns(tmp_path, corpus, field, block):
    """Before: truncation max_length=8 kept 8 tokens of every document (450 tokens for 7,941),
    padding BatchLongest padded each to its batch's longest (11,300), exit 0, no word. After: the
    block is switched off with a warning naming it; the shards hold exactly the tokens of the same
    tokenizer with the block removed, and the data folder's tokenizer.json carries no such block."""
    docs, base = corpus
    texts = [json.loads(line)["text"] for line in docs.read_text().splitlines()]
    user = edited(base, tmp_path / f"{field}.json", **{field: block})
    with pytest.warns(UserWarning, match=f"{field}.*switched off"):
        r = prepare_cli(docs, tmp_path / "out", user)
    assert r.exit_code == 0, (r.output, r.exception)
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["counts"]["documents"] == len(texts)
    assert index["counts"]["tokens"] == reference_tokens(base, texts)
    assert json.loads((tmp_path / "out" / "tokenizer.json").read_text())[field] is None
    assert json.loads(user.read_text())[field] == block  # the user's file is left as it was


@pytest.mark.parametrize("case", ["stride", "strip"])
def test_panicking_tokenizer_is_a_one_line_error(tmp_path, corpus, case):
    """Before: a Rust panic (PanicException, not an Exception) ended `data prepare` with a Rust
    backtrace and a Python traceback. After: one line `error: tokenizer ...`, exit 2."""
    docs, base = corpus
    user = (
        edited(base, tmp_path / "stride.json", truncation=BAD_STRIDE)
        if case == "stride"
        else edited(base, tmp_path / "strip.json", decoder=STRIP)
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "flopwise",
            "data",
            "prepare",
            str(docs),
            "--out",
            str(tmp_path / "out"),
            "--tokenizer",
            str(user),
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RUST_BACKTRACE": "1", "COLUMNS": "400"},
    )
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-3000:])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert "Traceback" not in r.stderr and "panicked" not in r.stderr, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: tokenizer") and str(user) in lines[0], r.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_load_tokenizer_round_trips_a_probe(tmp_path, corpus):
    """`load_tokenizer` encodes and decodes a probe string: a decoder that panics on a lone space
    is refused at load, one line naming the file and the call."""
    _, base = corpus
    strip = edited(base, tmp_path / "strip.json", decoder=STRIP)
    Tokenizer.from_file(str(strip))  # the library itself loads it
    with pytest.raises(DataError) as e:
        load_tokenizer(strip)
    msg = str(e.value)
    assert "\n" not in msg and str(strip) in msg and "decode" in msg, msg


def test_every_call_is_guarded_after_load(tmp_path, corpus):
    """A panic the probe does not reach (here: decoding a lone-space token, encoding past a bad
    truncation) is a DataError from the guarded tokenizer, not a PanicException."""
    from flopwise.data.tokenizer import guarded

    _, base = corpus
    raw = Tokenizer.from_file(str(edited(base, tmp_path / "strip.json", decoder=STRIP)))
    space = raw.token_to_id("Ġ")
    tok = guarded(raw, "strip.json")
    with pytest.raises(DataError, match="strip.json.*decode"):
        tok.decode([space])
    with pytest.raises(DataError, match="decode_batch"):
        tok.decode_batch([[space]])
    raw = Tokenizer.from_file(str(edited(base, tmp_path / "stride.json", truncation=BAD_STRIDE)))
    tok = guarded(raw, "stride.json")
    with pytest.raises(DataError, match="stride.json.*encode"):
        tok.encode("alice rabbit queen hatter tea garden croquet door key bottle cake")
    with pytest.raises(DataError, match="encode_batch"):
        tok.encode_batch(["alice rabbit queen hatter tea garden croquet door key bottle cake " * 3])
    assert guarded(tok) is tok  # not wrapped twice


def test_loaded_and_trained_tokenizers_behave_as_the_library(tmp_path, corpus):
    """The guard changes nothing for a sound tokenizer: same ids, text, vocab; saves, pickles."""
    from flopwise.data.tokenizer import guarded

    docs, base = corpus
    raw = Tokenizer.from_file(str(base))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean file loads without a warning
        tok = load_tokenizer(base)
    text = json.loads(docs.read_text().splitlines()[0])["text"]
    assert tok.encode(text).ids == raw.encode(text).ids
    assert [e.ids for e in tok.encode_batch([text, "x"])] == [e.ids for e in raw.encode_batch([text, "x"])]
    assert tok.decode(raw.encode(text).ids) == raw.decode(raw.encode(text).ids)
    assert tok.get_vocab_size() == raw.get_vocab_size() and tok.token_to_id(EOS) == raw.token_to_id(EOS)
    assert tok.truncation is None and tok.padding is None
    tok.save(str(tmp_path / "saved.json"))
    assert Tokenizer.from_file(str(tmp_path / "saved.json")).encode(text).ids == raw.encode(text).ids
    assert pickle.loads(pickle.dumps(tok)).encode(text).ids == raw.encode(text).ids
    trained = train_bpe([text] * 4, 300)
    assert guarded(trained) is trained and trained.get_vocab_size() <= 300


def test_valid_truncation_loaded_directly_is_switched_off(tmp_path, corpus):
    """`load_tokenizer` itself (every reader: data dirs, checkpoints, HF import) switches the
    blocks off, so no caller encodes a cut document."""
    docs, base = corpus
    text = json.loads(docs.read_text().splitlines()[0])["text"]
    both = edited(base, tmp_path / "both.json", truncation=TRUNCATION, padding=PADDING)
    with pytest.warns(UserWarning) as seen:
        tok = load_tokenizer(both)
    named = " ".join(str(w.message) for w in seen)
    assert "truncation" in named and "padding" in named and str(both) in named
    assert tok.encode(text).ids == Tokenizer.from_file(str(base)).encode(text).ids
