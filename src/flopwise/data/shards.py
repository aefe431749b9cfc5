"""Text -> token shards: numbered flat token files per split (uint16/uint32 memmaps) plus one JSON index.

Layout of a prepared data dir:
  index.json      format, dtype, vocab, eos id, per split: files (name, tokens) in order, token
                  count, documents ([start, length] in tokens over the split's concatenated files),
                  and counts (documents, tokens, bytes)
  train-00000.bin, train-00001.bin, ..., val-00000.bin, ...   one of each per pipeline task
  tokenizer.json  the tokenizer that made them
  report.json     what each filter and deduplication stage removed (data/prepare.py)
  manifest.json   what proves the folder is flopwise's (MANIFEST_FORMAT): every file prepare wrote,
                  with its size and sha256; written before the index, rewritten as prepare goes on
Documents are separated by EOS; the train/val split is by document (a seeded shuffle of document
ordinals), so no text is in both. Readers check that every file agrees with the index before
anything trains on it. index.json is written last: a folder without it is a prepare in progress.

"Did flopwise write this folder?" is answered by its manifest, never by file names: prepare
replaces or resumes a folder only if every file in it is one the manifest records (`why_not_ours`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from flopwise.data.tokenizer import load_tokenizer
from flopwise.errors import DataError
from flopwise.files.ownership import ManifestKind

SHARDS_FORMAT = "flopwise-shards/2"
_BUILTIN = {
    "shakespeare": "corpus/shakespeare",
    "alice": "corpus/eval/alice29.txt",
    "enwiki": "corpus/eval/enwiki-105-articles.txt",
}
_TEXT_SUFFIXES = {".txt", ".md", ".text", ""}
WORK = "work"  # the unfinished-prepare folder inside --out: plan, logs, dedup intermediates
DATA_MANIFEST = ManifestKind("manifest.json", "flopwise-data-manifest/1")  # what proves a data dir is flopwise's


def resolve_input(spec: str) -> Path:
    """`builtin:NAME` -> the corpus shipped in the package; anything else -> a path."""
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        if name not in _BUILTIN:
            raise DataError(
                f"data input {spec!r}: unknown built-in corpus (known: {', '.join('builtin:' + k for k in _BUILTIN)})"
            )
        return Path(str(resources.files("flopwise") / _BUILTIN[name]))
    p = Path(spec)
    if not p.exists():
        raise DataError(f"data input {spec}: no such file or directory")
    return p


def read_text(path: Path) -> str:
    raw = path.read_bytes()
    if b"\x00" in raw[:65536]:
        raise DataError(f"data file {path}: looks binary (NUL bytes); give UTF-8 text, JSONL or Parquet")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path}: not UTF-8 text (bad byte at offset {e.start})") from None


def _jsonl_documents(path: Path, start: int, line: int) -> Iterator[tuple[int, int, str]]:
    with open(path, "rb") as f:
        if start == 0 and b"\x00" in f.read(65536):
            raise DataError(f"data file {path}: looks binary (NUL bytes); give UTF-8 text, JSONL or Parquet")
        f.seek(start)
        pos = start
        for n, raw in enumerate(f, line):
            here, pos = pos, pos + len(raw)
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise DataError(f"data file {path}: not UTF-8 text (bad byte at offset {here + e.start})") from None
            except json.JSONDecodeError:
                raise DataError(f"data file {path}: line {n} is not JSON") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise DataError(f"data file {path}: line {n} has no string field 'text'")
            try:
                rec["text"].encode("utf-8")
            except UnicodeEncodeError as e:  # a JSON escape of half a surrogate pair: not text, no token for it
                raise DataError(
                    f"data file {path}: line {n}: 'text' holds a lone surrogate "
                    f"(\\u{ord(rec['text'][e.start]):04x}), which is not Unicode text; fix the line's "
                    "escapes"
                ) from None
            if rec["text"].strip():
                yield here, n, rec["text"]


Skipped = dict[str, list[str]]  # what an input walk left out: reason -> the paths (and counts) it names


def skip(skipped: Skipped | None, reason: str, what: str) -> None:
    if skipped is not None:
        skipped.setdefault(reason, []).append(what)


def skipped_note(skipped: Skipped) -> str:
    """`skipped` in a few words for a summary or an error line: reasons, counts, the first names."""
    return "; ".join(
        f"{len(names)} {reason} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
        for reason, names in skipped.items()
    )


def _parquet_documents(path: Path, start: int, skipped: Skipped | None = None) -> Iterator[tuple[int, int, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"data file {path}: reading Parquet needs pyarrow (pip install 'flopwise[parquet]')") from None
    try:
        pf = pq.ParquetFile(path)
        if "text" not in pf.schema_arrow.names:
            raise KeyError("no column 'text'")
    except Exception as e:
        raise DataError(f"data file {path}: cannot read a 'text' column ({str(e).splitlines()[0][:100]})") from None
    # start at the row group holding row `start` instead of decoding the rows before it
    row = 0
    groups: list[int] = []
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if row + n > start or groups:
            groups.append(g)
        else:
            row += n
    wrong = 0
    for batch in pf.iter_batches(columns=["text"], row_groups=groups, batch_size=4096):
        for text in batch.column(0).to_pylist():
            if row >= start and isinstance(text, str) and text.strip():
                yield row, row + 1, text
            if row >= start and text is not None and not isinstance(text, str):  # binary: not text
                wrong += 1
            row += 1
    if wrong:
        skip(skipped, "Parquet files with rows whose text is not a string", f"{path}: {wrong} of its rows")


def read_documents(
    path: Path, start: int = 0, line: int = 1, skipped: Skipped | None = None
) -> Iterator[tuple[int, int, str]]:
    """(position, line, text) of every non-empty document of one file from position `start` on: a
    JSONL line (its byte offset and line number), a Parquet row (its index), or a whole text file
    (position 0). Streamed: one document in memory at a time. Parquet rows whose text is binary are
    left out and counted in `skipped`."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl_documents(path, start, line)
    elif suffix == ".parquet":
        yield from _parquet_documents(path, start, skipped)
    elif start == 0:
        text = read_text(path)
        if text.strip():
            yield 0, 1, text


def input_files(spec: str, skipped: Skipped | None = None) -> list[Path]:
    """The files of one input, in the order documents are numbered: folders are walked sorted
    (symlinked folders are not entered). What the walk leaves out (unreadable folders, broken
    links, files of another type) goes into `skipped`; nothing usable left is a DataError saying so."""
    root = resolve_input(spec)
    left: Skipped = {}
    if root.is_dir():
        found = []
        for folder, _, names in os.walk(root, onerror=lambda e: skip(left, "unreadable folders", str(e.filename))):
            for name in names:
                p = Path(folder) / name
                if p.is_file():
                    found.append(p)
                else:
                    skip(left, "broken or looping links and special files", str(p))
        files = sorted(found)
    else:
        files = [root]
    for f in files:
        if f.suffix.lower() not in _TEXT_SUFFIXES | {".jsonl", ".parquet"}:
            skip(left, "files of another type (not .txt, .md, .jsonl, .parquet)", str(f))
    files = [f for f in files if f.suffix.lower() in _TEXT_SUFFIXES | {".jsonl", ".parquet"}]
    if not files:
        raise DataError(
            f"data input {spec}: no .txt, .jsonl or .parquet files found"
            + (f" (skipped: {skipped_note(left)})" if left else "")
        )
    for reason, names in left.items():
        for name in names:
            skip(skipped, reason, name)
    return files


def iter_documents(inputs: list[str]) -> Iterator[tuple[str, str]]:
    """(source, text) for every non-empty document: a text file is one document, a JSONL line or
    a Parquet row is one, folders are walked in sorted order. Their order defines the document
    ordinals that the train/val split is drawn over."""
    for spec in inputs:
        for f in input_files(spec):
            for _, _, text in read_documents(f):
                yield str(f), text


@dataclass
class PrepareStats:
    documents: int
    tokens: int
    bytes: int
    seconds: float
    splits: dict[str, int]
    report: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def data_fingerprint(data_dir: str | Path) -> str:
    """What identifies a prepared data folder's content (its index: documents, splits, counts and
    the tokenizer's vocabulary size): the sha256 of index.json."""
    return hashlib.sha256((Path(data_dir) / "index.json").read_bytes()).hexdigest()


def input_digest(spec: str) -> str:
    """What identifies a raw input by content before it is prepared: the sha256 over its files'
    names (relative to the input) and bytes, in the order prepare reads them."""
    root = resolve_input(spec)
    h = hashlib.sha256()
    for f in input_files(spec):
        h.update(os.fsencode(f.relative_to(root) if root.is_dir() else f.name) + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def val_documents(n_docs: int, val_fraction: float, seed: int) -> set[int]:
    """Indices of the documents `prepare` puts in the val split (tasks built from held-out text use it)."""
    order = np.random.default_rng(seed).permutation(n_docs)
    n_val = math.ceil(val_fraction * n_docs) if val_fraction > 0 and n_docs > 1 else 0
    return {int(i) for i in order[: min(n_val, n_docs - 1)]}


def read_index(data_dir: str | Path) -> dict:
    d = Path(data_dir)
    p = d / "index.json"
    if not p.is_file():
        raise DataError(f"data dir {d}: no index.json (prepare it with `flopwise data prepare`)")
    try:
        meta = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DataError(f"data index {p}: not valid JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != SHARDS_FORMAT:
        raise DataError(f"data index {p}: not a {SHARDS_FORMAT} index")
    try:
        vocab, dtype = int(meta["vocab_size"]), np.dtype(meta["dtype"])
        for split in ("train", "val"):
            list(meta["splits"][split]["files"]), int(meta["splits"][split]["tokens"])
    except (KeyError, TypeError, ValueError, OverflowError):
        raise DataError(f"data index {p}: missing or malformed fields (vocab_size, dtype, splits)") from None
    if vocab < 1:
        raise DataError(f"data index {p}: vocab_size {vocab} must be at least 1")
    if dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)) or vocab > 1 << (8 * dtype.itemsize):
        raise DataError(f"data index {p}: vocab_size {vocab} does not fit dtype {dtype.name}")
    return meta


class ShardedTokens:
    """One split's tokens over its shard files, read as one array: `len()` and `tokens[a:b]` (which
    may cross shard boundaries; a copy only then). `np.asarray(tokens)` reads the whole split."""

    def __init__(self, parts: Sequence[np.ndarray], dtype: np.dtype):
        self.parts = [p for p in parts if len(p)]
        self.dtype = dtype
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key):
        if isinstance(key, slice):
            a, b, step = key.indices(len(self))
            if step != 1:
                raise IndexError("ShardedTokens supports contiguous slices only")
            if b <= a:
                return np.zeros(0, dtype=self.dtype)
            first = int(np.searchsorted(self.starts, a, side="right")) - 1
            last = int(np.searchsorted(self.starts, b - 1, side="right")) - 1
            pieces = [
                self.parts[k][max(a - self.starts[k], 0) : min(b - self.starts[k], len(self.parts[k]))]
                for k in range(first, last + 1)
            ]
            return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        i = int(key) + (len(self) if int(key) < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"token {key} out of range for {len(self)} tokens")
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[k][i - self.starts[k]]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[0 : len(self)] if len(self) else np.zeros(0, dtype=self.dtype)
        return np.asarray(whole, dtype=dtype)


def _check_shard_file(path: Path) -> None:
    """A shard the index lists is a readable file: said as missing, not a file, or unreadable."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise DataError(f"data shard {path}: not a file; re-run data prepare")
    except FileNotFoundError:
        raise DataError(f"data shard {path}: missing; re-run data prepare") from None
    except OSError as e:
        raise DataError(f"data shard {path}: unreadable ({e.strerror}); check its permissions and disk") from None
    if not os.access(path, os.R_OK):
        raise DataError(f"data shard {path}: unreadable (permission denied); check its permissions")


def open_split(data_dir: str | Path, split: str) -> ShardedTokens:
    """Memory-map one split's shard files after checking each against the index (size, token ids
    below vocab_size, plain file names inside the data dir)."""
    d = Path(data_dir)
    meta = read_index(d)
    entry = meta["splits"][split]
    dtype = np.dtype(meta["dtype"])
    parts = []
    for shard in entry["files"]:
        path = _member(d, shard.get("file") if isinstance(shard, dict) else None)
        _check_shard_file(path)
        if not isinstance(shard.get("tokens"), int) or shard["tokens"] < 0:
            raise DataError(f"data index {d / 'index.json'}: shard {path.name} needs a token count >= 0")
        expected = shard["tokens"] * dtype.itemsize
        if path.stat().st_size != expected:
            raise DataError(
                f"data shard {path}: {path.stat().st_size} bytes, but the index says "
                f"{shard['tokens']} tokens of {dtype.name} ({expected} bytes); re-run data prepare"
            )
        if not expected:
            continue
        try:
            tokens = np.memmap(path, dtype=dtype, mode="r")
        except OSError as e:
            raise DataError(f"data shard {path}: unreadable ({e.strerror}); check its permissions and disk") from None
        step = 1 << 24
        top = max(int(tokens[i : i + step].max()) for i in range(0, len(tokens), step))
        if top >= meta["vocab_size"]:
            raise DataError(
                f"data shard {path}: token id {top} >= vocab_size {meta['vocab_size']}; "
                "the shard does not belong to this index"
            )
        parts.append(tokens)
    result = ShardedTokens(parts, dtype)
    if len(result) != int(entry["tokens"]):
        raise DataError(
            f"data index {d / 'index.json'}: split {split} says {entry['tokens']} tokens but its "
            f"files hold {len(result)}; re-run data prepare"
        )
    return result


def _member(d: Path, name) -> Path:
    """A file the index names, refused unless it is a plain name inside the data dir."""
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise DataError(f"data index {d / 'index.json'}: file name {name!r} must be a plain name inside {d}")
    return d / name


def tokenizer_path(data_dir: str | Path) -> Path:
    """The tokenizer file a data dir's index names (a plain name inside the folder, else refused)."""
    d = Path(data_dir)
    return _member(d, read_index(d).get("tokenizer"))


def tokenizer_of(data_dir: str | Path):
    return load_tokenizer(tokenizer_path(data_dir))
