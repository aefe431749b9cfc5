"""Files a command writes at a path its user names (--out-config, --ids-out, --out, --plot, --plots):
never over a file flopwise did not write.

What flopwise writes there carries its mark, so a rerun may replace its own output: a TOML starts
with TOML_HEADER, a JSON record holds "written_by", a CSV table's last column is "written_by", a PNG
has a "Software: flopwise" text chunk.
Anything else already at the path is refused in one line before the file is written; writes go
through a temporary file and a rename, so a failed write leaves no half file. A path that cannot be
written (a read-only folder, a file where a folder is needed) is a one-line ConfigError naming the
option, found before a command's work starts (`check_folder`, `check_writable`: they try it).
"""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import tempfile
from pathlib import Path

from flopwise.errors import ConfigError, DataError
from flopwise.manifest import UNWRITABLE, cannot_write, real_path, write_nofollow

__all__ = ["UNWRITABLE", "cannot_write"]  # the CLI's one-line OS errors, kept where they were

TOML_HEADER = "# written by flopwise; a later flopwise command may replace this file\n"
PNG_SOFTWARE = "flopwise"
WRITTEN_BY = "written_by"  # a JSON record's key; a CSV table's last column (its rows: "flopwise COMMAND")


def is_ours(path: Path) -> bool:
    """`path` is a file that carries flopwise's mark for its kind."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        head = path.open("rb").read(4096)
        if path.suffix.lower() == ".json":
            record = json.loads(path.read_text(encoding="utf-8"))
            return isinstance(record, dict) and str(record.get(WRITTEN_BY, "")).startswith("flopwise")
    except (OSError, ValueError):
        return False
    if path.suffix.lower() == ".toml":
        return head.startswith(TOML_HEADER.encode())
    if path.suffix.lower() == ".png":
        return b"tEXtSoftware\x00" + PNG_SOFTWARE.encode() in head
    if path.suffix.lower() == ".csv":
        header = next(csv.reader(head.decode("utf-8", "replace").splitlines()[:1]), [])
        return bool(header) and header[-1] == WRITTEN_BY
    return False


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
        raise ConfigError(f"{option} {path}: is a symbolic link, and flopwise never writes through one; "
                          "choose another path or move it away")
    if path.exists() and not is_ours(path):
        raise ConfigError(f"{option} {path}: something flopwise did not write is already there; "
                          "choose another path or move it away")
    _try_writing(path.parent, option, path)
    return path


def _replace(path: Path, data: bytes, option: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_nofollow(path, data)
    except OSError as e:
        raise cannot_write(option, path, e) from None


def write_text(path: str | Path, text: str, option: str) -> Path:
    """Write a text file (a TOML gets flopwise's header line, so a rerun may replace it)."""
    path = check_writable(path, option)
    _replace(path, ((TOML_HEADER if path.suffix.lower() == ".toml" else "") + text).encode(), option)
    return path


def write_json(path: str | Path, record: dict, option: str, command: str) -> Path:
    """Write a JSON record marked as written by `flopwise COMMAND`."""
    path = check_writable(path, option)
    _replace(path, json_record(record, command), option)
    return path


def json_record(record: dict, command: str) -> bytes:
    """A JSON record's bytes, marked as written by `flopwise COMMAND`."""
    return (json.dumps({WRITTEN_BY: f"flopwise {command}", **record}, indent=1) + "\n").encode()


def write_csv(path: str | Path, header: list[str], rows: list[list], option: str, command: str) -> Path:
    """Write a CSV table marked as flopwise's: a last column `written_by`, "flopwise COMMAND" in every row."""
    path = check_writable(path, option)
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows([[*header, WRITTEN_BY],
                                                     *([*row, f"flopwise {command}"] for row in rows)])
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
    fig.savefig(data, format="png", metadata={"Software": PNG_SOFTWARE}, **savefig)
    return data.getvalue()
