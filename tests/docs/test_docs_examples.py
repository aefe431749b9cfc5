"""Docs that cannot lie: every console example in README.md and docs/ is run, its output compared.

An example is a ```console block: `$ flopwise ...` lines, each followed by the output it prints (stdout and
stderr together). Output is compared as doctest compares it (stdlib `doctest.OutputChecker`, ELLIPSIS and
NORMALIZE_WHITESPACE): `...` stands for any text, including whole lines, where numbers vary (times, losses).
An output with an `error:` line must exit 2, any other 0. Each page runs its examples in order in its own
temporary folder, so a page can train a model and then evaluate it. Directives, HTML comments just above
a block (invisible on the site):

    <!-- example: skip REASON -->     not run; reported as skipped with the reason (a GPU, more ranks)
    <!-- example: file PATH -->       the next fenced block is written to PATH in the page's folder
    <!-- example: copy PATH -->       the repository's file PATH is copied to PATH in the page's folder
    <!-- example: slow -->            the next block's examples are marked slow (they train, or prepare data)
    <!-- examples: slow -->           anywhere in a page: all of its examples are marked slow

Quick commands run in this process through the CLI's own `main` (the same code `flopwise` runs, without
Python's start-up per command); slow ones (they train or prepare data) as `python -m flopwise`. Either
way the working directory is the page's folder.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```+|~~~+)\s*(\S*)\s*$")
DIRECTIVE = re.compile(r"^<!--\s*(examples?):\s*(\w+)\s*(.*?)\s*-->\s*$")


@dataclass
class Step:
    """One action of a page, in order: write a file, or run a command and compare its output."""

    page: str
    line: int
    command: str = ""
    want: str = ""
    path: str = ""
    text: str = ""
    skip: str = ""
    slow: bool = False


def parse(path: Path) -> list[Step]:
    """The steps of one markdown page: its console examples and the files its directives write."""
    lines = path.read_text().splitlines()
    name = str(path.relative_to(ROOT))
    slow = any(ln.strip() == "<!-- examples: slow -->" for ln in lines)
    steps: list[Step] = []
    pending: dict[str, str] = {}
    i = 0
    while i < len(lines):
        d = DIRECTIVE.match(lines[i])
        if d and d.group(1) == "example":
            if d.group(2) == "copy":
                steps.append(Step(name, i + 1, path=d.group(3), text=(ROOT / d.group(3)).read_text(), slow=slow))
            else:
                pending[d.group(2)] = d.group(3)
            i += 1
            continue
        f = FENCE.match(lines[i])
        if not f:
            if lines[i].strip():
                pending.clear()
            i += 1
            continue
        start, fence, lang = i, f.group(1), f.group(2)
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        if "file" in pending:
            steps.append(Step(name, start + 1, path=pending["file"], text="\n".join(body) + "\n", slow=slow))
        elif lang == "console":
            steps.extend(_commands(name, start + 2, body, pending.get("skip", ""), slow or "slow" in pending))
        pending.clear()
    return steps


def _commands(page: str, first: int, body: list[str], skip: str, slow: bool) -> list[Step]:
    steps: list[Step] = []
    k = 0
    while k < len(body):
        if not body[k].startswith("$ "):
            raise ValueError(f"{page}:{first + k}: a console block's first line must be a `$ ` command")
        line, command = first + k, body[k][2:]
        while command.endswith("\\"):
            k += 1
            command = command[:-1] + " " + body[k].strip()
        k += 1
        out = []
        while k < len(body) and not body[k].startswith("$ "):
            out.append(body[k])
            k += 1
        steps.append(Step(page, line, command=command, want="\n".join(out), skip=skip, slow=slow))
    return steps


STEPS = [s for p in PAGES for s in parse(p)]
EXAMPLES = [s for s in STEPS if s.command]


def _param(s: Step):
    marks = [pytest.mark.docs] + ([pytest.mark.slow] if s.slow else [])
    return pytest.param(s, marks=marks, id=f"{s.page}:{s.line}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return {}


def _run(command: str, cwd: Path, fresh: bool = False) -> tuple[int, str]:
    """Run one `flopwise ...` command: exit code and everything it printed (stdout and stderr, in order).

    Quick commands run in this process through the CLI's `main`; `fresh` ones (training, data preparation)
    in a new `python -m flopwise`, as a user runs them: their worker processes must not be forked from a
    process that already holds other commands' threads."""
    argv = shlex.split(command)
    if argv[0] != "flopwise":
        raise ValueError(f"only `flopwise` commands run here, not {argv[0]!r}: mark the block `example: skip`")
    if fresh:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        r = subprocess.run(
            [sys.executable, "-m", "flopwise", *argv[1:]],
            cwd=cwd,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=900,
        )
        return r.returncode, r.stdout
    from flopwise import cli

    buffer = io.StringIO()
    old_argv, old_cwd = sys.argv, os.getcwd()
    sys.argv, code = argv, 0
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            cli.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
    return code, buffer.getvalue()


_WRITTEN: dict[Path, set[int]] = {}


def _write_files(upto: Step, folder: Path) -> None:
    """Write the page's files above `upto` not written yet: `-m "docs and slow"` deselects a quick page's
    file steps, yet its slow examples read them."""
    done = _WRITTEN.setdefault(folder, set())
    for s in STEPS:
        if s.page == upto.page and s.path and s.line <= upto.line and s.line not in done:
            target = folder / s.path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(s.text)
            done.add(s.line)


CHECKER = doctest.OutputChecker()
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@pytest.mark.parametrize("step", [_param(s) for s in STEPS if s.command or s.path])
def test_documented_example(step: Step, folders, tmp_path_factory):
    folder = folders.setdefault(step.page, tmp_path_factory.mktemp(re.sub(r"\W", "_", step.page)))
    if step.skip:
        pytest.skip(f"{step.page}:{step.line} not run: {step.skip}")
    _write_files(step, folder)
    if step.path:
        return
    code, got = _run(step.command, folder, fresh=step.slow)
    want = step.want.strip() + "\n"
    assert CHECKER.check_output(want, got.strip() + "\n", FLAGS), (
        f"{step.page}:{step.line}: `{step.command}` printed\n{got}\nthe page says\n{want}"
    )
    expected = 2 if re.search(r"^error:", step.want, re.M) else 0
    assert code == expected, f"{step.page}:{step.line}: `{step.command}` exited {code}, expected {expected}\n{got}"


@pytest.mark.docs
def test_the_docs_run_enough_examples():
    """The floor: at least 40 documented commands are executed (not skipped)."""
    assert len([s for s in EXAMPLES if not s.skip]) >= 40
