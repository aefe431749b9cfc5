"""flopwise's messages: stdlib `logging` under the "flopwise" logger, printed through rich.

Library code logs with `logging.getLogger(__name__)` (rich markup allowed) and never takes or
makes a console to print on. The CLI calls `setup` once (its --quiet / --verbose choose the
level). In a torchrun/srun job only rank 0 prints below ERROR; an error is printed by the rank
that hit it, once, after its rank. Without `setup` (flopwise used as a library) the stdlib's
defaults hold: nothing below WARNING is printed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console, ConsoleRenderable
from rich.logging import RichHandler
from rich.text import Text
from rich.traceback import Traceback

LOGGER = logging.getLogger("flopwise")


def rank() -> int:
    """This process's rank in a torchrun/srun job (torchrun's RANK), 0 for a single process."""
    return int(os.environ.get("RANK", "0"))


class RankFilter(logging.Filter):
    """Rank 0 prints every message; another rank only its errors (the others are rank 0's to say)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.ERROR


class RichPrinter(RichHandler):
    """A message printed as `console.print` prints it (no time, level or path columns), after
    `label` (a job's rank, on errors)."""

    def __init__(self, console: Console, label: str = "") -> None:
        super().__init__(console=console, show_time=False, show_level=False, show_path=False, markup=True)
        self.label = label

    def render(
        self, *, record: logging.LogRecord, traceback: Traceback | None, message_renderable: ConsoleRenderable
    ) -> ConsoleRenderable:
        if self.label and isinstance(message_renderable, Text):
            return Text.assemble(self.label, message_renderable)
        return message_renderable


def _below_error(record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR


def setup(level: int = logging.INFO, console: Console | None = None, errors: Console | None = None) -> None:
    """Print flopwise's messages from `level` up: below ERROR on `console` (stdout by default),
    rank 0's only; errors on `errors` (stderr), every rank's, each after its rank in a job."""
    out = RichPrinter(console or Console())
    out.addFilter(RankFilter(rank()))
    out.addFilter(_below_error)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    err = RichPrinter(errors or Console(stderr=True, soft_wrap=True), f"rank {rank()}: " if world > 1 else "")
    err.setLevel(logging.ERROR)
    LOGGER.handlers[:] = [out, err]
    LOGGER.setLevel(level)


@contextmanager
def printing_to(console: Console) -> Iterator[None]:
    """Messages below ERROR printed on `console` while inside, at the level set up (INFO if none):
    stderr where stdout carries a command's result, or a buffer that keeps them as text."""
    handlers, level = LOGGER.handlers[:], LOGGER.level
    errors = next((h.console for h in handlers if isinstance(h, RichPrinter) and h.level >= logging.ERROR), None)
    setup(level or logging.INFO, console, errors)
    try:
        yield
    finally:
        LOGGER.handlers[:] = handlers
        LOGGER.setLevel(level)


def console() -> Console:
    """Where a progress bar draws: the messages' console where this process prints INFO, else a
    console that prints nothing (another rank, --quiet, or no `setup`)."""
    if LOGGER.isEnabledFor(logging.INFO) and rank() == 0:
        for h in LOGGER.handlers:
            if isinstance(h, RichPrinter) and h.level < logging.ERROR:
                return h.console
    return Console(quiet=True)
