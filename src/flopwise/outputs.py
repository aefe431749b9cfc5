"""Files a command writes at a path its user names (--out-config, --ids-out, --out, --plot, --plots):
never over a file flopwise did not write.

What flopwise writes there carries its mark, so a rerun may replace its own output: a TOML starts
with TOML_HEADER, a JSON record holds "written_by", a PNG has a "Software: flopwise" text chunk.
Anything else already at the path is refused in one line before the file is written; writes go
through a temporary file and a rename, so a failed write leaves no half file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from flopwise.errors import ConfigError, DataError

TOML_HEADER = "# written by flopwise; a later flopwise command may replace this file\n"
PNG_SOFTWARE = "flopwise"
WRITTEN_BY = "written_by"


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
    return False


def check_writable(path: str | Path, option: str) -> Path:
    """`path`, if a command may write there: nothing is there, or a file flopwise wrote."""
    path = Path(path)
    if (path.exists() or path.is_symlink()) and not is_ours(path):
        raise ConfigError(f"{option} {path}: something flopwise did not write is already there; "
                          "choose another path or move it away")
    return path


def _replace(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.flopwise-tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_text(path: str | Path, text: str, option: str) -> Path:
    """Write a text file (a TOML gets flopwise's header line, so a rerun may replace it)."""
    path = check_writable(path, option)
    _replace(path, ((TOML_HEADER if path.suffix.lower() == ".toml" else "") + text).encode())
    return path


def write_json(path: str | Path, record: dict, option: str, command: str) -> Path:
    """Write a JSON record marked as written by `flopwise COMMAND`."""
    path = check_writable(path, option)
    _replace(path, (json.dumps({WRITTEN_BY: f"flopwise {command}", **record}, indent=1) + "\n").encode())
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
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.flopwise-tmp.png")
    fig.savefig(tmp, metadata={"Software": PNG_SOFTWARE}, **savefig)
    os.replace(tmp, path)
    return path
