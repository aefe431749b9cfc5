"""The `flopwise` command line: one module per command group, each command parsing its arguments,
calling one library function and printing what it returns (tables: render.py). Here: the app,
its options, and `main`, which turns a user's error into one line and an exit code."""

from __future__ import annotations

import errno
import logging
import sys
import time

import typer
import typer.core

from flopwise import log
from flopwise.cli import audit, checkpoint, config, data, hardware, plan, run, scale
from flopwise.cli.common import refuse, stdout
from flopwise.errors import FlopwiseError

_type_column = typer.core.TyperOption.display_type_rich


def _flag_untyped(option: typer.core.TyperOption, ctx) -> str | None:
    """typer 0.29 prints every flag as `--json <bool>`, as if it took a value: a flag's type column
    stays empty (an option that takes a value keeps its `<int>`, `<path>`)."""
    return None if option.is_flag else _type_column(option, ctx)


typer.core.TyperOption.display_type_rich = _flag_untyped  # type: ignore[method-assign,assignment]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Plan, train and audit compute-optimal dense LLMs.",
)


@app.callback()
def _messages(
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print only warnings and errors"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="print debug messages too"),
) -> None:
    """How much flopwise says while it works (results are printed either way)."""
    log.setup(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO, stdout)


app.command("train")(run.train_cmd)
app.command("presets")(config.presets_cmd)
app.command("eval")(run.eval_cmd)
app.command(
    "lm-eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False
)(run.lm_eval_cmd)
app.command("generate")(run.generate_cmd)
app.command("audit")(audit.audit_cmd)
app.add_typer(plan.app, name="plan")
app.add_typer(config.app, name="config")
app.add_typer(data.app, name="data")
app.add_typer(scale.app, name="scale")
app.add_typer(checkpoint.convert_app, name="convert")
app.add_typer(checkpoint.checkpoint_app, name="checkpoint")
app.add_typer(hardware.app, name="hardware")

# paths no command can use, whatever it does with them: the OS's reason and the fix
# A rank whose refusal another rank says waits this long before it exits: torchrun stops a job's
# other ranks as soon as one exits, so a quiet rank leaving first could stop rank 0 before it says
# why (seen in CI at load: exit 2, nothing said). Rank 0 says it and exits at once; torchrun then
# stops this rank (SIGTERM, still a refusal to train.agent).
QUIET_RANK_WAIT_S = 10

BAD_PATHS = {
    errno.ENAMETOOLONG: "choose a shorter name (at most 255 bytes per part of a path)",
    errno.ELOOP: "a symbolic link there points back round to itself: fix or remove the link",
}


def main() -> None:
    log.setup(console=stdout)  # the options (app's callback) set it up again, at their level
    try:
        app()
    except FlopwiseError as e:
        if e.quiet:  # said by another rank (rank 0): let it say so before this one's exit stops the job
            time.sleep(QUIET_RANK_WAIT_S)
            sys.exit(2)
        refuse(str(e))
    except OSError as e:  # a path the OS refused that no command turned into its option's error: still one line
        from flopwise.files.outputs import UNWRITABLE

        where = f"{e.filename or 'a path'}: {e.strerror or type(e).__name__}"
        if e.errno in BAD_PATHS:
            refuse(f"{where}; {BAD_PATHS[e.errno]}")
        if e.errno not in UNWRITABLE:
            raise
        refuse(f"{where}; choose a path you can write, fix its permissions or free space there")
    except RuntimeError as e:  # pathlib's resolve() of a symlink loop before Python 3.13 (then OSError ELOOP)
        if not str(e).startswith("Symlink loop from "):
            raise
        refuse(f"{str(e).removeprefix('Symlink loop from ').strip(chr(39))}: {BAD_PATHS[errno.ELOOP]}")
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        dist = sys.modules.get("torch.distributed")  # never import torch just for this (plan stays fast)
        if dist is not None and dist.is_initialized():  # a torchrun rank: leave the group cleanly
            dist.destroy_process_group()
