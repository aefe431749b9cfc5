"""The commit-msg hook (scripts/check_commit_subject.py) takes a 72-character subject and refuses 73."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "check_commit_subject.py"


def _check(tmp_path, message: str) -> subprocess.CompletedProcess:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    return subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=60)


def test_a_72_character_subject_passes(tmp_path):
    r = _check(tmp_path, "x" * 72 + "\n\n" + "a body line may be longer than the subject " * 3 + "\n")
    assert r.returncode == 0, r.stderr


def test_a_73_character_subject_is_refused(tmp_path):
    r = _check(tmp_path, "# git's comment lines are not the subject\n" + "x" * 73 + "\n")
    assert r.returncode == 1
    assert "73 characters" in r.stderr
