"""Refuse a commit whose subject line is longer than 72 characters (the commit-msg hook).

    python scripts/check_commit_subject.py .git/COMMIT_EDITMSG

72 characters is what `git log --oneline` and a patch's subject show without wrapping; the body
below the blank line is free. Comment lines (git's template) are not the subject.
"""

from __future__ import annotations

import sys
from pathlib import Path

LIMIT = 72


def subject(message: str) -> str:
    """The first line of `message` that is neither blank nor a git comment."""
    return next((line for line in message.splitlines() if line.strip() and not line.startswith("#")), "")


def main(argv: list[str]) -> int:
    line = subject(Path(argv[1]).read_text(encoding="utf-8"))
    if len(line) > LIMIT:
        print(f"commit subject is {len(line)} characters, at most {LIMIT}: {line!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
