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
import logging
import os
import re
import stat
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from flopwise.errors import ConfigError, DataError

log = logging.getLogger(__name__)

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
_TMP_SUFFIX = ".flopwise-tmp"  # write_nofollow writes NAME's new bytes in .NAME.XXXXXXXX.flopwise-tmp first
_UMASK = os.umask(0o022)  # the process's umask (read by setting it, put back at once)
os.umask(_UMASK)
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
    """Replace `path` with `data` through a temporary file beside it and a rename, which replaces
    the name itself, never what a link (symbolic or hard) points to. The temporary file is new
    (mkstemp: O_EXCL, a unique name, no symlink followed), so no file already there is ever
    truncated or written; one left by a kill is never reused nor deleted by name."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=_TMP_SUFFIX, dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide the file from the user's group
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _is_tmp_of(rel: str, name: str) -> bool:
    """`rel` is a name `write_nofollow` gives NAME's temporary file (which proves nothing by itself)."""
    return rel.startswith(f".{name}.") and rel.endswith(_TMP_SUFFIX) and "/" not in rel


_held: dict[str, tuple[int, int]] = {}  # folder -> (lock fd, depth): a command that locks a folder twice
_LOCK_TEXT = "flopwise lock, held by PID {}\n"  # a lock file's whole content: what proves it flopwise's
_LOCK_RE = re.compile(r"flopwise lock, held by PID ([0-9]{1,10})\n")


def _lock_pid(fd: int) -> int | None:
    """The PID a lock file names if its whole content is flopwise's lock text, else None."""
    try:
        m = _LOCK_RE.fullmatch(os.pread(fd, 64, 0).decode())
    except (OSError, UnicodeDecodeError):
        return None
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _at_path(fd: int, path: Path) -> bool:
    """The file open at `fd` is still the one at `path` (same device and inode)."""
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _busy(option: str, folder: Path, fd: int) -> ConfigError:
    """Another process holds the flock: refused in one line naming its PID (the lock file holds it)."""
    pid = _lock_pid(fd)
    who = f"PID {pid}" if pid else "PID unknown"
    if pid and not _alive(pid):  # the flock is shared with the children it forked
        who = f"a child of PID {pid}, which has exited"
    return ConfigError(
        f"{option} {folder}: another flopwise process ({who}) is writing this folder; wait for it to finish, or stop it"
    )


def _take_stale(option: str, folder: Path, fd: int) -> None:
    """A lock file no process holds: removed (to be created afresh) only if its content is flopwise's
    lock text and it has no other name (a hard link to a user's file is theirs); else refused."""
    path, pid, links = folder / LOCK, _lock_pid(fd), os.fstat(fd).st_nlink
    if pid is None or links != 1 or not stat.S_ISREG(os.fstat(fd).st_mode):
        why = "is not a flopwise lock file" if pid is None else f"has {links} names (hard links)"
        raise ConfigError(
            f"{option} {folder}: {path} {why}; nothing was written: move it away, or choose another folder"
        )
    state = "which is gone" if not _alive(pid) or pid == os.getpid() else "whose PID another process now has"
    log.warning(f"{folder}: taking over the lock of flopwise process {pid}, {state}")
    os.unlink(path)


def _lock_fd(folder: Path, option: str) -> int:
    """An fd on a lock file in `folder` that this process created (O_EXCL, never truncated or
    written by name) and holds (flock), its PID written in it. A lock file already there is another
    holder's (refused, `_busy`), or a stale one (`_take_stale`)."""
    path = folder / LOCK
    while True:
        try:
            fd = open_nofollow(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                fd = open_nofollow(path, os.O_RDONLY | os.O_NONBLOCK)
            except FileNotFoundError:  # released meanwhile
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                busy = _busy(option, folder, fd)
                os.close(fd)
                raise busy from None
            try:
                if _at_path(fd, path):  # else its holder released it meanwhile: try again
                    _take_stale(option, folder, fd)
            finally:
                os.close(fd)
            continue
        fcntl.flock(fd, fcntl.LOCK_EX)  # a new file: another process holds it only while it reads it
        os.pwrite(fd, _LOCK_TEXT.format(os.getpid()).encode(), 0)
        if _at_path(fd, path):
            return fd
        os.close(fd)


def lock_lost(folder: str | Path) -> str | None:
    """Why this process no longer holds `folder`'s lock, though it took it (its file removed or
    replaced: `rm`, `git clean`, `rsync --delete`), in one line; None while it holds it, or when it
    never took it."""
    held = _held.get(str(real_path(folder)))
    if held is None or _at_path(held[0], real_path(folder) / LOCK):
        return None
    if os.fstat(held[0]).st_nlink:  # the lock file still exists, elsewhere: the folder (or it) was moved
        return (
            f"{real_path(folder)} was moved or renamed while this process wrote it (its lock file is no longer "
            "there); stopped here, nothing written at the old path: resume from where the folder is now"
        )
    return (
        f"{real_path(folder) / LOCK} was removed while this process held it, so another flopwise process "
        "may be writing the folder now; stopped here: check the folder, then run again"
    )


@contextlib.contextmanager
def folder_lock(folder: str | Path, option: str) -> Iterator[Path]:
    """Hold `folder`'s lock while the block runs: one writer per folder. The lock is a file this
    process created in the folder (LOCK, O_EXCL) and holds (fcntl.flock); a file there already is
    another live holder's (refused in one line naming its PID), a stale flopwise lock (taken over,
    said in one line), or someone's (refused: never truncated, written or deleted). Released and
    removed at the end if still the one it made; a folder this created and left empty is removed."""
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
        fd = _lock_fd(folder, option)
    except OSError as e:
        _remove_empty(made)
        raise cannot_write(option, folder, e) from None
    except ConfigError:
        _remove_empty(made)
        raise
    _held[key] = (fd, 1)
    try:
        yield folder
    finally:
        del _held[key]
        for reader in _reading.pop(key, []):  # the folders it read (`hold_reading`), released with it
            os.close(reader)
        if _at_path(fd, folder / LOCK):  # never a file someone put at that name after it was removed
            with contextlib.suppress(OSError):
                os.unlink(folder / LOCK)
        os.close(fd)
        _remove_empty(made)


_reading: dict[str, list[int]] = {}  # a held folder -> descriptors of the folders its command reads


@contextlib.contextmanager
def unread(folder: Path, option: str) -> Iterator[None]:
    """Hold `folder` (a prepared data folder, whose lock its writer holds) unread while the block
    writes it: an exclusive flock on the folder's own descriptor, which no run reading it
    (`hold_reading`'s shared flock) lets it take: refused in one line naming that run."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"{option} {folder}: {_readers_of(folder)} reads this folder; nothing was written: wait for it "
                "to finish, or write into another folder"
            ) from None
        yield
    finally:
        os.close(fd)


def _readers_of(folder: Path) -> str:
    """Who holds a flock on `folder` (from /proc/locks), by the run folder each one holds (the lock
    file it has open), else its PID: "the run in runs/demo (PID 4242)"."""
    st = os.stat(folder)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            pids = sorted({int(parts[4]) for line in f if len(parts := line.split()) > 5 and parts[5] == inode})
    except (OSError, ValueError):
        pids = []
    who = []
    for pid in pids:
        if pid == os.getpid():
            continue
        runs = []
        with contextlib.suppress(OSError):
            for entry in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{entry}")
                    if link.endswith(f"/{LOCK}"):
                        runs.append(link[: -len(LOCK) - 1])
        who.append(f"the run in {runs[0]} (PID {pid})" if runs else f"PID {pid}")
    return f"a running flopwise command, {', '.join(who)}," if who else "a running flopwise command"


def hold_reading(holder: str | Path, folder: str | Path, option: str) -> None:
    """While this process holds `holder`'s lock (a run folder), hold `folder` (the data it reads)
    for reading: a shared flock on the folder's own descriptor, so that a command writing `folder`
    (its exclusive flock, `folder_lock`) is refused while the run reads it; several runs may read
    it at once. Refused in one line while another command writes `folder`."""
    key, folder = str(real_path(holder)), real_path(folder)
    if key not in _held:
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"{option} {folder}: another flopwise command is writing this folder; wait for it to finish"
        ) from None
    _reading.setdefault(key, []).append(fd)


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
    """Write `out`/kind.name atomically (`write_nofollow`; a temporary file of it left by a kill counts
    as the manifest's only if its content is one, for this folder):
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


def _read_manifest(out: Path, kind: ManifestKind, path: Path | None = None) -> dict | None:
    """The folder's manifest (or the one at `path`: a temporary file of it) if it is a well-formed
    flopwise manifest of this kind written for this folder (`written_for`: not one copied from
    elsewhere or written by hand), else None."""
    path = path or out / kind.name
    if path.is_symlink():
        return None
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
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
        if rel == kind.name or rel in unchecked or rel.startswith(folders):
            continue
        if _is_tmp_of(rel, kind.name) and _read_manifest(out, kind, path) is not None:
            continue  # a manifest's write cut short: its content proves it flopwise's
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
