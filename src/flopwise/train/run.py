"""A built run (what the training loop gets, ready-made) and how a checkpoint's state goes back
into it: on resume (checked to be this run's) and on a guard's rollback."""

from __future__ import annotations

import binascii
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.markup import escape

from flopwise.checkpoints import checkpoint
from flopwise.checkpoints.export import checkpoint_config
from flopwise.config.schema import Config
from flopwise.data.loader import TokenLoader
from flopwise.data.mixture import Source
from flopwise.data.tokenizer import GuardedTokenizer
from flopwise.errors import CheckpointError, ConfigError
from flopwise.layout.rules import Layout
from flopwise.parallel import mesh
from flopwise.train.engine import Engine
from flopwise.train.guard import Guard

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """One rank's share of a run, built and (if a checkpoint was found) restored."""

    cfg: Config
    par: mesh.Parallel
    engine: Engine
    optimizer: torch.optim.Optimizer
    loader: TokenLoader
    sources: list[Source]
    index: dict  # the first source's index.json (its tokenizer is every source's)
    tokenizer: GuardedTokenizer
    guard: Guard
    data_fingerprint: str = ""
    start_step: int = 0
    resumed_from: Path | None = None
    resumed_layout: dict | None = None


# What a resumed run must share with the checkpoint: the model, the order and shape of its data.
# Anything else (layout, steps, LR schedule tail, dtype, logging, ...) may change and is reported.
_FIXED_ON_RESUME = ("model.", "data.seq_len", "train.global_batch", "run.seed")
_NOT_COMPARED = ("model.preset", "model.init_from", "run.dir", "checkpoint.resume", "data.path")


def flat(tree: dict, prefix: str = "") -> dict:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _check_resumable(ckpt: Path, state: dict, cfg: Config) -> list[str]:
    """Refuse (one line naming the keys) a checkpoint of another model or data order; the keys that
    changed but may, to report."""
    saved = flat(checkpoint_config(ckpt, state).model_dump(mode="json"))
    now = flat(cfg.model_dump(mode="json"))
    changed = sorted(
        k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k) and not k.startswith(_NOT_COMPARED)
    )
    fixed = [k for k in changed if k.startswith(_FIXED_ON_RESUME)]
    if fixed:
        diff = ", ".join(f"{k}={saved.get(k)!r} there, {now.get(k)!r} here" for k in fixed[:4])
        raise CheckpointError(
            f"checkpoint {ckpt} is of another run ({diff}); resume with the same values, or start "
            "fresh in another run.dir"
        )
    return changed


def check_data(ckpt: Path, state: dict, data_fp: str) -> None:
    """Refuse a checkpoint trained on other data than the run's (its data fingerprint differs)."""
    if state.get("data_fingerprint") not in (None, data_fp):
        raise CheckpointError(
            f"checkpoint {ckpt} was trained on other data (data fingerprint differs from "
            "index.json here); point data.path at its data, or start fresh in another run.dir"
        )


class RanksDiffer(ConfigError):
    """The ranks of one job were given different configs or data (each agent its own arguments)."""


def check_same_job(what: dict[str, object]) -> None:
    """Every rank of a job holds what rank 0 holds (`what`: its resolved config, flattened, or its
    data fingerprint), checked once with one all-gather before any step: a rank of another config
    would train a diverging replica or trip a collective. A difference stops every rank (exit 2),
    rank 0 naming the keys and the ranks in one line."""
    if not dist.is_initialized():
        return
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, what)
    differ: dict[str, list[int]] = {}
    for rank, theirs in enumerate(every):
        for k in sorted(theirs.keys() | every[0].keys()):
            if theirs.get(k) != every[0].get(k):
                differ.setdefault(k, []).append(rank)
    if differ:
        keys = "; ".join(
            f"{k}={every[0].get(k)!r} on rank 0, {every[r[0]].get(k)!r} on rank {', '.join(map(str, r))}"
            for k, r in list(differ.items())[:4]
        )
        raise RanksDiffer(
            f"the ranks of this job run different jobs ({keys}{' ...' if len(differ) > 4 else ''}); give every "
            "node the same command, config and data"
        )


def restore(run: Run, ckpt: Path, counters: bool = True) -> dict:
    """Model, optimizer, data position, RNG and guard window from a checkpoint into `run`; its
    state (counters=False: a rollback, whose guard keeps counting)."""
    state = checkpoint.load(ckpt, run.engine.parts, run.optimizer)
    if run.engine.weights_nonfinite(agreed=True).item():  # never trusted to resume or roll back to
        raise CheckpointError(
            f"checkpoint {ckpt} holds non-finite weights; resume an earlier one by path (checkpoint.resume=PATH)"
        )
    parts = {
        "loader": lambda: run.loader.load_state_dict(_loader_state(state["loader"])),
        "rng": lambda: checkpoint.set_rng_state(state["rng"]),
        "guard": lambda: run.guard.load_state_dict(state.get("guard"), counters=counters),
        "step": lambda: state.update(step=_count(state["step"])),
    }
    for field, apply in parts.items():
        _checked(ckpt, field, apply)
    return state


def _checked(ckpt: Path, field: str, apply: Callable[[], object]) -> None:
    """Run `apply` on state.json's `field`: it is plain data from the folder, so any wrong type or
    value in it is a damaged checkpoint, said in one line."""
    try:
        apply()
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RuntimeError, binascii.Error) as e:
        raise CheckpointError(
            f"checkpoint {ckpt}: state.json field {field!r} is malformed ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:100]}); use another checkpoint"
        ) from None


def _loader_state(value: object) -> dict:
    """The loader's saved position, its counters checked: a negative epoch or cursor (a damaged
    state.json) would raise in numpy or loop for ever at the first batch, not here."""
    if not isinstance(value, dict) or not isinstance(value.get("sources", []), list):
        raise TypeError("not an object with a list of sources")
    _count(value.get("batches"))
    for source in value.get("sources", []):
        if not isinstance(source, dict):
            raise TypeError(f"source entry {source!r} is not an object")
        for key in ("epoch", "cursor", "taken", "n_windows"):
            _count(source.get(key))
    return value


def _count(value: object) -> int:
    """A non-negative integer counter from state.json (not a bool, float or string)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def last_step(cfg: Config) -> int:
    """The step this invocation of the run ends at (train.steps, or train.stop_after before it)."""
    return min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)


@dataclass
class Finished:
    """A run whose resume point is at its end already (a finished command run again): what its
    summary needs, from the checkpoint's state.json; no model built, no tensor read."""

    cfg: Config
    checkpoint: Path
    state: dict  # its "step" checked
    index: dict  # the data's index.json
    is_main: bool


def resume_state(ckpt: Path, cfg: Config) -> dict:
    """The state.json of the checkpoint to resume from, read before anything is written or built:
    refused in one line if it is another run's (model, data order, steps past train.steps); what
    changed is said. Its data is checked once prepared (`check_data`)."""
    state = checkpoint.read_state(ckpt)
    changed = _check_resumable(ckpt, state, cfg)
    if changed:
        logger.info(
            f"[bold]resume[/]: changed since the checkpoint: {escape(', '.join(changed))}", extra={"highlighter": None}
        )
    _checked(ckpt, "step", lambda: state.update(step=_count(state["step"])))
    _checked(ckpt, "layout", lambda: Layout.from_json(state.get("layout") or {}).name())
    if state["step"] > cfg.train.steps:
        raise ConfigError(
            f"checkpoint {ckpt} is at step {state['step']}, past train.steps={cfg.train.steps}; raise "
            "train.steps to continue it, or start a new run.dir"
        )
    return state


def resume(run: Run, ckpt: Path) -> None:
    """Restore `ckpt` (checked by `resume_state`) into `run`."""
    state = restore(run, ckpt)
    run.start_step, run.resumed_layout = state["step"], state.get("layout", {})
