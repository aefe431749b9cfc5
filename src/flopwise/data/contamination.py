"""Benchmark contamination: n-gram overlap between training text and evaluation tasks, the rule of
GPT-3 (Brown et al. 2020, App. C), and a datatrove filter that drops contaminated training documents.

The rule, stated once:
- Normalization: lowercase, then every character that is not a letter or digit (`str.isalnum`) is a
  word boundary; words are the maximal runs of letters and digits ("Condemn'd to--LOSS!" ->
  condemn d to loss). Punctuation, case and whitespace changes therefore never hide an overlap.
- An example's text is what the model reads when it is scored: context + correct answer (the gold
  choice of a multiple-choice task, the target of a cloze). Wrong choices are left out: they are text
  from elsewhere, and would flag the example for another passage's sake.
- Grams: every n consecutive words of that text (n = 13 as GPT-3). An example shorter than n words is
  one gram of its full length (GPT-3's treatment of short examples), so it counts as contaminated
  when its whole normalized text occurs in a training document; short examples (a few words) can
  therefore match common phrases. An example without words has no gram and is always clean.
- An example is contaminated when any of its grams occurs in any training document; a training
  document is touched when it contains any gram of any example (the filter drops those).
- Hashing: a gram is the 64-bit multilinear hash sum(a_i * v_i) mod 2^64 of its words' 64-bit values
  v_i (blake2b of the word) under fixed odd multipliers a_i. Only words of some example get a value:
  a training window holding any other word cannot match and is skipped exactly. A false match needs
  two different grams with one hash, about 2^-64 per pair, so G task grams against W training words
  expect G*W/2^64 false matches (1e5 grams against 1e12 words: 0.005).
Task grams are small and held in memory (sorted arrays); training text is streamed document by
document, never held whole.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from datatrove.data import Document
from datatrove.pipeline.filters.base_filter import BaseFilter

from flopwise.errors import DataError

_GPT3_N = 13
_WORD = re.compile(r"[^\W_]+")  # \w minus the underscore: exactly the str.isalnum characters
# one fixed odd 64-bit multiplier per word position of a gram (seeded: the same hashes in every process)
_MULTIPLIERS = np.random.default_rng(2020).integers(0, 2**63, size=4096, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def words(text: str) -> list[str]:
    """The normalized words of a text (lowercase, split at every non-alphanumeric character)."""
    return _WORD.findall(text.lower())


def _example_text(example) -> str:
    """What the model reads for an example when it is scored: context + correct answer."""
    return example.context + example.answer


def _word_value(word: str) -> int:
    """A word's 64-bit value, never 0: 0 marks training words that no example has."""
    return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little") or 1


def _window_hashes(values: np.ndarray, lengths: Iterable[int]) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(m, hash of every m-word window, whether all its words are known) for each length m of a
    document's word values; the sums grow one word at a time, so all lengths cost as much as the longest."""
    unknown = np.concatenate(([0], np.cumsum(values == 0)))
    h = np.zeros(len(values), dtype=np.uint64)
    done = 0
    for m in sorted(lengths):
        if m > len(values):
            return
        count = len(values) - m + 1
        for i in range(done, m):
            h = h[:count] + _MULTIPLIERS[i] * values[i : i + count]
        done = m
        yield m, h, unknown[m:] == unknown[:count]


@dataclass
class _Grams:
    """The grams of one length: sorted unique hashes, and for every (example, gram) pair its key."""

    keys: np.ndarray
    key_of_pair: np.ndarray
    example_of_pair: np.ndarray


class TaskGrams:
    """The grams of every example of some tasks, to test training text against."""

    def __init__(self, tasks: list[tuple[str, list[str]]], n: int = _GPT3_N):
        if not 1 <= n <= len(_MULTIPLIERS):
            raise DataError(f"--n {n}: the n-gram length must be between 1 and {len(_MULTIPLIERS)} (GPT-3: 13)")
        if not tasks:
            raise DataError("--tasks: no task given; name built-in tasks or JSONL files, comma-separated")
        self.names = [name for name, _ in tasks]
        self.sizes = [len(texts) for _, texts in tasks]
        self.values: dict[str, int] = {}
        pairs: dict[int, tuple[list[int], list[int]]] = {}  # gram length -> (hashes, example ids)
        texts = [t for _, ts in tasks for t in ts]
        for k, text in enumerate(texts):
            ws = words(text)
            if not ws:
                continue
            for w in ws:
                self.values.setdefault(w, _word_value(w))
            m = min(n, len(ws))
            ((_, h, _),) = _window_hashes(self._values(ws), [m])
            hashes, owners = pairs.setdefault(m, ([], []))
            hashes += h.tolist()
            owners += [k] * len(h)
        self.grams = {}
        for m, (hashes, owners) in sorted(pairs.items()):
            keys, inverse = np.unique(np.array(hashes, dtype=np.uint64), return_inverse=True)
            self.grams[m] = _Grams(keys, inverse.ravel(), np.array(owners, dtype=np.int64))

    def _values(self, ws: list[str]) -> np.ndarray:
        get = self.values.get
        return np.array([get(w, 0) for w in ws], dtype=np.uint64)

    def hits(self, ws: list[str]) -> dict[int, np.ndarray]:
        """For each gram length, the indices of the keys that occur in a document's normalized words
        (possibly repeated)."""
        out = {}
        for m, h, known in _window_hashes(self._values(ws), self.grams):
            g = self.grams[m]
            h = h[known]
            pos = np.minimum(np.searchsorted(g.keys, h), len(g.keys) - 1)
            found = pos[g.keys[pos] == h]
            if len(found):
                out[m] = found
        return out

    def touches(self, text: str) -> bool:
        """Whether a training document contains any gram of any example."""
        return bool(self.hits(words(text)))


@dataclass
class Contamination:
    """Per task, which examples share a gram with the training data; which training documents do."""

    tasks: list[str]
    examples: list[int]
    contaminated: list[list[int]]
    documents: int = 0
    touched: list[int] = field(default_factory=list)
    words: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def rows(self) -> list[dict]:
        return [
            {"task": t, "examples": n, "contaminated": len(c), "share": len(c) / n if n else 0.0}
            for t, n, c in zip(self.tasks, self.examples, self.contaminated, strict=True)
        ]


def scan(grams: TaskGrams, documents: Iterable[str]) -> Contamination:
    """Stream training documents once, marking the examples and documents that share a gram."""
    t0 = time.perf_counter()
    seen = {m: np.zeros(len(g.keys), dtype=bool) for m, g in grams.grams.items()}
    report = Contamination(grams.names, grams.sizes, [])
    for i, text in enumerate(documents):
        ws = words(text)
        hits = grams.hits(ws)
        for m, found in hits.items():
            seen[m][found] = True
        if hits:
            report.touched.append(i)
        report.documents += 1
        report.words += len(ws)
        report.bytes += len(text.encode())
    dirty = set()
    for m, g in grams.grams.items():
        dirty.update(g.example_of_pair[seen[m][g.key_of_pair]].tolist())
    start = 0
    for size in grams.sizes:
        report.contaminated.append(sorted(k - start for k in dirty if start <= k < start + size))
        start += size
    report.seconds = time.perf_counter() - t0
    return report


def _training_texts(data: str, batch: int = 256) -> Iterator[str]:
    """The training documents of `data`: a prepared data folder's train split, decoded document by
    document with its own tokenizer (EOS dropped), or raw inputs (files, folders, builtin:NAME)."""
    from flopwise.data.shards import iter_documents, open_split, read_index, tokenizer_of

    if not (Path(data) / "index.json").is_file():
        yield from (text for _, text in iter_documents([data]))
        return
    meta = read_index(data)
    tokens = open_split(data, "train")
    tok = tokenizer_of(data)
    eos = int(meta["eos_id"])
    spans = meta["splits"]["train"]["documents"]
    for b in range(0, len(spans), batch):
        ids = []
        for start, length in spans[b : b + batch]:
            doc = tokens[start : start + length]
            ids.append((doc[:-1] if length and doc[-1] == eos else doc).tolist())
        yield from tok.decode_batch(ids, skip_special_tokens=False)


def measure_contamination(data: str, tasks: list[tuple[str, list]], n: int = _GPT3_N) -> Contamination:
    """Contamination of loaded tasks ((name, examples) as `load_task` returns) by the training data."""
    grams = TaskGrams([(name, [_example_text(e) for e in examples]) for name, examples in tasks], n)
    return scan(grams, _training_texts(data))


class DecontaminationFilter(BaseFilter):
    """A datatrove filter stage: drops training documents holding any gram of the tasks' examples."""

    name = "🧼 decontamination"

    def __init__(self, task_names: list[str], n: int = _GPT3_N, exclusion_writer=None):
        from flopwise.data.tasks import load_task

        super().__init__(exclusion_writer)
        loaded = [load_task(t) for t in task_names]
        self.grams = TaskGrams([(name, [_example_text(e) for e in ex]) for name, ex in loaded], n)

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        return (False, "contaminated") if self.grams.touches(doc.text) else True


def contamination_report(data: str, tasks: list[str], n: int = _GPT3_N, ids_out: Path | None = None) -> Contamination:
    """`flopwise data contamination`: built-in task names or JSONL files against `data`; with
    `ids_out`, the contaminated example indices per task written there (checked writable first)."""
    from flopwise.data.tasks import load_task
    from flopwise.files.outputs import check_writable, write_json

    if ids_out:
        check_writable(ids_out, "--ids-out")
    report = measure_contamination(data, [load_task(t) for t in tasks], n)
    if ids_out:
        write_json(
            ids_out, dict(zip(report.tasks, report.contaminated, strict=True)), "--ids-out", "data contamination"
        )
    return report
