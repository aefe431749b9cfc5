"""Ownership: what proves a folder (or its files) is flopwise's, so a command replaces only what it
wrote. "Did flopwise write this?" is answered by content, never by file names or by the mere
presence of a record: a record (a manifest, a run folder's run record) holds each file's size and
sha256 as flopwise wrote it, and proves ownership only of the folder it was written for (its real
absolute path, or the same folder by device and inode after a move): a record copied with its folder
(a run folder taken as a template) or written by hand proves nothing, and a file whose bytes differ
from the record's (edited, replaced, a symlink) is someone's.

Around that: every output path is resolved to its real absolute form before any check
(`real_path`), writes inside an owned folder never follow a symlink (`open_nofollow`), and one
process at a time writes a folder (`folder_lock`).

A manifest records every file a command wrote (size and sha256; a file over FULL_CHECK_BYTES is
checked by its size and the sha256 of its first and last ENDS_BYTES, so checking a folder of GB-scale
files reads ~2 MiB per file), plus, for an unfinished job, files still being written (`unchecked`)
and folders whose whole content the job writes (`folders`): entries without content, honoured only
in a record bound to this folder (an interrupted job's own), never in a copied or hand-written one.
Each kind of folder has its own file name and format: a prepared data dir, an exported Hugging Face folder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from flopwise.errors import ConfigError, DataError

FULL_CHECK_BYTES = 4 << 20
ENDS_BYTES = 1 << 20
# OS errors that mean "this path cannot be written by you here": the user's to fix, so one line, not a traceback
UNWRITABLE = {
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.ENOTDIR,
    errno.EEXIST,
    errno.EISDIR,
    errno.ENOSPC,
    errno.EDQUOT,
    errno.ELOOP,
}
_TMP_NAME = ".{}.flopwise-tmp"  # where write_nofollow writes NAME's new bytes before the rename
LOCK = ".flopwise.lock"  # in a folder a command writes: held (flock) for the whole command, holds its PID


@dataclass(frozen=True)
class ManifestKind:
    name: str  # the manifest's file name in the folder
    format: str  # its "format" field


def real_path(path: str | Path) -> Path:
    """An output path in its real absolute form, before any check: `~` expanded, symlinked parent
    folders resolved and `..` taken after them (`DIR/missing/../x` is DIR/x, where a writer that
    creates `missing` lands). A last name that links to a folder is that folder (the user named it);
    one that links to anything else stays as given (refused by the checks, never written through)."""
    p = Path(os.path.expanduser(os.fspath(path)))
    if p.name in ("", ".", "..") or (p.is_symlink() and p.is_dir()):
        return Path(os.path.realpath(p))
    return Path(os.path.realpath(p.parent)) / p.name


def cannot_write(option: str, path: Path, e: OSError) -> ConfigError:
    """The one-line error for an OS refusal to write `path` (given as `option`): the reason and the fix."""
    above = next((p for p in [path, *path.parents] if p.exists() or p.is_symlink()), None)
    if above is not None and above != path and not above.is_dir():
        why, fix = f"{above} is a file, not a folder", "choose a path under a folder"
    elif e.errno in (errno.ENOSPC, errno.EDQUOT):
        why, fix = e.strerror or "no space left", "free space there or choose another path"
    else:
        why = f"{e.strerror or type(e).__name__}: {e.filename or path}"
        fix = "choose a path you can write, or fix that folder's permissions"
    return ConfigError(f"{option} {path}: cannot write there ({why}); {fix}")


def folder_id(folder: Path) -> dict:
    """What binds a record to the folder it was written for: its real path, device and inode."""
    st = os.lstat(folder)
    return {"path": str(real_path(folder)), "dev": st.st_dev, "ino": st.st_ino}


def written_for(record: dict, folder: Path) -> bool:
    """`record` was written for `folder`: the same real path, or the same folder (device and inode)
    moved. A copy of the folder elsewhere (a run taken as a template) is neither."""
    bound = record.get("folder")
    if not isinstance(bound, dict):
        return False
    try:
        here = folder_id(folder)
    except OSError:
        return False
    return bound.get("path") == here["path"] or (bound.get("dev"), bound.get("ino")) == (here["dev"], here["ino"])


def open_nofollow(path: Path, flags: int, mode: int = 0o666) -> int:
    """os.open that never follows a symlink at `path` (O_NOFOLLOW: ELOOP), refused in one line."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError(f"{path} is a symbolic link: flopwise never writes through one; move it away") from None
        raise


def write_nofollow(path: Path, data: bytes) -> None:
    """Replace `path` with `data` through a temporary file beside it (TMP_NAME, no symlink followed:
    one writer per folder, so the name is this writer's) and a rename, which replaces the name
    itself, never what a link points to."""
    tmp = path.with_name(_TMP_NAME.format(path.name))
    fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_held: dict[str, tuple[int, int]] = {}  # folder -> (lock fd, depth): a command that locks a folder twice


def _pid_in(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or "x")
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def folder_lock(folder: str | Path, option: str) -> Iterator[Path]:
    """Hold `folder`'s lock (fcntl.flock on LOCK in it, created with the folder) while the block
    runs: one writer per folder. Another live holder is refused in one line naming its PID (the
    lock file holds it); a lock whose process is gone (the kernel released its flock) is taken over
    with a warning. Released and removed at the end; a folder this created and left empty is removed."""
    folder = real_path(folder)
    key = str(folder)
    if key in _held:
        fd, depth = _held[key]
        _held[key] = (fd, depth + 1)
        try:
            yield folder
        finally:
            _held[key] = (fd, depth)
        return
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise ConfigError(
            f"{option} {folder}: is {'a symbolic link' if folder.is_symlink() else 'a file'}, "
            "not a folder; choose a folder"
        )
    made = [p for p in [folder, *folder.parents] if not p.exists()]  # removed at the end if still empty
    try:
        folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = open_nofollow(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _pid_in(fd)
                os.close(fd)
                who = f"PID {pid}" if pid else "PID unknown"
                if pid and not _alive(pid):  # the flock is shared with the children it forked
                    who = f"a child of PID {pid}, which has exited"
                raise ConfigError(
                    f"{option} {folder}: another flopwise process ({who}) is "
                    "writing this folder; wait for it to finish, or stop it"
                ) from None
            with contextlib.suppress(OSError):  # the file locked is still the one at that name
                if os.fstat(fd).st_ino == os.lstat(folder / LOCK).st_ino:
                    break
            os.close(fd)
    except OSError as e:
        _remove_empty(made)
        raise cannot_write(option, folder, e) from None
    stale = _pid_in(fd)
    if stale is not None and stale != os.getpid():
        warnings.warn(f"{folder}: took over the lock of flopwise process {stale}, which is gone", stacklevel=3)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[key] = (fd, 1)
    try:
        yield folder
    finally:
        del _held[key]
        with contextlib.suppress(OSError):
            os.unlink(folder / LOCK)
        os.close(fd)
        _remove_empty(made)


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders a lock created (deepest first) that are still empty."""
    for p in folders:
        try:
            p.rmdir()
        except OSError:
            return


def _ends_sha256(path: str | Path) -> str:
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
        record["ends"] = _ends_sha256(path)
    return record


def same_file(path: Path, record) -> bool:
    """A file still holds what the record says flopwise wrote: same size, and the same sha256 (a
    small file) or the same sha256 of its ends (a large one); or, while flopwise replaces or extends
    it (the record is written first), what it held before (`prev`). Never a symlink."""
    if not isinstance(record, dict) or path.is_symlink() or not path.is_file():
        return False
    try:
        if path.stat().st_size == record.get("bytes"):
            if "ends" in record:
                if _ends_sha256(path) == record["ends"]:
                    return True
            elif file_record(path)["sha256"] == record.get("sha256"):
                return True
    except OSError:  # unreadable: not provably the file flopwise wrote
        return False
    return "prev" in record and same_file(path, record["prev"])


def write_manifest(
    out: Path,
    kind: ManifestKind,
    files: dict[str, dict],
    unchecked: Sequence[str] = (),
    folders: Sequence[str] = (),
    complete: bool = False,
) -> None:
    """Write `out`/kind.name atomically (through NAME.tmp, counted as the manifest's):
    `files` {relative path: file_record}; `unchecked` files flopwise is writing whose content is not
    final yet (an unfinished task's shard, the logs each run appends to); `folders` whose whole
    content flopwise's pipeline writes (datatrove's logs, the tasks' tables, dedup intermediates)."""
    manifest = {
        "format": kind.format,
        "folder": folder_id(out),
        "complete": complete,
        "files": files,
        "unchecked": sorted(unchecked),
        "folders": sorted(folders),
    }
    write_nofollow(out / kind.name, json.dumps(manifest, indent=1).encode())


def _read_manifest(out: Path, kind: ManifestKind) -> dict | None:
    """The folder's manifest if it is a well-formed flopwise manifest of this kind written for this
    folder (`written_for`: not one copied from elsewhere or written by hand), else None."""
    if (out / kind.name).is_symlink():
        return None
    try:
        m = json.loads((out / kind.name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (
        isinstance(m, dict)
        and m.get("format") == kind.format
        and isinstance(m.get("files"), dict)
        and all(
            isinstance(v, list) and all(isinstance(x, str) for x in v) for v in (m.get("unchecked"), m.get("folders"))
        )
        and written_for(m, out)
    ):
        return None
    return m


def add_to_manifest(out: str | Path, kind: ManifestKind, name: str, data: bytes) -> None:
    """Write a file flopwise makes beside a prepared folder's data (e.g. a run's recipe.json) and
    record it in the folder's manifest, so a later prepare may replace the folder with it inside."""
    out = Path(out)
    m = _read_manifest(out, kind)
    if m is None:
        raise DataError(f"{out}: no flopwise {kind.name} to record {name} in")
    write_nofollow(out / name, data)
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
    out = real_path(out)
    if not out.exists() and not out.is_symlink():
        return None
    if out.is_symlink() or not out.is_dir():
        return "is a symbolic link, not a folder" if out.is_symlink() else "is not a folder"
    try:
        first = next(out.iterdir(), None)
        found = files_under(out) if first is not None else []
    except OSError as e:
        return f"holds {e.filename or 'a folder'} that cannot be read ({e.strerror or type(e).__name__})"
    found = [p for p in found if p != out / LOCK]
    if not found:
        return None
    m = _read_manifest(out, kind)
    if m is None:
        if (out / kind.name).is_file():
            return (
                f"holds a {kind.name} that does not prove flopwise wrote the folder (written by hand, damaged, "
                "or copied from another folder: a record proves only the folder it was written for)"
            )
        return f"holds {found[0].relative_to(out).as_posix()} and no flopwise {kind.name}"
    unchecked, folders = set(m["unchecked"]), tuple(f.rstrip("/") + "/" for f in m["folders"])
    for path in found:
        rel = path.relative_to(out).as_posix()
        if path.is_symlink():
            return f"holds {rel}, a symbolic link (flopwise never writes one there, nor through one)"
        if rel in (kind.name, _TMP_NAME.format(kind.name)) or rel in unchecked or rel.startswith(folders):
            continue
        if rel not in m["files"]:
            return f"holds {rel}, which flopwise did not write (not in its {kind.name})"
        if not same_file(path, m["files"][rel]):
            return f"{rel} has changed since flopwise wrote it ({kind.name} records other bytes)"
    return None


def remove_all_but(out: Path, keep: set[Path]) -> None:
    """Remove `out` (a file or a folder) except the files in `keep` (resolved paths: the inputs of a
    prepare told to --force) and the folders that hold them; a folder's LOCK stays (its holder is
    the caller)."""
    if out.is_symlink() or not out.is_dir():
        if out.exists() or out.is_symlink():
            out.unlink()
        return
    keep = keep | {out.resolve() / LOCK}
    for path in files_under(out):
        if path.resolve() not in keep:
            path.unlink()
    for here, dirs, _ in os.walk(out, topdown=False):  # deepest first
        for d in dirs:
            p = Path(here, d)
            if p.is_dir() and not p.is_symlink() and not any(p.iterdir()):
                p.rmdir()
