"""Text -> token shards: one flat token file per split (uint16/uint32 memmap) plus a JSON index.

Layout of a prepared data dir:
  index.json      format, dtype, vocab, eos id, per split: file, token count, documents
                  ([start, length] in tokens), and counts (documents, tokens, bytes)
  train.bin, val.bin
  tokenizer.json  the tokenizer that made them
Documents are separated by EOS; the train/val split is by document (a seeded shuffle), so no text
is in both. Readers check that every file agrees with the index before anything trains on it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from flopwise.data.tokenizer import EOS, eos_id, load_tokenizer, parse_tokenizer_spec, train_bpe
from flopwise.errors import DataError

FORMAT = "flopwise-shards/1"
BUILTIN = {"shakespeare": "corpus/shakespeare", "alice": "corpus/eval/alice29.txt",
           "enwiki": "corpus/eval/enwiki-105-articles.txt"}
TEXT_SUFFIXES = {".txt", ".md", ".text", ""}


def resolve_input(spec: str) -> Path:
    """`builtin:NAME` -> the corpus shipped in the package; anything else -> a path."""
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        if name not in BUILTIN:
            raise DataError(f"data input {spec!r}: unknown built-in corpus (known: "
                            f"{', '.join('builtin:' + k for k in BUILTIN)})")
        return Path(str(resources.files("flopwise") / BUILTIN[name]))
    p = Path(spec)
    if not p.exists():
        raise DataError(f"data input {spec}: no such file or directory")
    return p


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    if b"\x00" in raw[:65536]:
        raise DataError(f"data file {path}: looks binary (NUL bytes); give UTF-8 text, JSONL or Parquet")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path}: not UTF-8 text (bad byte at offset {e.start})") from None


def _documents_in_file(path: Path) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        for n, line in enumerate(_read_text(path).splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise DataError(f"data file {path}: line {n} is not JSON") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise DataError(f"data file {path}: line {n} has no string field 'text'")
            yield rec["text"]
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"data file {path}: reading Parquet needs pyarrow (pip install 'flopwise[parquet]')") from None
        try:
            table = pq.read_table(path, columns=["text"])
        except Exception as e:
            raise DataError(f"data file {path}: cannot read a 'text' column ({str(e).splitlines()[0][:100]})") from None
        yield from (t for t in table.column("text").to_pylist() if isinstance(t, str))
    else:
        yield _read_text(path)


def iter_documents(inputs: list[str]) -> Iterator[tuple[str, str]]:
    """(source, text) for every non-empty document: a text file is one document, a JSONL line or
    a Parquet row is one, folders are walked in sorted order."""
    for spec in inputs:
        root = resolve_input(spec)
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        files = [f for f in files if f.suffix.lower() in TEXT_SUFFIXES | {".jsonl", ".parquet"}]
        if not files:
            raise DataError(f"data input {spec}: no .txt, .jsonl or .parquet files found")
        for f in files:
            for doc in _documents_in_file(f):
                if doc.strip():
                    yield str(f), doc


@dataclass
class PrepareStats:
    documents: int
    tokens: int
    bytes: int
    seconds: float
    splits: dict[str, int]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def fingerprint(data_dir: str | Path) -> str:
    """What identifies a prepared data folder's content (its index: documents, splits, counts and
    the tokenizer's vocabulary size): the sha256 of index.json."""
    return hashlib.sha256((Path(data_dir) / "index.json").read_bytes()).hexdigest()


def _replaceable(out: Path) -> bool:
    """A folder prepare may replace: absent, empty, or a flopwise data folder (its index.json)."""
    if not out.exists():
        return True
    if not out.is_dir():
        return False
    return not any(out.iterdir()) or (out / "index.json").is_file() and (out / "tokenizer.json").is_file()


def val_documents(n_docs: int, val_fraction: float, seed: int) -> set[int]:
    """Indices of the documents `prepare` puts in the val split (tasks built from held-out text use it)."""
    order = np.random.default_rng(seed).permutation(n_docs)
    n_val = math.ceil(val_fraction * n_docs) if val_fraction > 0 and n_docs > 1 else 0
    return {int(i) for i in order[:min(n_val, n_docs - 1)]}


def prepare(inputs: list[str], out: str | Path, tokenizer: str = "bpe:4096", val_fraction: float = 0.05,
            seed: int = 0, progress: Callable[[int, int], None] | None = None, force: bool = False) -> PrepareStats:
    """Tokenize `inputs` into `out`. Written to a temporary folder and renamed when complete; an
    existing `out` is replaced only if it is a flopwise data folder (or empty), unless `force`."""
    t0 = time.perf_counter()
    if not force and not _replaceable(Path(out)):
        raise DataError(f"--out {out}: exists and is not a flopwise data folder (no index.json + tokenizer.json); "
                        "choose another folder or pass --force to replace it")
    docs = list(iter_documents(inputs))
    if not docs:
        raise DataError(f"data input {', '.join(inputs)}: contains no text")
    spec = parse_tokenizer_spec(tokenizer)
    tok = train_bpe((d for _, d in docs), spec) if isinstance(spec, int) else load_tokenizer(spec)
    eos, vocab = eos_id(tok), tok.get_vocab_size()
    dtype = dtype_for_vocab(vocab)

    val = val_documents(len(docs), val_fraction, seed)
    split_of = {i: ("val" if i in val else "train") for i in range(len(docs))}

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = {s: open(tmp / f"{s}.bin", "wb") for s in ("train", "val")}
    index = {s: {"file": f"{s}.bin", "tokens": 0, "documents": []} for s in ("train", "val")}
    counts = np.zeros(vocab, dtype=np.int64)
    total_bytes = sum(len(d.encode()) for _, d in docs)
    done_bytes = 0
    batch = 64
    for b in range(0, len(docs), batch):
        chunk = docs[b:b + batch]
        encodings = tok.encode_batch([d for _, d in chunk], add_special_tokens=False)
        for k, enc in enumerate(encodings):
            split = split_of[b + k]
            ids = np.asarray(enc.ids + [eos], dtype=dtype)
            entry = index[split]
            entry["documents"].append([entry["tokens"], len(ids)])
            entry["tokens"] += len(ids)
            files[split].write(ids.tobytes())
            if split == "train":
                counts += np.bincount(ids, minlength=vocab)
            done_bytes += len(chunk[k][1].encode())
        if progress:
            progress(done_bytes, total_bytes)
    for f in files.values():
        f.close()
    tok.save(str(tmp / "tokenizer.json"))
    probs = counts[counts > 0] / counts.sum()
    meta = {
        "format": FORMAT, "dtype": dtype.name, "vocab_size": vocab, "eos_id": eos, "eos": EOS,
        "tokenizer": "tokenizer.json", "seed": seed, "val_fraction": val_fraction,
        "sources": sorted({s for s, _ in docs}),
        "splits": index,
        "counts": {"documents": len(docs), "tokens": sum(e["tokens"] for e in index.values()), "bytes": total_bytes},
        "unigram_entropy_nats": float(-(probs * np.log(probs)).sum()),
    }
    (tmp / "index.json").write_text(json.dumps(meta))
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    os.replace(tmp, out)
    return PrepareStats(len(docs), meta["counts"]["tokens"], total_bytes, time.perf_counter() - t0,
                        {s: e["tokens"] for s, e in index.items()})


def read_index(data_dir: str | Path) -> dict:
    d = Path(data_dir)
    p = d / "index.json"
    if not p.is_file():
        raise DataError(f"data dir {d}: no index.json (prepare it with `flopwise data prepare`)")
    try:
        meta = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DataError(f"data index {p}: not valid JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"data index {p}: not a {FORMAT} index")
    try:
        vocab, dtype = int(meta["vocab_size"]), np.dtype(meta["dtype"])
        meta["splits"]["train"], meta["splits"]["val"]
    except (KeyError, TypeError, ValueError):
        raise DataError(f"data index {p}: missing or malformed fields (vocab_size, dtype, splits)") from None
    if vocab < 1:
        raise DataError(f"data index {p}: vocab_size {vocab} must be at least 1")
    if dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)) or vocab > np.iinfo(dtype).max + 1:
        raise DataError(f"data index {p}: vocab_size {vocab} does not fit dtype {dtype.name}")
    return meta


def open_split(data_dir: str | Path, split: str) -> np.ndarray:
    """Memory-map one split's tokens after checking them against the index."""
    d = Path(data_dir)
    meta = read_index(d)
    entry = meta["splits"][split]
    dtype = np.dtype(meta["dtype"])
    path = _member(d, entry.get("file"))
    if not path.is_file():
        raise DataError(f"data shard {path}: missing")
    expected = int(entry["tokens"]) * dtype.itemsize
    if path.stat().st_size != expected:
        raise DataError(f"data shard {path}: {path.stat().st_size} bytes, but the index says "
                        f"{entry['tokens']} tokens of {dtype.name} ({expected} bytes); re-run data prepare")
    if entry["tokens"] == 0:
        return np.zeros(0, dtype=dtype)
    tokens = np.memmap(path, dtype=dtype, mode="r")
    step = 1 << 24
    top = max(int(tokens[i:i + step].max()) for i in range(0, len(tokens), step))
    if top >= meta["vocab_size"]:
        raise DataError(f"data shard {path}: token id {top} >= vocab_size {meta['vocab_size']}; "
                        "the shard does not belong to this index")
    return tokens


def _member(d: Path, name) -> Path:
    """A file the index names, refused unless it is a plain name inside the data dir."""
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise DataError(f"data index {d / 'index.json'}: file name {name!r} must be a plain name inside {d}")
    return d / name


def tokenizer_of(data_dir: str | Path):
    d = Path(data_dir)
    return load_tokenizer(_member(d, read_index(d).get("tokenizer")))
