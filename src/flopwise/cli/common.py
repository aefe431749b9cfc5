"""What every command shares: where results print, the config from CONFIG and key=value
arguments, and the one-line note and refusal."""

from __future__ import annotations

import logging
import sys
from typing import NoReturn

from rich.console import Console
from rich.markup import escape

# Piped or logged, rich would lay tables out at 80 columns and cut numbers to "4…": never cut them
stdout = Console() if sys.stdout.isatty() else Console(width=200)
logger = logging.getLogger("flopwise.cli")

DEFAULT_CONFIG = "demo"
# help texts are rich markup: "[key=value ...]" unescaped would be read as a style tag and vanish
ARGS_HELP = escape("[CONFIG] [key=value ...]: a TOML file or built-in name (default: demo), then overrides")


def config_from(args: list[str] | None, applied: list[str] | None = None):
    """The validated config of `[CONFIG] [key=value ...]`; `applied` hears the defaults set for
    continued pre-training."""
    from flopwise.config.schema import load_config, split_cli_args

    path, overrides = split_cli_args(args)
    return load_config(path or DEFAULT_CONFIG, overrides, applied)


def names(text: str) -> list[str]:
    """A comma-separated option (`--tasks a,b`) as its names."""
    return [t.strip() for t in text.split(",") if t.strip()]


def note(message: str) -> None:
    """A one-line note on stderr (stdout stays the command's output)."""
    Console(stderr=True, soft_wrap=True).print(f"[yellow]note[/]: {escape(message)}", markup=True, highlight=False)


def note_if_busy(what: str) -> None:
    """The note that this machine is busy, before `what` times anything on it."""
    from flopwise.hardware.catalogue import busy_note

    if message := busy_note(what):
        note(message)


def refuse(message: str) -> NoReturn:
    """The one-line error of a refused command, printed as every error is (stderr, after its rank in a job)."""
    logger.error(f"[red]error:[/] {escape(message)}", extra={"highlighter": None})
    sys.exit(2)
