"""flopwise's messages (flopwise.log): stdlib logging printed through rich, rank 0's below ERROR,
every rank's errors once after its rank, and the CLI's --quiet / --verbose."""

import io
import logging
import subprocess
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from flopwise import log
from flopwise.cli import app
from tests.conftest import tiny_overrides


@pytest.fixture(autouse=True)
def _restore_logger():
    """Each test sets flopwise's logger up its own way; the next one finds it as it was."""
    handlers, level = log.LOGGER.handlers[:], log.LOGGER.level
    yield
    log.LOGGER.handlers[:] = handlers
    log.LOGGER.setLevel(level)


def consoles() -> tuple[Console, Console]:
    return Console(file=io.StringIO(), width=200), Console(file=io.StringIO(), width=200)


def text(c: Console) -> str:
    return c.file.getvalue()


def say_everything() -> None:
    logger = logging.getLogger("flopwise.train.build")  # any module's logger is a child of flopwise's
    logger.debug("a debug line")
    logger.info("[bold]an info[/] line")
    logger.warning("a warning line")
    logger.error("[red]error:[/] an error line")


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_rank_filter_passes_only_errors_from_other_ranks(rank):
    records = {
        lv: logging.LogRecord("flopwise.x", lv, __file__, 1, "m", None, None)
        for lv in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)
    }
    passed = {lv for lv, r in records.items() if log.RankFilter(rank).filter(r)}
    assert passed == (set(records) if rank == 0 else {logging.ERROR, logging.CRITICAL})


def test_a_single_process_prints_info_on_stdout_and_errors_alone_on_stderr(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out, err = consoles()
    log.setup(logging.INFO, out, err)
    say_everything()
    # markup rendered, as console.print rendered it, with nothing added (no time, level or path)
    assert text(out).splitlines() == ["an info line", "a warning line"]
    assert text(err).splitlines() == ["error: an error line"]


def test_another_rank_of_a_job_prints_only_its_errors_once_after_its_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out, err = consoles()
    log.setup(logging.DEBUG, out, err)
    say_everything()
    assert text(out) == "" and text(err).splitlines() == ["rank 1: error: an error line"]
    assert log.console().quiet  # and its progress bars draw nowhere


def test_rank_0_of_a_job_labels_its_errors_too(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out, err = consoles()
    log.setup(logging.INFO, out, err)
    say_everything()
    assert text(out).splitlines() == ["an info line", "a warning line"]
    assert text(err).splitlines() == ["rank 0: error: an error line"]


@pytest.mark.parametrize(
    "options, shown",
    [
        ([], ["an info line", "a warning line"]),
        (["--quiet"], ["a warning line"]),
        (["-q"], ["a warning line"]),
        (["--verbose"], ["a debug line", "an info line", "a warning line"]),
    ],
)
def test_cli_quiet_and_verbose_set_what_is_printed(options, shown, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    result = CliRunner().invoke(app, [*options, "presets", "--json"])  # any command: the options are the app's
    assert result.exit_code == 0, result.output
    [printer] = [h for h in log.LOGGER.handlers if isinstance(h, log.RichPrinter) and h.level < logging.ERROR]
    printer.console = Console(file=io.StringIO(), width=200)  # what the CLI set up, read back as text
    say_everything()
    assert text(printer.console).splitlines() == shown


def test_library_use_prints_nothing_below_warning_without_setup(capsys):
    log.LOGGER.handlers[:] = [logging.NullHandler()]
    log.LOGGER.setLevel(logging.NOTSET)
    say_everything()
    assert capsys.readouterr() == ("", "") and log.console().quiet


def test_printing_to_routes_messages_for_a_while_and_restores(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    out, err = consoles()
    log.setup(logging.WARNING, out, err)
    side = Console(file=io.StringIO(), width=200)
    with log.printing_to(side):
        say_everything()
    say_everything()
    assert text(side).splitlines() == ["a warning line"]  # the level set up holds inside
    assert text(out).splitlines() == ["a warning line"]
    assert text(err).splitlines() == ["error: an error line"] * 2


@pytest.mark.slow
def test_quiet_train_prints_its_results_but_not_its_progress(tiny_data, tmp_path):
    """End to end through the installed entry point: `flopwise --quiet train` keeps the summary
    table and drops the informational lines (model size, per-step lines)."""
    args = tiny_overrides(tmp_path / "run", tiny_data, **{"train.steps": 2, "train.eval_every": 0})
    quiet = subprocess.run(
        [sys.executable, "-m", "flopwise", "--quiet", "train", *args], capture_output=True, text=True, timeout=600
    )
    assert quiet.returncode == 0, quiet.stderr
    assert "MFLOP/token" not in quiet.stdout and "step 2/2" not in quiet.stdout
    assert "throughput" in quiet.stdout  # the summary table
