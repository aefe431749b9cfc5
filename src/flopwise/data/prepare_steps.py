"""The flopwise pieces of the datatrove prepare pipeline (data/prepare.py): a reader that numbers
documents globally, a tally of documents and bytes between stages, the shard writer, and a
whitespace word splitter for the Gopher/C4 rules and MinHash shingles.

These run inside datatrove's worker processes, so they hold only picklable settings (paths, numbers)
and open their files in `run`.
"""

# no `from __future__ import annotations`: datatrove picks exact dedup's hash function from the
# content getter's return annotation, which must be a type, not a string
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.utils.batching import batched
from datatrove.utils.text import simplify_text
from datatrove.utils.word_tokenizers import WordTokenizer

from flopwise.data.shards import read_documents

_PROGRESS_EVERY = 1 << 20  # bytes between progress-file updates


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class OrdinalReader(PipelineStep):
    """Task `rank` reads the contiguous run of document ordinals the plan gave it, starting at a
    recorded file position. Why not datatrove's JsonlReader/ParquetReader: they share work out by
    whole files, round-robin (file i to task i mod N), so one big JSONL would be one task and the
    stream order would not be the global document order the train/val split and the byte-identical
    single-process reference need."""

    type = "📖 - READER"
    name = "flopwise ordinals"

    def __init__(self, files: list[str], tasks: list[dict], progress: str):
        super().__init__()
        self.files, self.tasks, self.progress = files, tasks, progress  # progress: PREFIX-RANK gets bytes read

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        task = self.tasks[rank]
        ordinal, end = task["first"], task["end"]
        fi, pos, line = task["file"], task["pos"], task["line"]
        progress = Path(f"{self.progress}-{rank:05d}")
        done = reported = 0
        while ordinal < end:
            for _, _, text in read_documents(Path(self.files[fi]), pos, line):
                if ordinal >= end:
                    break
                doc = Document(text=text, id=str(ordinal), metadata={"ordinal": ordinal})
                yield doc
                ordinal += 1
                done += len(text.encode())
                if done - reported >= _PROGRESS_EVERY:
                    _write_atomic(progress, str(done))
                    reported = done
            fi, pos, line = fi + 1, 0, 1
        _write_atomic(progress, str(done))


class Tally(PipelineStep):
    """Counts the documents and UTF-8 bytes that reach this point of the pipeline, and those that
    carry a duplicate count (the one kept copy of an exact-duplicate cluster): the report subtracts
    consecutive tallies to get what each stage removed."""

    type = "📊 - STATS"
    name = "flopwise tally"

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        for doc in data:
            self.stat_update("documents")
            self.stat_update("bytes", value=len(doc.text.encode()))
            if doc.metadata.get("duplicate_count", 0) > 0:
                self.stat_update("clusters")
            yield doc


class ShardWriter(PipelineStep):
    """Tokenizes this task's documents (documents joined by EOS, as the single-process tokenizer
    did) into train-RANK.bin / val-RANK.bin, routing each by its ordinal, and records the task's
    document table for the index and each shard's sha256 for the manifest. Why not datatrove's
    DocumentTokenizer: it writes its own .ds format with one file per task and no split routing, and
    flopwise's readers, loader and fingerprint read flat token files with an index."""

    type = "🔢 - TOKENIZER"
    name = "flopwise shards"

    def __init__(self, out: str, work: str, dtype: str, batch: int = 256):
        super().__init__()
        self.out, self.work, self.dtype, self.batch = out, work, dtype, batch

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> None:
        """Consumes the stream (the last step: returns nothing for the executor to drain)."""
        # one task = one core: tokenizers' own thread pool would oversubscribe the workers' cores
        # (restored after: with workers=1 the task runs in the caller's process)
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            self._write(data, rank)
        finally:
            if saved is None:
                os.environ.pop("TOKENIZERS_PARALLELISM")
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved

    def _write(self, data: DocumentsPipeline, rank: int) -> None:
        from flopwise.data.tokenizer import eos_id, load_tokenizer

        out, work = Path(self.out), Path(self.work)
        tok = load_tokenizer(out / "tokenizer.json")
        eos, vocab, dtype = eos_id(tok), tok.get_vocab_size(), np.dtype(self.dtype)
        val = np.load(work / "val.npy", mmap_mode="r")
        entries: dict[str, dict[str, Any]] = {
            s: {"file": f"{s}-{rank:05d}.bin", "tokens": 0, "documents": []} for s in ("train", "val")
        }
        counts = np.zeros(vocab, dtype=np.int64)
        kept = kept_bytes = 0
        progress = work / "progress" / f"tokens-{rank:05d}"
        files = {s: open(out / e["file"], "wb") for s, e in entries.items()}
        hashes = {s: hashlib.sha256() for s in entries}  # for the manifest, as the bytes go out
        try:
            for chunk in batched(data, self.batch):
                encodings = tok.encode_batch([d.text for d in chunk], add_special_tokens=False)
                for doc, enc in zip(chunk, encodings, strict=True):
                    ordinal = doc.metadata["ordinal"]
                    k = int(np.searchsorted(val, ordinal))
                    split = "val" if k < len(val) and val[k] == ordinal else "train"
                    ids = np.asarray(enc.ids + [eos], dtype=dtype)
                    entry = entries[split]
                    entry["documents"].append([entry["tokens"], len(ids)])
                    entry["tokens"] += len(ids)
                    raw = ids.tobytes()
                    files[split].write(raw)
                    hashes[split].update(raw)
                    if split == "train":
                        counts += np.bincount(ids, minlength=vocab)
                    kept += 1
                    kept_bytes += len(doc.text.encode())
                    self.stat_update("tokens", value=len(ids))
                _write_atomic(progress, str(entries["train"]["tokens"] + entries["val"]["tokens"]))
        finally:
            for f in files.values():
                f.close()
        for s, e in entries.items():
            e["sha256"] = hashes[s].hexdigest()
        np.save(work / "tasks" / f"{rank:05d}-counts.npy", counts)
        _write_atomic(
            work / "tasks" / f"{rank:05d}.json", json.dumps({"splits": entries, "documents": kept, "bytes": kept_bytes})
        )


class Whitespace(WordTokenizer):
    """Words are whitespace-separated strings, as Gopher's rules define them (Rae et al. 2021 App. A:
    "80% of words contain at least one alphabetic character" counts "sat." as a word); sentences end
    at . ! ? (optionally followed by a closing quote or bracket). Why not datatrove's English word
    tokenizer: it needs spaCy (a large extra dependency) and splits punctuation into words of its
    own, which moves the alphabetic-word ratio of ordinary prose below Gopher's 0.8."""

    _sentence = re.compile(r"[^.!?\n]*(?:[.!?]+[\"'”’)\]]*|$)")

    def __init__(self):
        super().__init__("en")

    def word_tokenize(self, text: str) -> list[str]:
        return text.split()

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [m.span() for m in self._sentence.finditer(text) if m.group().strip()]

    def sent_tokenize(self, text: str) -> list[str]:
        return [text[a:b].strip() for a, b in self.span_tokenize(text)]


def normalized_text(doc: Document) -> bytes:
    """What exact deduplication hashes: the text lower-cased, punctuation removed, whitespace and
    digits normalized (datatrove's simplify_text), so copies that differ only in those collide.
    Bytes, because datatrove hands str to xxhash, which xxhash >= 3.5 refuses."""
    return simplify_text(doc.text).encode()
