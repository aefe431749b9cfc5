"""Files a command writes at a path its user names (--out-config, --ids-out, --out, --plot, --plots):
never over a file flopwise did not write.

"Did flopwise write this?" is answered by content: each such file carries its own record, a seal
("flopwise-sha256:" and the sha256 of the file's real path and its bytes, the seal's digits zeroed)
placed where its format allows a note: a TOML's first comment line (TOML_HEADER), a JSON record's
"written_by", a CSV table's last header cell, a PNG text chunk. A file whose seal verifies is
flopwise's, unchanged, at the place it was written, so a rerun may replace it; anything else at the
path (a user's file, a flopwise file edited since, or one copied from elsewhere, a symlink) is
refused in one line before the file is written. Paths are resolved to their real absolute form
first (`manifest.real_path`); writes go through a temporary file (no symlink followed) and a rename,
so a failed write leaves no half file. A path that cannot be written (a read-only folder, a file
where a folder is needed) is a one-line ConfigError naming the option, found before a command's
work starts (`check_folder`, `check_writable`: they try it).
"""

from __future__ import annotations

import csv
import errno
import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import zlib
from pathlib import Path

from flopwise.errors import ConfigError, DataError
from flopwise.files.ownership import UNWRITABLE, cannot_write, real_path, write_nofollow

__all__ = ["UNWRITABLE", "cannot_write"]  # the CLI's one-line OS errors, kept where they were

_SEAL = "flopwise-sha256:"
_PLACEHOLDER = _SEAL + "0" * 64  # what a writer puts where the seal goes; `seal` fills in the digest
_SEALED = re.compile(rb"flopwise-sha256:([0-9a-f]{64})")
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_SEALED_MAX_BYTES = 256 << 20  # larger files at an output path are nobody's flopwise output
TOML_HEADER = "# written by flopwise; a later flopwise command may replace this file while it is unchanged: "
_PNG_SOFTWARE = "flopwise"
_WRITTEN_BY = "written_by"  # a JSON record's key; a CSV table's last column (its rows: "flopwise COMMAND")


def _digest(path: Path, data: bytes, at: int) -> str:
    """The seal of `data` at `path` (its seal at offset `at`, and a PNG chunk's CRC after it, masked)."""
    end = at + len(_PLACEHOLDER)
    masked = data[:at] + _PLACEHOLDER.encode() + data[end + (4 if data.startswith(_PNG_MAGIC) else 0) :]
    return hashlib.sha256(os.fsencode(path) + b"\0" + masked).hexdigest()


def seal(path: Path, data: bytes) -> bytes:
    """`data` (holding PLACEHOLDER once) with its seal for `path` filled in (and a PNG text chunk's CRC
    made right again)."""
    at = data.index(_PLACEHOLDER.encode())
    end = at + len(_PLACEHOLDER)
    data = data[:at] + (_SEAL + _digest(path, data, at)).encode() + data[end:]
    if data.startswith(_PNG_MAGIC):
        chunk = data.rfind(b"tEXt", 0, at)
        data = data[:end] + zlib.crc32(data[chunk:end]).to_bytes(4, "big") + data[end + 4 :]
    return data


def is_ours(path: Path) -> bool:
    """`path` is a file flopwise wrote there, unchanged since: its seal verifies."""
    path = real_path(path)
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > _SEALED_MAX_BYTES:
            return False
        data = path.read_bytes()
    except OSError:
        return False
    found = _SEALED.search(data)
    return found is not None and found.group(1).decode() == _digest(path, data, found.start())


def _try_writing(folder: Path, option: str, named: Path) -> None:
    """Create and remove a probe file in `folder`, or in the nearest folder above it that exists
    (where the command would create it): the OS's own answer, for any cause, with nothing left."""
    above = next(p for p in [folder.absolute(), *folder.absolute().parents] if p.exists() or p.is_symlink())
    try:
        if not above.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(above))
        fd, probe = tempfile.mkstemp(prefix=".flopwise-probe-", dir=above)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:  # named by the folder, not by the probe's random name
        raise cannot_write(option, named, OSError(e.errno, e.strerror, str(above))) from None


def cache_dir() -> Path:
    """Where flopwise keeps what it may compute again but would rather not: FLOPWISE_CACHE_DIR, else
    $XDG_CACHE_HOME/flopwise, else ~/.cache/flopwise."""
    base = os.environ.get("FLOPWISE_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "flopwise"
    )
    return Path(base)


def check_folder(path: str | Path, option: str) -> Path:
    """`path`, if a command can create it as a folder or write into it (tried: `_try_writing`)."""
    path = real_path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        what = "a symbolic link" if path.is_symlink() else "a file"
        raise ConfigError(f"{option} {path}: is {what}, not a folder; choose a folder")
    _try_writing(path, option, path)
    return path


def check_writable(path: str | Path, option: str) -> Path:
    """`path`, if a command may write there: nothing is there, or a file flopwise wrote; and its
    folder can be written (tried: `_try_writing`)."""
    path = real_path(path)
    if path.is_symlink():
        raise ConfigError(
            f"{option} {path}: is a symbolic link, and flopwise never writes through one; "
            "choose another path or move it away"
        )
    if path.exists() and not is_ours(path):
        raise ConfigError(
            f"{option} {path}: something flopwise did not write is already there; choose another path or move it away"
        )
    _try_writing(path.parent, option, path)
    return path


def _replace(path: Path, data: bytes, option: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_nofollow(path, seal(path, data))
    except OSError as e:
        raise cannot_write(option, path, e) from None


def write_text(path: str | Path, text: str, option: str) -> Path:
    """Write a TOML file with flopwise's header line (its seal, so a rerun may replace it)."""
    path = check_writable(path, option)
    _replace(path, (TOML_HEADER + _PLACEHOLDER + "\n" + text).encode(), option)
    return path


def write_json(path: str | Path, record: dict, option: str, command: str) -> Path:
    """Write a JSON record marked as written by `flopwise COMMAND`."""
    path = check_writable(path, option)
    _replace(path, json_record(record, command), option)
    return path


def json_record(record: dict, command: str) -> bytes:
    """A JSON record's bytes, marked as written by `flopwise COMMAND` (with a seal to fill in)."""
    return (json.dumps({_WRITTEN_BY: f"flopwise {command}; {_PLACEHOLDER}", **record}, indent=1) + "\n").encode()


def write_csv(path: str | Path, header: list[str], rows: list[list], option: str, command: str) -> Path:
    """Write a CSV table marked as flopwise's: a last column `written_by` (its header cell holds the
    seal), "flopwise COMMAND" in every row."""
    path = check_writable(path, option)
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(
        [[*header, f"{_WRITTEN_BY} {_PLACEHOLDER}"], *([*row, f"flopwise {command}"] for row in rows)]
    )
    _replace(path, text.getvalue().encode(), option)
    return path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, imported only when a plot is asked for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_records(path: str | Path) -> list[dict]:
    """The JSON objects of a JSONL file flopwise wrote (metrics.jsonl): [] if there is none; a line
    that is not a JSON object (a damaged or foreign file) is a one-line DataError naming it."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                raise DataError(f"{path}: line {n} is not a JSON object; is this a flopwise metrics file?")
            records.append(record)
    return records


def save_figure(fig, path: str | Path, option: str, **savefig) -> Path:
    """Save a matplotlib figure as a PNG marked as flopwise's."""
    path = check_writable(path, option)
    _replace(path, png_bytes(fig, **savefig), option)
    return path


def png_bytes(fig, **savefig) -> bytes:
    """A matplotlib figure as PNG bytes marked as flopwise's (written by the caller, no symlink followed)."""
    data = io.BytesIO()
    fig.savefig(data, format="png", metadata={"Software": _PNG_SOFTWARE, "Comment": _PLACEHOLDER}, **savefig)
    return data.getvalue()


def _free_bytes(out: Path) -> int:
    """Bytes free to this user on the disk that holds `out` (or its nearest existing parent)."""
    here = next(p for p in [out, *out.parents] if p.exists())
    return shutil.disk_usage(here).free


def check_space(option: str, out: Path, needed: int, error: BaseException | None = None) -> None:
    """Refuse in one line naming `out` and the space it needs: before a writer starts, when its
    disk has less than `needed` bytes free; after a write failed (`error`, checked before the partial
    output is removed), when the failure was the disk filling up: ENOSPC or EDQUOT, a library's
    wording of it (safetensors'), or under 1 MiB left (torch's "unexpected pos" says no more).
    Returns when space is not the problem."""
    free = _free_bytes(out)
    if error is None:
        full = free < needed
    else:
        said = f"{error}".lower()
        full = (
            (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT))
            or any(w in said for w in ("no space left", "os error 28", "storagefull", "quota"))
            or free < 1 << 20
        )
    if not full:
        return
    raise ConfigError(
        f"{option} {out}: no space left there: it needs {needed / 1e6:,.1f} MB, {free / 1e6:,.1f} MB are free"
        f"{'; the partial output was removed' if error is not None else '; nothing was written'}. Free space "
        "there or choose another path"
    )
