"""`flopwise data prepare` as a parallel, streaming, resumable pipeline on Hugging Face datatrove.

Flow (each stage one datatrove LocalPipelineExecutor, N tasks run by `workers` processes):
  survey     one streaming pass in this process: count the non-empty documents of every input file
             (a text file is one, a JSONL line with non-empty "text" is one, a Parquet row is one),
             giving each a global ordinal, and record file positions every CHUNK_BYTES so tasks can
             start mid-file. The val split is `val_documents(n, val_fraction, seed)` over those
             ordinals: the same documents the single-process prepare chose.
  tokenizer  bpe:VOCAB trains on the first SAMPLE_BYTES of documents in order (whole documents,
             while fewer than SAMPLE_BYTES have been taken), in this process; a bounded,
             deterministic sample. The shipped corpora are far below it, so their tokenizer is the
             one trained on everything.
  dedup      optional, across all inputs, before tokenizing (each a signature pass over all tasks,
             then datatrove's finder/cluster stages); intermediates in <out>/work.
  tokenize   per task: read its ordinals -> quality filters -> dedup filters -> ShardWriter
             (train-RANK.bin, val-RANK.bin). Task order = ordinal order, so the concatenated shards
             are byte-identical to the single-process stream of the same documents.
  index      written last, atomically, from the tasks' tables (after the manifest that records it
             and every shard: size, sha256); then the work folder is removed.

Ownership: a fresh prepare first writes <out>/manifest.json (flopwise.files.ownership: `why_not_ours`) naming
everything it is about to write (the tokenizer, each task's shards, the report, the work folder's
plan, logs and task folders), then records each file's size and sha256 as it becomes final. A folder
is replaced or resumed only if that manifest accounts for every file in it; anything else, or an
input inside --out, is refused unless --force, which still never deletes an input.

Resume: datatrove marks each finished task (<out>/work/logs/STAGE/completions/); a rerun with the
same inputs and settings keeps the plan and the finished tasks' outputs and runs only the rest.
Unfinished tasks are rerun from their start, and every task is deterministic, so the result is
byte-identical to an uninterrupted run.

Quality filters (`filters`), with the papers' thresholds:
  gopher  GopherQualityFilter then GopherRepetitionFilter at datatrove's defaults, which are Rae et
          al. 2021 App. A / Table A1: duplicate line, paragraph fractions 0.30, their character
          fractions 0.20; top 2/3/4-gram character fractions 0.20/0.18/0.16; duplicate 5..10-gram
          fractions 0.15..0.10; 50..100,000 words; mean word length 3..10; # or ellipsis to word
          ratio 0.1; > 90 % bullet lines; > 30 % ellipsis-ending lines; 80 % of words with a letter;
          at least 2 of the stop words the, be, to, of, and, that, have, with.
  c4      C4QualityFilter with Raffel et al. 2020 Sec. 2.2 (and TFDS c4_utils): keep lines ending in
          terminal punctuation with at least 5 words, drop pages with fewer than 3 sentences, with
          "lorem ipsum" or a curly bracket, drop lines with "javascript" or a policy phrase.
          datatrove's defaults swap the two numbers (min_num_sentences=5, min_words_per_line=3), so
          they are passed explicitly. C4 rewrites the kept documents (drops lines), as the paper did.
Deduplication (`dedup`):
  exact    hash (xxhash64) of the normalized text (lower case, no punctuation, normalized whitespace
           and digits); one copy of each cluster kept.
  minhash  MinHash LSH over word 5-grams of the normalized text (sha1-64 shingle hashes),
           112 hashes = 14 bands x 8 rows: pairs are candidates with probability 1 - (1 - s^8)^14 at
           Jaccard s, the S-curve's
           threshold (1/14)^(1/8) ~= 0.72 (s = 0.9: 0.9996, s = 0.8: 0.92, s = 0.5: 0.054); clusters
           are connected components of candidate pairs, one document kept per cluster.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flopwise.data.shards import (
    DATA_MANIFEST,
    SHARDS_FORMAT,
    WORK,
    PrepareStats,
    Skipped,
    dtype_for_vocab,
    input_files,
    read_documents,
    skipped_note,
    val_documents,
)
from flopwise.data.tokenizer import EOS, eos_id, load_tokenizer, parse_tokenizer_spec, train_bpe
from flopwise.errors import DataError
from flopwise.files.outputs import check_folder
from flopwise.files.ownership import (
    LOCK,
    file_record,
    files_under,
    folder_lock,
    real_path,
    remove_all_but,
    unread,
    why_not_ours,
    write_manifest,
)

_SAMPLE_BYTES = 200 * 10**6  # tokenizer training sample: the first 200 MB of documents, in order
_CHUNK_BYTES = 1 << 20  # a task may start at a file's first document or every ~1 MiB inside a file
_TASK_BYTES = 64 << 20  # target input per task (more tasks than workers: finer resume, balance)
_FILTERS = ("gopher", "c4")
_DEDUPS = ("exact", "minhash")
_MINHASH = {"n_grams": 5, "num_buckets": 14, "hashes_per_bucket": 8}
# What an unfinished prepare writes in WORK besides val.npy (whose sha256 its manifest records):
# folders whose whole content its tasks write (datatrove's logs and completion markers, the tasks'
# tables, progress counters, dedup intermediates), the logs every run appends to, and the plan (and
# its temporary file). The manifest names them (`_claims`).
_WORK_FOLDERS = ("tasks", "progress", "logs", "exact", "minhash")
_WORK_FILES = ("datatrove.log", "wall.jsonl", "plan.json", "plan.json.tmp")


@dataclass
class Survey:
    """The counting pass: files, documents, bytes, and where tasks may start."""

    files: list[str]
    sources: list[str]
    documents: int
    bytes: int
    chunks: list[list[int]]  # [ordinal, file index, position, line, bytes before]
    skipped: Skipped  # what the walk and the readers left out, by reason


def survey(inputs: list[str]) -> Survey:
    """Counts every input's documents in one streaming pass (and validates them: a bad line is a
    DataError here, before any worker starts), and what it leaves out (`input_files`, binary
    Parquet rows): named in the summary and report.json, and in the refusal if no text is left."""
    skipped: Skipped = {}
    files = [f for spec in inputs for f in input_files(spec, skipped)]
    s = Survey([str(f) for f in files], [], 0, 0, [], skipped)
    last = -_CHUNK_BYTES
    for fi, path in enumerate(files):
        first = True
        for pos, line, text in read_documents(path, skipped=skipped):
            if first or s.bytes - last >= _CHUNK_BYTES:
                s.chunks.append([s.documents, fi, pos, line, s.bytes])
                last = s.bytes
            if first:
                s.sources.append(str(path))
                first = False
            s.documents += 1
            s.bytes += len(text.encode())
    if not s.documents:
        raise DataError(
            f"data input {', '.join(inputs)}: contains no text"
            + (f" (skipped: {skipped_note(skipped)})" if skipped else "")
        )
    return s


def _plan_tasks(s: Survey, n_tasks: int) -> list[dict]:
    """Contiguous runs of ordinals with about equal bytes, cut at recorded chunk starts."""
    cuts = [0]
    for k in range(1, n_tasks):
        target = k * s.bytes / n_tasks
        c = next((i for i, ch in enumerate(s.chunks) if ch[4] >= target), len(s.chunks))
        if cuts[-1] < c < len(s.chunks):
            cuts.append(c)
    ends = [s.chunks[c][0] for c in cuts[1:]] + [s.documents]
    return [
        {"first": s.chunks[c][0], "end": end, "file": s.chunks[c][1], "pos": s.chunks[c][2], "line": s.chunks[c][3]}
        for c, end in zip(cuts, ends, strict=True)
    ]


def _sample_texts(files: list[str], limit: int = _SAMPLE_BYTES) -> Iterator[str]:
    """The tokenizer's training sample: documents in order while fewer than `limit` bytes are taken."""
    taken = 0
    for f in files:
        for _, _, text in read_documents(Path(f)):
            if taken >= limit:
                return
            taken += len(text.encode())
            yield text


def _input_key(files: list[Path]) -> list:
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


@contextmanager
def _quiet(log: Path):
    """datatrove's loguru logger writes every task's progress to stderr: to a log file instead while
    the executor runs (fd 2 for its worker processes, sys.stderr and loguru's sinks in this one)."""
    from loguru import logger

    sys.stderr.flush()
    saved_fd, saved_stderr = os.dup(2), sys.stderr
    with open(log, "a") as f:
        os.dup2(f.fileno(), 2)
        sys.stderr = f
        logger.remove()
        logger.add(f, level="INFO")
        try:
            yield
        finally:
            logger.remove()  # the task loggers datatrove added, and ours
            sys.stderr = saved_stderr
            os.dup2(saved_fd, 2)
            os.close(saved_fd)


def _run(stage: str, pipeline: list, tasks: int, workers: int, work: Path):
    from datatrove.executor import LocalPipelineExecutor

    # spawn, not fork: this process has run tokenizers' thread pool (BPE training) and a progress
    # thread, and forking a threaded process can deadlock the child
    executor = LocalPipelineExecutor(
        pipeline, tasks=tasks, workers=min(workers, tasks), logging_dir=str(work / "logs" / stage), start_method="spawn"
    )
    t0 = time.perf_counter()
    try:
        with _quiet(work / "datatrove.log"):
            executor.run()
        with open(work / "wall.jsonl", "a") as f:  # this invocation's share; a resume adds its own
            f.write(json.dumps({"stage": stage, "seconds": round(time.perf_counter() - t0, 2)}) + "\n")
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"data prepare: stage {stage} failed ({type(e).__name__}: {str(e)[:200]}); "
            f"see {work / 'datatrove.log'}, then rerun to resume"
        ) from None


def _stage_stats(work: Path, stage: str) -> list[tuple[str, dict[str, float]]]:
    """Per pipeline step, (name, {metric: total}) summed over all tasks of one stage, including
    tasks finished by an earlier, killed run (datatrove's stats/RANK.json files)."""
    steps: list[tuple[str, dict[str, float]]] = []
    for f in sorted((work / "logs" / stage / "stats").glob("*.json")):
        for k, step in enumerate(json.loads(f.read_text())):
            if k == len(steps):
                steps.append((step["name"], {}))
            totals = steps[k][1]
            timing = step.get("time_stats", 0)
            totals["_seconds"] = totals.get("_seconds", 0) + (
                timing.get("total", 0) if isinstance(timing, dict) else timing
            )
            for label, metric in step.get("stats", {}).items():
                value = metric["total"] if isinstance(metric, dict) else metric
                totals[label] = totals.get(label, 0) + int(value)
    return steps  # "_seconds": the step's own time (datatrove's time_stats), summed over tasks


def _filter_steps(filters: list[str], words, decontaminate: Sequence[str] = ()) -> list:
    from datatrove.pipeline.filters import C4QualityFilter, GopherQualityFilter, GopherRepetitionFilter

    from flopwise.data.contamination import DecontaminationFilter

    steps = []
    for name in filters:
        if name == "gopher":
            # MassiveText's order (Rae et al. 2021 Fig. A1): quality filters, then repetition removal
            steps += [
                ("gopher_quality", GopherQualityFilter(language=words)),
                ("gopher_repetition", GopherRepetitionFilter(language=words)),
            ]
        else:
            steps.append(("c4", C4QualityFilter(min_num_sentences=3, min_words_per_line=5, language=words)))
    if decontaminate:  # GPT-3's 13-gram rule against the named evaluation tasks (data/contamination.py)
        steps.append(("decontaminate", DecontaminationFilter(list(decontaminate))))
    return steps


def _parse(option: str, given, known: tuple[str, ...]) -> list[str]:
    names = [n.strip() for n in (given.split(",") if isinstance(given, str) else given) if n.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        raise DataError(f"{option} {','.join(bad)}: unknown (choose from {','.join(known)}, comma-separated)")
    return [n for n in known if n in names]


def _progress_loop(work: Path, total: int, progress: Callable, stop: threading.Event) -> None:
    folder = work / "progress"
    while not stop.wait(0.5):
        done = tokens = 0
        for f in folder.glob("*"):
            try:
                value = int(f.read_text() or 0)
            except (OSError, ValueError):  # a file being replaced
                continue
            if f.name.startswith("tokens-"):
                tokens += value
            elif f.name.startswith("tokenize-"):
                done += value
        progress("tokenize", done, total, tokens)


def prepare_data(
    inputs: list[str],
    out: str | Path,
    tokenizer: str = "bpe:4096",
    val_fraction: float = 0.05,
    seed: int = 0,
    progress: Callable[[str, int, int, int], None] | None = None,
    force: bool = False,
    workers: int | None = None,
    tasks: int | None = None,
    filters: Sequence[str] | str = (),
    dedup: Sequence[str] | str = (),
    decontaminate: Sequence[str] | str = (),
    setting: str | None = None,
) -> PrepareStats:
    """Tokenize `inputs` into numbered shards in `out` (see the module docstring for the stages).

    workers: processes (default: all cores); tasks: pipeline tasks = shard files per split
    (default: one per TASK_BYTES of input, at least `workers`); filters: subset of FILTERS; dedup:
    subset of DEDUPS; decontaminate: evaluation task names whose 13-grams drop a training document;
    progress(stage, input bytes done, input bytes total, tokens written).
    An unfinished prepare in `out` with the same inputs and settings is resumed; any other folder
    whose manifest shows flopwise wrote every file in it is replaced; anything else, or an input
    inside `out`, is refused unless `force` (which replaces the folder but keeps the inputs in it;
    never a file). Every option is checked, and `out` tried for writing, before anything is written.
    `setting`: the config key that chose `out` (a run's data folder, where there is no --out or
    --force to name), or None for the command line's --out.
    With workers > 1 the worker processes are spawned and import the caller's main module: call
    this from a script under `if __name__ == "__main__":` (the CLI and `flopwise train` do)."""
    from flopwise.data.prepare_steps import Whitespace

    t0 = time.perf_counter()
    out = real_path(out)
    filters, dedup = _parse("--filter", filters, _FILTERS), _parse("--dedup", dedup, _DEDUPS)
    decontaminate = [
        t.strip() for t in (decontaminate.split(",") if isinstance(decontaminate, str) else decontaminate) if t.strip()
    ]
    words = Whitespace()
    quality = _filter_steps(filters, words, decontaminate)  # built once, now: an unknown task fails here
    workers = workers or os.cpu_count() or 1
    if workers < 1:
        raise DataError(f"--workers {workers}: must be at least 1")
    spec = parse_tokenizer_spec(tokenizer)
    tok_file = None if isinstance(spec, int) else spec  # bpe:VOCAB trains one; else a given tokenizer file
    given = load_tokenizer(tok_file) if tok_file else None
    files = [f for s in inputs for f in input_files(s)]
    # one writer per folder, for the whole prepare, and none while a run reads it
    with folder_lock(out, setting or "--out") as locked, unread(locked, setting or "--out"):
        keep, reason = _claim_out(out, files, tok_file, force, setting)
        key = {
            "format": SHARDS_FORMAT,
            "inputs": _input_key(files),
            "tokenizer": str(spec),
            "tokenizer_file": _input_key([tok_file]) if tok_file else None,
            "val_fraction": val_fraction,
            "seed": seed,
            "filters": filters,
            "dedup": dedup,
            "decontaminate": decontaminate,
        }
        plan = _resumable_plan(out, key) if reason is None else None  # resume only what the manifest vouches for
        if plan is None:
            plan = _fresh_plan(inputs, out, spec, given, key, keep, force, workers, tasks, val_fraction, seed, setting)
        tok = load_tokenizer(out / "tokenizer.json")
        dtype = dtype_for_vocab(tok.get_vocab_size())

        quality, deduped = _run_stages(out, plan, quality, words, dedup, dtype, workers, progress)
        report = _report(out / WORK, plan, filters, quality, deduped, decontaminate)
        meta = _finish(out, plan, tok, dtype, seed, val_fraction, report)
        if progress:
            progress("tokenize", plan["bytes"], plan["bytes"], meta["counts"]["tokens"])
        return PrepareStats(
            meta["counts"]["documents"],
            meta["counts"]["tokens"],
            meta["counts"]["bytes"],
            time.perf_counter() - t0,
            {s: e["tokens"] for s, e in meta["splits"].items()},
            report,
        )


def _claim_out(
    out: Path, files: list[Path], tok_file: Path | None, force: bool, setting: str | None
) -> tuple[set[Path], str | None]:
    """The inputs inside `out` to keep, and why flopwise may not replace `out` (None: its manifest
    vouches for every file); refused here, before any write, unless `force` may replace it."""
    keep = _inputs_kept(out, files, tok_file, force, setting)
    reason = why_not_ours(out, DATA_MANIFEST)
    if reason and not force:
        raise DataError(_refusal(out, reason, keep, setting))
    if out.is_symlink() or (out.exists() and not out.is_dir()):  # --force replaces a folder, never a file
        raise DataError(
            f"--out {out}: is a file, not a folder; --force replaces only a folder: choose another "
            "--out, or move the file away"
        )
    check_folder(out, setting or "--out")
    return keep, reason


def _resumable_plan(out: Path, key: dict) -> dict | None:
    """The task plan of an unfinished prepare in `out` with these inputs and settings, or None."""
    try:
        plan = json.loads((out / WORK / "plan.json").read_text())
    except (OSError, ValueError):  # none, or not readable: start afresh
        return None
    if not isinstance(plan, dict) or plan.get("key") != key or not (out / "tokenizer.json").is_file():
        return None
    return plan


def _fresh_plan(
    inputs: list[str],
    out: Path,
    spec,
    given,
    key: dict,
    keep: set[Path],
    force: bool,
    workers: int,
    tasks: int | None,
    val_fraction: float,
    seed: int,
    setting: str | None,
) -> dict:
    """Survey the inputs, train or take the tokenizer, clear `out` (keeping `keep`) and write the
    manifest, tokenizer, validation ids and the task plan: a prepare that a rerun can resume."""
    work = out / WORK
    s = survey(inputs)
    tok = given or train_bpe(_sample_texts(s.files), spec)
    if not force and (
        reason := why_not_ours(out, DATA_MANIFEST)
    ):  # again: the survey and training may have taken hours
        raise DataError(_refusal(out, reason, keep, setting))
    remove_all_but(out, keep)
    n_tasks = tasks or max(workers, math.ceil(s.bytes / _TASK_BYTES))
    unchecked, folders = _claims(n_tasks)
    out.mkdir(parents=True, exist_ok=True)
    # first: from here on every file in the folder is one this manifest names
    write_manifest(out, DATA_MANIFEST, {}, unchecked + ["tokenizer.json", f"{WORK}/val.npy"], folders)
    (work / "tasks").mkdir(parents=True)
    (work / "progress").mkdir()
    tok.save(str(out / "tokenizer.json"))
    np.save(work / "val.npy", np.asarray(sorted(val_documents(s.documents, val_fraction, seed)), dtype=np.int64))
    write_manifest(out, DATA_MANIFEST, _records(out, ["tokenizer.json", f"{WORK}/val.npy"]), unchecked, folders)
    plan = {
        "key": key,
        "files": s.files,
        "sources": s.sources,
        "documents": s.documents,
        "bytes": s.bytes,
        "skipped": s.skipped,
        "tasks": _plan_tasks(s, n_tasks),
    }
    (work / "plan.json.tmp").write_text(json.dumps(plan))
    os.replace(work / "plan.json.tmp", work / "plan.json")  # last: the plan means "resumable"
    return plan


def _run_stages(
    out: Path, plan: dict, quality: list, words, dedup: list[str], dtype, workers: int, progress
) -> tuple[list[str], list[str]]:
    """Deduplicate (if asked) and tokenize into shards with datatrove, resuming finished tasks;
    `quality`: the (name, filter) steps (`_filter_steps`), `words` their word splitter. The names of
    the quality and dedup stages that ran, for the report."""
    dedup_steps = []
    if "exact" in dedup:
        dedup_steps.append(("exact", _exact_dedup(out / WORK, plan, quality, workers)))
    if "minhash" in dedup:
        earlier = [f for _, f in dedup_steps]
        dedup_steps.append(("minhash", _minhash_dedup(out / WORK, plan, quality, words, earlier, workers)))
    _tokenize(out, plan, quality, [f for _, f in dedup_steps], dtype, workers, progress)
    return [n for n, _ in quality], [n for n, _ in dedup_steps]


def _head(work: Path, plan: dict, quality: list, stage: str) -> list:
    """Reader, tally and quality filters (each followed by a tally): the same stream in every pass."""
    from flopwise.data.prepare_steps import OrdinalReader, Tally

    reader = OrdinalReader(plan["files"], plan["tasks"], str(work / "progress" / stage))
    return [reader, Tally(), *_tallied([f for _, f in quality])]


def _tallied(filters: list) -> list:
    """Each filter followed by a tally of what it kept."""
    from flopwise.data.prepare_steps import Tally

    return [s for f in filters for s in (f, Tally())]


def _exact_dedup(work: Path, plan: dict, quality: list, workers: int):
    """Exact deduplication's signature and find passes; the filter that drops the duplicates."""
    from datatrove.pipeline.dedup import ExactDedupFilter, ExactDedupSignature, ExactFindDedups
    from datatrove.pipeline.dedup.exact_dedup import ExactDedupConfig

    from flopwise.data.prepare_steps import normalized_text

    exact_cfg = ExactDedupConfig(content_getter=normalized_text)
    n_tasks = len(plan["tasks"])
    _run(
        "exact-signature",
        _head(work, plan, quality, "exact-signature") + [ExactDedupSignature(str(work / "exact" / "sigs"), exact_cfg)],
        n_tasks,
        workers,
        work,
    )
    _run(
        "exact-find",
        [ExactFindDedups(str(work / "exact" / "sigs"), str(work / "exact" / "dups"), exact_cfg)],
        1,
        workers,
        work,
    )
    return ExactDedupFilter(str(work / "exact" / "dups"), exact_cfg)


def _minhash_dedup(work: Path, plan: dict, quality: list, words, earlier: list, workers: int):
    """MinHash near-deduplication's signature, bucket and cluster passes over the stream after the
    `earlier` dedup filters (exact dedup's); the filter that drops the near-duplicates."""
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.utils.hashing import HashConfig

    # sha1, not the default xxhash: datatrove hashes str shingles, which xxhash >= 3.5 refuses
    minhash_cfg = MinhashConfig(**_MINHASH, hash_config=HashConfig(precision=64, hash_fc="sha1"))
    sig = MinhashDedupSignature(str(work / "minhash" / "sigs"), minhash_cfg, language=words)
    n_tasks = len(plan["tasks"])
    _run(
        "minhash-signature",
        _head(work, plan, quality, "minhash-signature") + _tallied(earlier) + [sig],
        n_tasks,
        workers,
        work,
    )
    _run(
        "minhash-buckets",
        [MinhashDedupBuckets(str(work / "minhash" / "sigs"), str(work / "minhash" / "buckets"), config=minhash_cfg)],
        _MINHASH["num_buckets"],
        workers,
        work,
    )
    _run(
        "minhash-cluster",
        [
            MinhashDedupCluster(
                str(work / "minhash" / "buckets"),
                str(work / "minhash" / "remove"),
                config=minhash_cfg,
                save_cluster_id=True,
            )
        ],
        1,
        workers,
        work,
    )
    return MinhashDedupFilter(str(work / "minhash" / "remove"))


def _tokenize(out: Path, plan: dict, quality: list, dedup_filters: list, dtype, workers: int, progress) -> None:
    """The last pass: the stream through the quality and dedup filters into token shards, with a
    progress thread when asked."""
    from flopwise.data.prepare_steps import ShardWriter

    work = out / WORK
    pipeline = _head(work, plan, quality, "tokenize") + _tallied(dedup_filters)
    pipeline.append(ShardWriter(str(out), str(work), dtype.name))
    stop = threading.Event()
    poller = threading.Thread(target=_progress_loop, args=(work, plan["bytes"], progress, stop), daemon=True)
    if progress:
        poller.start()
    try:
        _run("tokenize", pipeline, len(plan["tasks"]), workers, work)
    finally:
        stop.set()
        if progress:
            poller.join()


def _finish(out: Path, plan: dict, tok, dtype, seed: int, val_fraction: float, report: dict) -> dict:
    """Write report.json and index.json (last, atomically) with the finished folder's manifest, and
    remove the work folder; the index."""
    work = out / WORK
    (out / "report.json").write_text(json.dumps(report, indent=1))
    meta = _index(out, work, plan, tok, dtype, seed, val_fraction)
    tmp = out / "index.json.tmp"
    tmp.write_text(json.dumps(meta))
    written = _records(out, ["tokenizer.json", "report.json"]) | _shard_records(out, work, len(plan["tasks"]))
    written["index.json"] = file_record(tmp)
    unchecked, folders = _claims(len(plan["tasks"]))
    write_manifest(out, DATA_MANIFEST, written | _records(out, [f"{WORK}/val.npy"]), unchecked, folders, complete=True)
    os.replace(tmp, out / "index.json")
    shutil.rmtree(work)
    write_manifest(out, DATA_MANIFEST, written, complete=True)  # the finished folder: exactly the files above
    return meta


def _claims(n_tasks: int) -> tuple[list[str], list[str]]:
    """What the manifest of an unfinished prepare of `n_tasks` tasks names without content (files
    being written: every task's shards, the report, the index's temporary file, WORK_FILES) and
    the work folders its tasks write."""
    unchecked = [f"{s}-{rank:05d}.bin" for s in ("train", "val") for rank in range(n_tasks)]
    unchecked += ["report.json", "index.json.tmp"] + [f"{WORK}/{f}" for f in _WORK_FILES]
    return unchecked, [f"{WORK}/{d}" for d in _WORK_FOLDERS]


def _records(out: Path, names: list[str]) -> dict[str, dict]:
    return {name: file_record(out / name) for name in names}


def _shard_records(out: Path, work: Path, n_tasks: int) -> dict[str, dict]:
    """Every task's shard files, with the sha256 their writer computed as it wrote them."""
    records = {}
    for rank in range(n_tasks):
        task = json.loads((work / "tasks" / f"{rank:05d}.json").read_text())
        for e in task["splits"].values():
            records[e["file"]] = file_record(out / e["file"], e.get("sha256"))
    return records


def _inputs_kept(out: Path, files: list[Path], tokenizer: Path | None, force: bool, setting: str | None) -> set[Path]:
    """The inputs (and a given tokenizer file) that lie inside `out`, which no prepare may delete:
    refused unless --force, which replaces the rest of the folder around them; never inside its work
    folder (which prepare removes when it finishes) nor `out` itself."""
    root, scratch = out.resolve(), (out / WORK).resolve()
    inputs = [f.resolve() for f in files] + ([Path(tokenizer).resolve()] if tokenizer else [])
    for f in inputs:
        if f == root or f.is_relative_to(scratch):
            where = "--out itself" if f == root else "inside its work folder"
            raise DataError(
                f"{_where(out, setting)}: input {f} is {where}, which prepare replaces; "
                f"choose another {setting or '--out'}"
            )
    inside = [f for f in inputs[: len(files)] if f.is_relative_to(root)]
    if inside and not force:
        fix = (
            f"move the input elsewhere, or set {setting} to another folder"
            if setting
            else "choose another --out, or pass --force to replace the folder but keep its inputs"
        )
        raise DataError(
            f"{_where(out, setting)}: input {inside[0]} is inside it and preparing there would delete it; " + fix
        )
    return {f for f in inputs if f.is_relative_to(root)}


def _where(out: Path, setting: str | None) -> str:
    return f"data folder {out} (from {setting})" if setting else f"--out {out}"


def _refusal(out: Path, reason: str, keep: set[Path], setting: str | None) -> str:
    """Why `out` is not replaced, and what replacing it would delete: --force's (the command line's)
    files listed by name, so it is never passed blind; a run's data folder has no --force."""
    head = (
        f"{_where(out, setting)}: {reason}; flopwise replaces only a folder whose {DATA_MANIFEST.name} shows it "
        "wrote every file in it: "
    )
    if setting:
        return head + f"set {setting} to a new or empty folder, or move the files in {out} away"
    if out.is_symlink() or not out.is_dir():
        return head + "choose another --out, or move the file away"
    try:
        doomed = [
            p.relative_to(out).as_posix() for p in files_under(out) if p.resolve() not in keep and p != out / LOCK
        ]
    except OSError:
        return head + "choose another folder"
    shown = ", ".join(doomed[:3]) + (f" and {len(doomed) - 3} more" if len(doomed) > 3 else "")
    return head + (
        f"choose another folder, or pass --force to replace it, deleting its {len(doomed)} "
        f"file{'s' if len(doomed) != 1 else ''} ({shown}){'; its inputs are kept' if keep else ''}"
    )


def _index(out: Path, work: Path, plan: dict, tok, dtype: np.dtype, seed: int, val_fraction: float) -> dict:
    """The index from the tasks' tables, in task order: document starts offset by the tokens of
    the split's earlier shards."""
    vocab = tok.get_vocab_size()
    splits: dict[str, dict[str, Any]] = {s: {"files": [], "tokens": 0, "documents": []} for s in ("train", "val")}
    counts = np.zeros(vocab, dtype=np.int64)
    documents = kept_bytes = 0
    for rank in range(len(plan["tasks"])):
        task = json.loads((work / "tasks" / f"{rank:05d}.json").read_text())
        for s, e in task["splits"].items():
            base = splits[s]["tokens"]
            splits[s]["files"].append({"file": e["file"], "tokens": e["tokens"]})
            splits[s]["documents"].extend([base + a, n] for a, n in e["documents"])
            splits[s]["tokens"] += e["tokens"]
        counts += np.load(work / "tasks" / f"{rank:05d}-counts.npy")
        documents += task["documents"]
        kept_bytes += task["bytes"]
    probs = counts[counts > 0] / max(counts.sum(), 1)
    return {
        "format": SHARDS_FORMAT,
        "dtype": dtype.name,
        "vocab_size": vocab,
        "eos_id": eos_id(tok),
        "eos": EOS,
        "tokenizer": "tokenizer.json",
        "seed": seed,
        "val_fraction": val_fraction,
        "sources": plan["sources"],
        "splits": splits,
        "counts": {"documents": documents, "tokens": sum(e["tokens"] for e in splits.values()), "bytes": kept_bytes},
        "unigram_entropy_nats": float(-(probs * np.log(probs)).sum()),
    }


def _report(
    work: Path,
    plan: dict,
    filters: list[str],
    filter_names: list[str],
    dedup_names: list[str],
    decontaminate: list[str],
) -> dict:
    """Documents and bytes in, what each stage removed (with datatrove's per-rule drop reasons for
    the filters, clusters for the dedup stages) and its own CPU time in the tokenize pass, what was
    kept, and the wall time of every executor stage: from the stages' stats summed over all tasks
    (the tallies sit after the reader and after every filter/dedup step)."""
    stats = _stage_stats(work, "tokenize")
    tallies = [totals for name, totals in stats if "tally" in name]
    stages = [totals for name, totals in stats if "tally" not in name][1:-1]  # without reader and writer

    def count(totals: dict[str, float], label: str) -> int:
        return int(totals.get(label, 0))

    rows = []
    for k, (name, st) in enumerate(zip(filter_names + dedup_names, stages, strict=True)):
        before, after = tallies[k], tallies[k + 1]
        row = {
            "stage": name,
            "documents_in": count(before, "documents"),
            "documents_removed": count(before, "documents") - count(after, "documents"),
            "bytes_removed": count(before, "bytes") - count(after, "bytes"),
            "cpu_seconds": round(st.get("_seconds", 0), 2),
        }
        if name in filter_names:
            row["rules"] = {
                label.removeprefix("dropped_"): n for label, n in sorted(st.items()) if label.startswith("dropped_")
            }
            if name == "c4":  # C4 also drops lines from the documents it keeps
                row["bytes_removed_with_lines"] = row.pop("bytes_removed")
                row["lines"] = {
                    label.removeprefix("line-"): n for label, n in sorted(st.items()) if label.startswith("line-")
                }
        elif name == "exact":
            row["clusters"] = count(after, "clusters")
        else:
            cluster = _stage_stats(work, "minhash-cluster")
            row["clusters"] = count(cluster[0][1], "clusters") if cluster else 0
        rows.append(row)
    first, last = tallies[0], tallies[-1]
    wall: dict[str, float] = {}
    for line in (work / "wall.jsonl").read_text().splitlines():
        entry = json.loads(line)
        wall[entry["stage"]] = round(wall.get(entry["stage"], 0) + entry["seconds"], 2)
    return {
        "documents_in": count(first, "documents"),
        "bytes_in": count(first, "bytes"),
        "skipped": plan.get("skipped", {}),
        "stages": rows,
        "wall_seconds": wall,
        "documents_kept": count(last, "documents"),
        "bytes_kept": count(last, "bytes"),
        "settings": {
            "filters": filters,
            "dedup": dedup_names,
            "decontaminate": decontaminate,
            "minhash": _MINHASH
            | {"threshold": round((1 / _MINHASH["num_buckets"]) ** (1 / _MINHASH["hashes_per_bucket"]), 3)},
        },
    }
