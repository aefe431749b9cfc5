"""Jobs the torchrun worker runs: each takes config overrides and returns JSON-able results."""

from rich.console import Console

from flopwise.config import load_config
from flopwise.train.trainer import train


def losses(overrides: list[str]) -> dict:
    r = train(load_config(None, overrides), Console(quiet=True))
    return {"losses": r.losses, "val_loss": r.val_loss}
