"""`flopwise data prepare|mix|contamination`: token shards made, a mixture's draws, task overlap."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flopwise import log
from flopwise.cli.common import ARGS_HELP, config_from, names, stdout
from flopwise.cli.render import human, new_table

app = typer.Typer(
    no_args_is_help=True,
    help="Prepare token shards, read a config's data mixture, check tasks for contamination.",
)


@app.command("prepare")
def prepare_cmd(
    inputs: list[str] = typer.Argument(..., help="text files, folders, .jsonl (text field), .parquet, or builtin:NAME"),
    out: Path = typer.Option(..., "--out", help="output folder (an unfinished prepare there is resumed)"),
    tokenizer: Path | None = typer.Option(
        None,
        "--tokenizer",
        help="an existing tokenizer.json, or a Hugging Face model folder (its tokenizer: for continuing that model)",
    ),
    train_tokenizer: int | None = typer.Option(
        None,
        "--train-tokenizer",
        help="train a byte-level BPE of this vocab size (on the first 200 MB); default 4096 without --tokenizer",
    ),
    val_fraction: float | None = typer.Option(
        None,
        "--val-fraction",
        min=0.0,
        max=0.99,
        help="documents held out for validation (default: data.val_fraction's)",
    ),
    seed: int | None = typer.Option(
        None,
        "--seed",
        help="seed of the split (default: run.seed's, so the split "
        "is the one `flopwise train` makes, which the built-in tasks hold out)",
    ),
    workers: int | None = typer.Option(None, "--workers", min=1, help="processes (default: all cores)"),
    filters: str = typer.Option("", "--filter", help="quality filters: gopher,c4"),
    dedup: str = typer.Option("", "--dedup", help="deduplication: exact,minhash"),
    decontaminate: str = typer.Option(
        "", "--decontaminate", help="evaluation tasks (comma-separated) whose 13-grams drop a training document"
    ),
    force: bool = typer.Option(False, "--force", help="replace --out even if it is not a flopwise data folder"),
) -> None:
    """Tokenize text into numbered token shards with an index and a train/val split by document,
    in parallel (datatrove), optionally quality-filtered and deduplicated, with a report."""
    from flopwise.config.schema import DataConfig, RunConfig
    from flopwise.data.prepare import prepare_data
    from flopwise.errors import ConfigError

    if tokenizer is not None and train_tokenizer is not None:
        raise ConfigError(
            f"--tokenizer {tokenizer} and --train-tokenizer {train_tokenizer} conflict: give one "
            "(--tokenizer uses that tokenizer, --train-tokenizer trains a new one)"
        )
    with _tokenize_bar() as show:
        stats = prepare_data(
            inputs,
            out,
            tokenizer=str(tokenizer) if tokenizer else f"bpe:{train_tokenizer or 4096}",
            val_fraction=DataConfig.model_fields["val_fraction"].default if val_fraction is None else val_fraction,
            seed=RunConfig.model_fields["seed"].default if seed is None else seed,
            force=force,
            workers=workers,
            filters=filters,
            dedup=dedup,
            decontaminate=decontaminate,
            progress=show,
        )
    _print_prepared(stats, out)


@contextmanager
def _tokenize_bar() -> Iterator:
    """A progress bar of the stages, with tokens and tokens/s: `show(stage, done, total, tokens)`."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    started = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[rate]}"), TimeElapsedColumn())
    with Progress(*columns, console=log.console()) as bar:
        task = bar.add_task("tokenize", total=None, rate="")

        def show(stage: str, done: int, total: int, tokens: int) -> None:
            rate = tokens / max(time.perf_counter() - started, 1e-9)
            bar.update(
                task, description=stage, completed=done, total=total, rate=f"{tokens:,} tokens, {rate:,.0f} tokens/s"
            )

        yield show


def _print_prepared(stats, out: Path) -> None:
    from flopwise.data.shards import skipped_note

    report = stats.report
    if report["stages"]:
        table = Table("stage", "documents in", "removed", "bytes removed", "rules / clusters")
        for row in report["stages"]:
            detail = ", ".join(f"{k} {v}" for k, v in row.get("rules", {}).items()) or (
                f"{row['clusters']} clusters" if "clusters" in row else ""
            )
            removed = row.get("bytes_removed", row.get("bytes_removed_with_lines", 0))
            table.add_row(
                row["stage"], f"{row['documents_in']:,}", f"{row['documents_removed']:,}", f"{removed:,}", detail
            )
        stdout.print(table)
    stdout.print(
        f"{stats.documents} documents, {stats.tokens:,} tokens (train {stats.splits['train']:,}, "
        f"val {stats.splits['val']:,}), {stats.bytes:,} bytes in {stats.seconds:.1f} s "
        f"= {stats.tokens_per_s:,.0f} tokens/s -> {out} (report.json)"
    )
    if report.get("skipped"):
        stdout.print(f"[yellow]skipped[/]: {escape(skipped_note(report['skipped']))} (report.json: skipped)")


@app.command("mix")
def mix_cmd(
    args: list[str] | None = typer.Argument(None, help=ARGS_HELP),
    tokens: float | None = typer.Option(
        None, "--tokens", help="planned training tokens (default: the config's train.steps × global_batch × seq_len)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print a JSON list"),
) -> None:
    """A config's data mixture: tokens per source, and the epochs a planned run takes of each."""
    from flopwise.data.mixture import EPOCH_WARNING
    from flopwise.train.build import planned_draws

    cfg = config_from(args)
    with log.printing_to(Console(stderr=True)):  # stdout carries the table or the JSON
        planned, rows = planned_draws(cfg, tokens)
    if as_json:
        typer.echo(json.dumps([r.__dict__ for r in rows], indent=1))
        return
    columns = ("source", "weight", "unique tokens", "documents", "drawn", "epochs", "effective tokens")
    table = new_table(f"data mixture for {human(planned)} training tokens", columns, left=("source",), no_wrap=True)
    for r in rows:
        table.add_row(
            r.name,
            f"{r.share:.3f}",
            human(r.unique_tokens),
            str(r.documents),
            human(r.drawn_tokens),
            f"{r.epochs:.2f}",
            human(r.effective_tokens),
        )
    stdout.print(table)
    stdout.print(
        f"effective tokens {human(sum(r.effective_tokens for r in rows))} of {human(planned)} drawn "
        "(repeats discounted per source, Muennighoff et al. 2023)"
    )
    for r in rows:
        if r.over_repeated:
            stdout.print(
                f"[yellow]warning[/]: source {r.name!r} is seen {r.epochs:.1f} times (over {EPOCH_WARNING:g} "
                "epochs, repeats add little); lower its weight or add unique data"
            )


@app.command("contamination")
def contamination_cmd(
    data: str = typer.Argument(
        ...,
        help="a prepared data folder (its train split) or raw inputs: a text file, "
        "folder, .jsonl, .parquet or builtin:NAME",
    ),
    tasks: str = typer.Option(..., "--tasks", help="comma-separated built-in task names or JSONL files"),
    n: int = typer.Option(13, "--n", min=1, help="n-gram length in normalized words (GPT-3: 13)"),
    as_json: bool = typer.Option(False, "--json", help='print [{"task", "examples", "contaminated", "share"}, ...]'),
    ids_out: Path | None = typer.Option(
        None, "--ids-out", help="write the contaminated example indices per task (JSON)"
    ),
) -> None:
    """Which evaluation examples share an n-gram with the training data (GPT-3's 13-gram rule)."""
    from flopwise.data.contamination import contamination_report

    report = contamination_report(data, names(tasks), n, ids_out)
    if as_json:
        typer.echo(json.dumps(report.rows(), indent=1))
        return
    table = new_table(
        f"contamination of tasks by {data} ({n}-grams of normalized words)",
        ("task", "examples", "contaminated", "share"),
        left=("task",),
    )
    for r in report.rows():
        table.add_row(r["task"], str(r["examples"]), str(r["contaminated"]), f"{r['share']:.1%}")
    stdout.print(table)
    stdout.print(
        f"{len(report.touched):,} of {report.documents:,} training documents contain a task n-gram; "
        f"{report.words:,} words ({report.bytes / 1e6:.1f} MB) scanned in {report.seconds:.1f} s"
    )
