"""IsoFLOP ladders: K budgets × M model sizes around each budget's predicted optimum, one training
config per run, run here (resumable; one after another, or several at once) or emitted as launch
commands, collected into the table `flopwise scale fit` reads.

Every run trains for D = C/(6N) tokens with a cosine schedule whose length equals its own step
count, decaying to 10% of the peak LR (Hoffmann et al. 2022 App. B: a cosine cycle longer than
the run overstates the loss), so each point is a properly finished run of its size. N counts
non-embedding parameters and C = 6·N·D, as Kaplan et al. do: at ladder sizes of 10^5-10^6 the
embedding rows would otherwise be most of N and bend the fit.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import math
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Self, cast

from rich.console import Console

from flopwise.config.schema import Config, to_toml, validate
from flopwise.data.shards import SHARDS_FORMAT, input_digest
from flopwise.errors import ConfigError, TrainingStopped
from flopwise.files.outputs import cache_dir, check_folder, check_writable, read_records, write_csv, write_text
from flopwise.files.ownership import folder_lock
from flopwise.flops import scaling_flops, scaling_tokens
from flopwise.log import printing_to
from flopwise.scale.fit import fitted_law
from flopwise.scale.laws import ChosenShape, ParametricLaw, choose_shape, get_law

if TYPE_CHECKING:
    from flopwise.train.trainer import TrainResult

logger = logging.getLogger(__name__)


@dataclass
class LadderRun:
    name: str
    budget: float
    params: int  # non-embedding: at these sizes the embeddings would dominate N (Kaplan §2.1)
    tokens: int
    steps: int
    config: Config


@dataclass(frozen=True)
class LadderPreset:
    """A ladder with its data, shapes and budgets chosen together: `scale sweep --preset NAME`."""

    about: str
    overrides: tuple[str, ...]  # on top of the base config, before the user's own key=value
    budgets: str
    sizes: int
    spread: float
    law: str
    heldout: float  # the budget docs/scaling-laws.md predicts with the fitted law, then trains


LADDER_PRESETS = {
    # Centred on the law the first version of this ladder fitted (laws.py's cpu-tiny: this setting's
    # optimum is about a third of chinchilla-1's N), at budgets whose optimum (32K, 52K, 83K) lies
    # above the smallest shape (13K), so every budget can be bracketed. Measured in
    # docs/scaling-laws.md (wall-clock, CPU seconds, losses against the law's predictions).
    "cpu-tiny": LadderPreset(
        about="3 budgets x 5 sizes of 13K-332K parameters on Shakespeare (bpe:512, seq 128)",
        overrides=(
            'data.tokenizer="bpe:512"',
            "model.vocab_size=512",
            "data.seq_len=128",
            "model.max_seq_len=128",
            "train.global_batch=16",
            "train.micro_batch=16",
            "train.eval_batches=32",
        ),
        budgets="1e12,2e12,4e12",
        sizes=5,
        spread=16.0,
        law="cpu-tiny",
        heldout=3e12,
    ),
}


_NO_PRESET = LadderPreset("the flags' defaults", (), "3e12,1e13,3e13", 5, 8.0, "chinchilla-3", 0.0)


def ladder_preset(name: str | None) -> LadderPreset:
    """A named preset, or (None) the flags' own defaults."""
    if name is None:
        return _NO_PRESET
    if name not in LADDER_PRESETS:
        raise ConfigError(f"--preset {name!r}: unknown (known: {', '.join(LADDER_PRESETS)})")
    return LADDER_PRESETS[name]


def plan_ladder(
    base: Config,
    budgets: list[float],
    sizes: int,
    spread: float,
    law_name: str = "chinchilla-3",
    out: str | Path = "runs/ladder",
) -> list[LadderRun]:
    """Configs for every (budget, size): sizes spaced geometrically over [N_opt/√spread, N_opt·√spread]
    (sizes that round to the same shape are kept once). A budget too small for one training step of
    one of its sizes is refused, naming the smallest budget that gives each of them a step."""
    if sizes < 1 or spread < 1:
        raise ConfigError("--sizes must be >= 1 and --spread >= 1")
    law = get_law(law_name, fitted_law(law_name))
    out = Path(out)
    data_dir = _data_dir(base, out)
    tokens_per_step = base.train.global_batch * base.data.seq_len
    shapes = {budget: _shapes(law, budget, sizes, spread, base.model.vocab_size) for budget in budgets}
    for budget in budgets:
        if not _one_step_each(shapes[budget], budget, tokens_per_step):
            smallest = _smallest_budget(law, budget, sizes, spread, base.model.vocab_size, tokens_per_step)
            largest = max(s.non_embedding_params for s in shapes[budget])
            raise ConfigError(
                f"--budgets {budget:g}: too small for one training step of its models ({largest:,} "
                f"non-embedding params × {tokens_per_step:,} tokens per step is "
                f"{scaling_flops(largest, tokens_per_step):.3g} FLOPs); the smallest budget that gives "
                f"each size a step is {smallest:.2g} (or lower train.global_batch / data.seq_len)"
            )
    runs = []
    for budget in budgets:
        for shape in shapes[budget]:
            n = shape.non_embedding_params
            steps = round(scaling_tokens(budget, n) / tokens_per_step)
            name = f"C{budget:.0e}-N{n / 1e6:.3f}M".replace("+", "")
            tree = json.loads(base.model_dump_json(exclude_none=True))
            tree["run"].update(name=name, dir=str(out / name))
            tree["data"]["path"] = str(data_dir)
            tree["model"] = {
                "arch": "llama",
                "n_layers": shape.n_layers,
                "d_model": shape.d_model,
                "n_heads": shape.n_heads,
                "head_dim": shape.head_dim,
                "ffn_dim": shape.ffn_dim,
                "vocab_size": base.model.vocab_size,
                "max_seq_len": base.model.max_seq_len,
            }
            tree["train"].update(steps=steps, eval_every=0, sample_tokens=0, stop_after=None)
            tree["train"].pop("stop_after", None)
            tree["optim"].update(
                schedule="cosine",
                min_lr=0.1 * base.optim.lr,
                warmup_steps=min(base.optim.warmup_steps, max(1, steps // 10)),
            )
            tree["checkpoint"].update(interval=0, keep=1, resume="auto")
            runs.append(LadderRun(name, budget, n, steps * tokens_per_step, steps, validate(tree)))
    return runs


def _shapes(law, budget: float, sizes: int, spread: float, vocab: int) -> list:
    """One budget's model shapes, smallest first (tiny targets can round to the same shape: kept once)."""
    n_opt, _ = law.frontier(budget)
    shapes: list[ChosenShape] = []
    for k in range(sizes):
        frac = 0.5 if sizes == 1 else k / (sizes - 1)
        shape = choose_shape(n_opt * spread ** (frac - 0.5), vocab, count_embeddings=False)
        if all(s.non_embedding_params != shape.non_embedding_params for s in shapes):
            shapes.append(shape)
    return shapes


def _one_step_each(shapes: list, budget: float, tokens_per_step: int) -> bool:
    return all(scaling_tokens(budget, s.non_embedding_params) >= tokens_per_step for s in shapes)


def _smallest_budget(law, budget: float, sizes: int, spread: float, vocab: int, tokens_per_step: int) -> float:
    """The smallest budget (2 significant digits, rounded up) at which every size of the ladder gets
    one step: a decade search, then bisection in log space."""

    def ok(c: float) -> bool:
        return _one_step_each(_shapes(law, c, sizes, spread, vocab), c, tokens_per_step)

    lo, hi = budget, budget * 10
    while not ok(hi):
        lo, hi = hi, hi * 10
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    exponent = math.floor(math.log10(hi))
    mantissa = math.ceil(hi / 10**exponent * 10) / 10
    while not ok(mantissa * 10**exponent):  # shape rounding can make a step or two non-monotone
        mantissa += 0.1
    return round(mantissa, 1) * 10**exponent


def _data_dir(base: Config, out: Path) -> Path:
    """The ladder's one prepared copy of the data: the given folder; for one raw input, an entry of
    the data cache named by content (`_cache_entry`), so every ladder over the same corpus and
    tokenizer shares it and a second --out prepares nothing; for a mixture, <out>/data."""
    given = Path(base.data.path)
    if (given / "index.json").exists():
        return given
    return out / "data" if base.data.sources else _cache_entry(base) / "data"


def _cache_entry(base: Config) -> Path:
    """The data cache's folder for `base`'s raw input as `flopwise train` would prepare it: named by
    the sha256 of the input's bytes and the recipe (tokenizer, held-out share, seed, shard format)."""
    tok = base.data.tokenizer
    tok_file = Path(tok)
    recipe = {
        "input": input_digest(base.data.path),
        "tokenizer": hashlib.sha256(tok_file.read_bytes()).hexdigest() if tok_file.is_file() else tok,
        "val_fraction": base.data.val_fraction,
        "seed": base.run.seed,
        "format": SHARDS_FORMAT,
    }
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "data" / key


def _ensure_data(base: Config, runs: list[LadderRun], out: Path) -> None:
    """Prepare the data the runs read, once: in its cache entry (locked: one preparer at a time), or
    in <out> for a mixture; a prepared folder given is read where it is."""
    from flopwise.train.build import ensure_data

    data = Path(runs[0].config.data.path) if runs else out / "data"
    if data == Path(base.data.path):
        return
    if data.parent == out:
        ensure_data(base, out, "--out")
        return
    with folder_lock(data.parent, "the data cache (FLOPWISE_CACHE_DIR)") as entry:
        if (data / "index.json").is_file():
            logger.info(f"data: {data} (prepared before, shared by content)")
        ensure_data(base, entry, "the data cache (FLOPWISE_CACHE_DIR)")


def _is_finished(run: LadderRun) -> bool:
    rows = read_records(Path(run.config.run.dir) / "metrics.jsonl")
    return any(r.get("step") == run.steps and "val_loss" in r for r in rows)


def final_val_loss(run: LadderRun) -> float:
    rows = read_records(Path(run.config.run.dir) / "metrics.jsonl")
    return [r["val_loss"] for r in rows if "val_loss" in r][-1]


def _config_path(r: LadderRun, out: Path) -> Path:
    return out / "configs" / f"{r.name}.toml"


def _check_outputs(runs: list[LadderRun], out: Path, table: bool) -> None:
    """Before any work: `out` can be written, and no user's file holds a config (or, `table`, the
    runs.csv) the sweep writes there; flopwise's own are replaced."""
    check_folder(out, "--out")
    for path in [_config_path(r, out) for r in runs] + ([out / "runs.csv"] if table else []):
        check_writable(path, "--out")


def write_configs(runs: list[LadderRun], out: Path) -> list[Path]:
    """Each run's config TOML under <out>/configs (marked as flopwise's, so a rerun replaces it)."""
    _check_outputs(runs, out, table=False)
    return [write_text(_config_path(r, out), to_toml(r.config), "--out") for r in runs]


def collect(runs: list[LadderRun], out: Path) -> Path:
    """<out>/runs.csv: one row per finished run (marked as flopwise's, so a rerun replaces it)."""
    rows = [
        [r.name, f"{r.budget:.6g}", r.params, r.tokens, scaling_flops(r.params, r.tokens), f"{final_val_loss(r):.6f}"]
        for r in runs
        if _is_finished(r)
    ]
    return write_csv(
        out / "runs.csv", ["name", "budget", "params", "tokens", "flops", "loss"], rows, "--out", "scale sweep"
    )


def _train_one(config: Config, threads: int | None) -> TrainResult:
    """One ladder run, logged to train.log in its run folder (claimed there as flopwise's, like the
    rest of the run's files); `threads` set (in a worker) before any work."""
    global _busy
    _busy = True
    try:
        import torch

        from flopwise.files.rundir import Appender, claim
        from flopwise.train.launch import train

        if threads:
            torch.set_num_threads(threads)
        run_dir = claim(config.run.dir, ["train.log"])
        # an io.TextIOBase: rich writes to it as to any text file; typeshed types a file as IO[str], not its base
        with printing_to(Console(file=cast(IO[str], Appender(run_dir, "train.log")))):
            return train(config)
    finally:
        _busy = False


def run_ladder(base: Config, runs: list[LadderRun], out: Path, jobs: int = 1) -> Path:
    """Train every unfinished run (a killed sweep resumes where it stopped), `jobs` at a time, then collect.

    Ladder models are tiny, and one of them barely uses a second core (2 cores: the smallest ladder
    shape's step takes 14 ms on 2 threads and 23 ms on 1; the ladder's first two rungs train 1.2x
    sooner two at a time, benchmarks/throughput/ladder_speed.md). With `jobs` > 1 that many runs train at once in
    worker processes that split this process's threads, the largest budgets' and longest runs first.
    """
    import torch

    _check_outputs(runs, out, table=True)  # before hours of training, not after
    _ensure_data(base, runs, out)
    write_configs(runs, out)
    todo = []
    for i, r in enumerate(runs, 1):
        if _is_finished(r):
            logger.info(f"[{i}/{len(runs)}] {r.name}: done, skipped")
        else:
            todo.append((i, r))

    def started(i: int, r: LadderRun) -> None:
        logger.info(f"[{i}/{len(runs)}] {r.name}: {r.params:,} params, {r.tokens:,} tokens, {r.steps} steps")

    def finished(r: LadderRun, result: TrainResult) -> None:
        if result.preempted is not None:  # Ctrl-C or SIGTERM: the run checkpointed; the ladder stops here
            raise TrainingStopped(
                f"{r.name} stopped by {result.signal or 'a signal'} at step {result.preempted} "
                "(checkpoint written); run the same command again to continue the ladder"
            )
        logger.info(
            f"    {r.name}: val loss {result.val_loss:.4f}, {result.tokens_per_s:,.0f} tok/s, {result.seconds:.0f} s"
        )

    if jobs == 1:
        for i, r in todo:
            started(i, r)
            finished(r, _train_one(r.config, None))
        return collect(runs, out)
    threads = max(1, torch.get_num_threads() // jobs)
    todo.sort(key=lambda ir: (-ir[1].budget, -ir[1].tokens))
    queue, pending, stopped = iter(todo), {}, []
    with (
        ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init) as pool,
        _Forward() as stop,
    ):

        def submit_next() -> None:  # one run per free worker: nothing waits queued to start after a signal
            for i, r in queue:
                started(i, r)
                pending[pool.submit(_train_one, r.config, threads)] = r
                return

        for _ in range(jobs):
            submit_next()
        try:
            while pending:
                for done in wait(pending, return_when=FIRST_COMPLETED).done:
                    r = pending.pop(done)
                    result = _result(done, stop.signal)
                    if stop.signal or result is None:  # None only after a signal
                        stopped.append(_stopped_run(r, result))
                        continue
                    finished(r, result)
                    submit_next()
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            stop.forward(signal.SIGTERM)  # a worker's error ends the others' runs too, with checkpoints
            raise
    if stop.signal:
        raise TrainingStopped(
            f"scale sweep stopped by {stop.signal}: its {stop.workers} worker process(es) stopped "
            f"too ({'; '.join(stopped)}); run the same command again to continue the ladder"
        )
    return collect(runs, out)


_busy = False  # a worker is running a ladder run (else it waits for one)


def _worker_init() -> None:
    """A sweep worker leads its own process group, so a terminal's Ctrl-C reaches the sweep alone (which
    passes one signal on to each worker's group: a second Ctrl-C would make a trainer stop without a
    checkpoint), and on Linux it gets SIGTERM if the sweep dies without a word. A signal before the
    trainer's own handler (train.watch) is in place ends the run's setup; an idle worker ignores it (its
    death would break the pool and leave the busy ones unable to hand back their results)."""
    os.setpgrp()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _worker_signal)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _worker_signal(signum, frame) -> None:
    if _busy:
        raise KeyboardInterrupt


def _stopped_run(r: LadderRun, result: TrainResult | None) -> str:
    if result is None:
        return f"{r.name}: stopped before training"
    if result.preempted is None:
        return f"{r.name}: finished"
    return f"{r.name}: stopped at step {result.preempted} with a checkpoint"


def _result(done, stop: str | None) -> TrainResult | None:
    """A finished future's result; after a signal a worker killed before its trainer caught it is None."""
    try:
        return done.result()
    except (BrokenProcessPool, KeyboardInterrupt):
        if stop:
            return None
        raise


class _Forward:
    """While active, SIGINT and SIGTERM to the sweep are passed on to its workers' process groups
    (their trainers checkpoint and stop) instead of ending the sweep at once and orphaning them."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.workers = 0  # signalled at the first signal
        self._previous: dict = {}

    def __enter__(self) -> Self:
        for s in (signal.SIGINT, signal.SIGTERM):
            self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _on_signal(self, signum, frame) -> None:
        """Each signal once to each worker (a second Ctrl-C stops its trainer without a checkpoint)."""
        workers = self.forward(signum)
        if self.signal is None:
            self.signal, self.workers = signal.Signals(signum).name, workers

    @staticmethod
    def forward(signum: int) -> int:
        children = multiprocessing.active_children()
        for child in children:
            if child.pid is None:  # not started: nothing to signal
                continue
            try:  # its group, with whatever it started; one that has not run _worker_init yet, itself
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signum)
        return len(children)


def launch_commands(paths: list[Path], nproc: int = 1) -> list[str]:
    return [f"torchrun --standalone --nproc-per-node {nproc} -m flopwise train {p}" for p in paths]


def budgets_from(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--budgets {text!r}: expected comma-separated FLOP counts, e.g. 3e12,1e13,3e13") from None
    if not values or any(v <= 0 or not math.isfinite(v) for v in values):
        raise ConfigError(f"--budgets {text!r}: budgets must be positive numbers")
    return values


def _law_notes(law, runs: list[LadderRun], sizes: int) -> list[str]:
    """One line for each run of a one-size ladder whose shape is not the size the law asked (and
    why), and, under a parametric law (a fitted one), the loss it predicts for each run, before training."""
    lines = []
    for r in runs:
        n_opt = law.frontier(r.budget)[0]
        m = r.config.model
        if sizes == 1 and abs(r.params / n_opt - 1) > 0.1:
            lines.append(
                f"{r.name}: {law.name} asks N = {n_opt:,.0f}; trains {r.params:,} non-embedding parameters, "
                f"the nearest shape ({m.n_layers} layer(s) × d_model {m.d_model}: shapes come in whole "
                "layers and d_model steps of 16 to 1024), for the tokens that keep C = 6ND"
            )
        if isinstance(law, ParametricLaw):
            lines.append(
                f"{r.name}: {law.name} predicts loss {law.loss(r.params, r.tokens):.4f} at N = {r.params:,}, "
                f"D = {r.tokens:,} (before training; compare runs.csv)"
            )
    return lines


@dataclass(frozen=True)
class Sweep:
    runs: list[LadderRun]
    commands: list[str] | None = None  # emitted: one torchrun command per written config
    table: Path | None = None  # trained here: the collected runs.csv


def sweep_ladder(
    base: Config,
    budgets: str,
    sizes: int = 5,
    spread: float = 8.0,
    law: str = "chinchilla-3",
    out: Path = Path("runs/ladder"),
    emit: bool = False,
    nproc: int = 1,
    jobs: int = 1,
    note: Callable[[str], None] = logger.warning,
) -> Sweep:
    """`flopwise scale sweep`: an IsoFLOP ladder of `sizes` sizes per budget (comma-separated FLOPs),
    trained here (resumable) or, with `emit`, written as configs with their launch commands. `note`
    hears first, before any work, when sizes merged (small models round to the same shape)."""
    planned = budgets_from(budgets)
    runs = plan_ladder(base, planned, sizes, spread, law, out)
    if len(runs) < len(planned) * sizes:  # `scale fit` needs enough distinct points
        note(
            f"{len(runs)} runs, not {len(planned)} budgets × {sizes} sizes: {len(planned) * sizes - len(runs)} of "
            "them round to a shape already in their budget (small models) and are trained once; widen --spread "
            "for more distinct sizes"
        )
    for line in _law_notes(get_law(law, fitted_law(law)), runs, sizes):
        note(line)
    with folder_lock(out, "--out"):  # one sweep writes a ladder folder (each run locks its own)
        if emit:
            return Sweep(runs, commands=launch_commands(write_configs(runs, out), nproc))
        return Sweep(runs, table=run_ladder(base, runs, out, jobs))
