"""Manifests: what proves a folder (or its files) is flopwise's, so a command replaces only what it
wrote. "Did flopwise write this?" is answered by a manifest written there, never by file names.

A manifest records every file a command wrote (size and sha256; a file over FULL_CHECK_BYTES is
checked by its size and the sha256 of its first and last ENDS_BYTES, so checking a folder of GB-scale
files reads ~2 MiB per file), plus, for an unfinished job, files still being written (`unchecked`)
and folders whose whole content the job writes (`folders`). Each kind of folder has its own file
name and format: a prepared data dir, an exported Hugging Face folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flopwise.errors import DataError

FULL_CHECK_BYTES = 4 << 20
ENDS_BYTES = 1 << 20


@dataclass(frozen=True)
class ManifestKind:
    name: str  # the manifest's file name in the folder
    format: str  # its "format" field


def ends_sha256(path: str | Path) -> str:
    """sha256 of a file's first and last ENDS_BYTES (the whole file when it is shorter than both)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(f.read(ENDS_BYTES))
        if size > ENDS_BYTES:
            f.seek(max(size - ENDS_BYTES, ENDS_BYTES))
            h.update(f.read())
    return h.hexdigest()


def file_record(path: str | Path, sha256: str | None = None) -> dict:
    """What the manifest records of a file: bytes and sha256 (`sha256` if the writer hashed the bytes
    as it wrote them, else read here), and for a file above FULL_CHECK_BYTES the sha256 of its ends."""
    path = Path(path)
    size = path.stat().st_size
    if sha256 is None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        sha256 = h.hexdigest()
    record = {"bytes": size, "sha256": sha256}
    if size > FULL_CHECK_BYTES:
        record["ends"] = ends_sha256(path)
    return record


def same_file(path: Path, record) -> bool:
    """A file still holds what the manifest recorded: same size, and the same sha256 (a small file)
    or the same sha256 of its ends (a large one)."""
    if not isinstance(record, dict) or path.is_symlink() or not path.is_file():
        return False
    try:
        if path.stat().st_size != record.get("bytes"):
            return False
        if "ends" in record:
            return ends_sha256(path) == record["ends"]
        return file_record(path)["sha256"] == record.get("sha256")
    except OSError:  # unreadable: not provably the file flopwise wrote
        return False


def write_manifest(out: Path, kind: ManifestKind, files: dict[str, dict], unchecked: Sequence[str] = (),
                   folders: Sequence[str] = (), complete: bool = False) -> None:
    """Write `out`/kind.name atomically (through NAME.tmp, counted as the manifest's):
    `files` {relative path: file_record}; `unchecked` files flopwise is writing whose content is not
    final yet (an unfinished task's shard, the logs each run appends to); `folders` whose whole
    content flopwise's pipeline writes (datatrove's logs, the tasks' tables, dedup intermediates)."""
    manifest = {"format": kind.format, "complete": complete, "files": files,
                "unchecked": sorted(unchecked), "folders": sorted(folders)}
    tmp = out / (kind.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / kind.name)


def read_manifest(out: Path, kind: ManifestKind) -> dict | None:
    """The folder's manifest if it is a well-formed flopwise manifest of this kind, else None."""
    try:
        m = json.loads((out / kind.name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (isinstance(m, dict) and m.get("format") == kind.format and isinstance(m.get("files"), dict)
            and all(isinstance(v, list) and all(isinstance(x, str) for x in v)
                    for v in (m.get("unchecked"), m.get("folders")))):
        return None
    return m


def add_to_manifest(out: str | Path, kind: ManifestKind, name: str, data: bytes) -> None:
    """Write a file flopwise makes beside a prepared folder's data (e.g. a run's recipe.json) and
    record it in the folder's manifest, so a later prepare may replace the folder with it inside."""
    out = Path(out)
    m = read_manifest(out, kind)
    if m is None:
        raise DataError(f"{out}: no flopwise {kind.name} to record {name} in")
    (out / name).write_bytes(data)
    m["files"][name] = file_record(out / name)
    write_manifest(out, kind, m["files"], m["unchecked"], m["folders"], m.get("complete", False))


def files_under(root: Path) -> list[Path]:
    """Every entry under `root` that is not a plain folder (files, links of any kind), sorted; a
    folder that cannot be listed is an OSError (what it holds is unknown)."""
    found = []

    def fail(e: OSError):
        raise e

    for here, dirs, files in os.walk(root, onerror=fail):
        for d in dirs:
            if os.path.islink(os.path.join(here, d)):
                found.append(Path(here, d))
        found += [Path(here, f) for f in files]
    return sorted(found)


def why_not_ours(out: str | Path, kind: ManifestKind) -> str | None:
    """Why a command may not replace or resume `out` (None when it may): it may if `out` is absent,
    empty, or holds a flopwise manifest that accounts for every file in it (each recorded file
    unchanged, or an unchecked file or a pipeline folder of an unfinished prepare). Anything else
    (no manifest, a file the manifest does not record, a recorded file changed since) is someone's."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return None
    if out.is_symlink() or not out.is_dir():
        return "is not a folder"
    try:
        first = next(out.iterdir(), None)
        found = files_under(out) if first is not None else []
    except OSError as e:
        return f"holds {e.filename or 'a folder'} that cannot be read ({e.strerror or type(e).__name__})"
    if first is None:
        return None
    m = read_manifest(out, kind)
    if m is None:
        return f"holds {first.name} and no flopwise {kind.name}"
    unchecked, folders = set(m["unchecked"]), tuple(f.rstrip("/") + "/" for f in m["folders"])
    for path in found:
        rel = path.relative_to(out).as_posix()
        if rel in (kind.name, kind.name + ".tmp") or rel in unchecked or rel.startswith(folders):
            continue
        if rel not in m["files"]:
            return f"holds {rel}, which flopwise did not write (not in its {kind.name})"
        if not same_file(path, m["files"][rel]):
            return f"{rel} has changed since flopwise wrote it ({kind.name} records other bytes)"
    return None


def remove_all_but(out: Path, keep: set[Path]) -> None:
    """Remove `out` (a file or a folder) except the files in `keep` (resolved paths: the inputs of a
    prepare told to --force) and the folders that hold them."""
    if out.is_symlink() or not out.is_dir():
        if out.exists() or out.is_symlink():
            out.unlink()
        return
    if not any(p.is_relative_to(out.resolve()) for p in keep):
        shutil.rmtree(out)
        return
    for path in files_under(out):
        if path.resolve() not in keep:
            path.unlink()
    for here, dirs, _ in os.walk(out, topdown=False):  # deepest first
        for d in dirs:
            p = Path(here, d)
            if p.is_dir() and not p.is_symlink() and not any(p.iterdir()):
                p.rmdir()
