"""What a config's run draws from its data mixture (`flopwise data mix`): the sources prepared as
the run prepares them, under its run folder, and the epochs and effective tokens of each."""

from __future__ import annotations

from flopwise.config.schema import Config
from flopwise.data.mixture import SourceDraw, draws
from flopwise.files.ownership import folder_lock
from flopwise.train.build import ensure_data


def planned_draws(cfg: Config, tokens: float | None = None) -> tuple[float, list[SourceDraw]]:
    """The planned training tokens (default: train.steps × global_batch × seq_len) and what they
    draw from each source; one writer at a time in run.dir, where raw sources are prepared."""
    planned = tokens if tokens is not None else cfg.train.steps * cfg.train.global_batch * cfg.data.seq_len
    with folder_lock(cfg.run.dir, "run.dir") as run_dir:
        return planned, draws(ensure_data(cfg, run_dir), planned)
