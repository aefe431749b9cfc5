"""Which names at the top of a run folder flopwise writes, recorded in the folder itself.

A run folder is shared with its user (notes, plots, a config they keep beside it). Every command
that writes one (train; checkpoint export and convert from-hf, which write checkpoints into it)
first claims the names it will write: a name already there that no earlier claim of flopwise's
records is someone else's file, and the command refuses before writing anything. "Did flopwise write
this?" is answered by flopwise-run.json, never by the file names themselves.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from flopwise.errors import ConfigError
from flopwise.outputs import cannot_write

RUN_FILE = "flopwise-run.json"
FORMAT = "flopwise-run/1"


def claimed(run_dir: Path) -> set[str]:
    """The names flopwise has claimed in `run_dir` (none when it has no run record)."""
    path = run_dir / RUN_FILE
    if not path.exists() and not path.is_symlink():
        return set()
    try:
        record = json.loads(path.read_text(encoding="utf-8")) if path.is_file() and not path.is_symlink() else None
    except (OSError, ValueError):
        record = None
    names = record.get("writes") if isinstance(record, dict) and record.get("format") == FORMAT else None
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ConfigError(f"run folder {run_dir}: {RUN_FILE} is not a flopwise run record; "
                          "choose a new or empty folder, or move that file away")
    return set(names)


def check_claim(run_dir: str | Path, names: Iterable[str], option: str = "run.dir") -> set[str]:
    """What `claim` checks, writing nothing: the names flopwise already claimed in `run_dir`; refused
    in one line (naming `option`, the setting that chose the folder) if one of `names` is already
    there and no earlier claim records it."""
    run_dir = Path(run_dir)
    owned = claimed(run_dir)
    foreign = sorted(n for n in set(names) - owned if (run_dir / n).exists() or (run_dir / n).is_symlink())
    if foreign:
        raise ConfigError(f"run folder {run_dir} ({option}) holds {', '.join(foreign)}, which flopwise did not write "
                          f"there (its {RUN_FILE} does not list {'it' if len(foreign) == 1 else 'them'}): choose a new "
                          f"or empty folder for {option}, or move them away")
    return owned


def claim(run_dir: str | Path, names: Iterable[str], option: str = "run.dir") -> None:
    """Record that flopwise writes `names` at the top of `run_dir` (creating it); refuse in one line
    if one of them is already there and no earlier claim records it (`check_claim`), or if the
    folder cannot be written (naming `option`)."""
    run_dir, names = Path(run_dir), set(names)
    owned = check_claim(run_dir, names, option)
    if names <= owned:
        return
    tmp = run_dir / (RUN_FILE + ".tmp")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": FORMAT, "writes": sorted(owned | names)}, indent=1) + "\n")
        os.replace(tmp, run_dir / RUN_FILE)
    except OSError as e:
        with contextlib.suppress(OSError):  # if it was made
            tmp.unlink()
        raise cannot_write(option, run_dir, e) from None
