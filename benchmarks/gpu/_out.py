"""How a GPU benchmark hands back its figures: JSON on stdout and, with `--out`, the whole record
in a file (its folder created), so every result file under benchmarks/gpu/results reads the same way."""

from __future__ import annotations

import json
from pathlib import Path


def report(record: object, out: Path | None, shown: object | None = None) -> None:
    """Print `shown` (a summary; `record` itself when None) and write `record` to `out` if given."""
    print(json.dumps(record if shown is None else shown, indent=1))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
