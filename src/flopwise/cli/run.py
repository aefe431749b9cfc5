"""`flopwise train`, `eval`, `lm-eval` and `generate`: a model trained, scored and sampled."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from flopwise import log
from flopwise.cli.common import ARGS_HELP, config_from, logger, names, note, stdout
from flopwise.errors import FlopwiseError


def train_cmd(
    args: list[str] | None = typer.Argument(None, help=ARGS_HELP),
    rehearse: bool = typer.Option(
        False,
        "--rehearse",
        help="train nothing: rehearse this run at its full world (cluster.gpus) on this CPU, "
        "as `flopwise plan ... --rehearse`",
    ),
) -> None:
    """Train a model (default: a small Llama-style model on the embedded Shakespeare corpus).

    Every key and its default: `flopwise config docs` (docs/config.md)."""
    if rehearse:  # the same build path, one step of each distinct rank on fake tensors
        from flopwise.cli.plan import rehearse_cmd

        rehearse_cmd(args, None, as_json=False)
        return
    applied: list[str] = []
    try:
        cfg = config_from(args, applied)  # a typo is answered before torch is imported (seconds on a busy machine)
    except FlopwiseError as e:  # every rank of a job reads the same config: rank 0 says what is wrong
        e.quiet = log.rank() != 0
        raise
    from flopwise.train.launch import train
    from flopwise.train.trainer import summary_table

    if applied:
        logger.info(
            f"[bold]continued pre-training[/] defaults (docs/continued-pretraining.md; Gupta et al. 2023, "
            f"Ibrahim et al. 2024), set where you gave none: {' '.join(applied)}",
            extra={"highlighter": None},
        )
    result = train(cfg)
    if not result.is_main:
        return
    stdout.print(summary_table(result))
    if result.preempted is not None:
        verb = "stopped" if result.signal == "SIGINT" else "preempted"
        saved = f"checkpoint {result.checkpoint} written" if result.checkpoint else "no checkpoint yet, nothing to save"
        stdout.print(
            f"[bold]{verb}[/] by {result.signal or 'a signal to another rank'} at step {result.preempted}: {saved}; "
            "run the same command again to continue"
        )
    if result.sample:
        stdout.rule("sample")
        stdout.print(result.sample, markup=False, highlight=False)


def eval_cmd(
    ckpt: Path = typer.Argument(..., help="a checkpoint folder or a run folder (its newest checkpoint)"),
    text: Path | None = typer.Option(None, "--text", help="a UTF-8 text file: loss per token and perplexity"),
    tasks: str | None = typer.Option(None, "--tasks", help="comma-separated built-in task names or JSONL files"),
    shots: int = typer.Option(0, "--shots", min=0, help="k-shot: examples with answers before each prompt"),
    seed: int = typer.Option(0, "--seed", help="seed of the k-shot example choice"),
    limit: int | None = typer.Option(None, "--limit", min=1, help="first N examples of each task"),
    as_json: bool = typer.Option(False, "--json"),
    batch: int = typer.Option(8, "--batch", min=1),
    seq_len: int | None = typer.Option(
        None,
        "--seq-len",
        min=1,
        help="--text: tokens per scored window (default: "
        "the model's context, model.max_seq_len); compare losses at one window",
    ),
    clean_against: str | None = typer.Option(
        None,
        "--clean-against",
        help="training data (a prepared folder or raw inputs): also score the examples without a 13-gram in it",
    ),
) -> None:
    """Perplexity on a text file, or zero/few-shot tasks scored by log-likelihood."""
    from rich.progress import Progress

    from flopwise.eval.report import evaluate_checkpoint

    bar = Progress(console=Console(stderr=True), transient=True)  # drawn from the first task on

    def started(name: str, total: int):
        bar.start()
        return partial(bar.advance, bar.add_task(name, total=total))

    try:
        task_names = names(tasks) if tasks is not None else None
        result = evaluate_checkpoint(
            ckpt, text, task_names, shots, seed, limit, batch, seq_len, clean_against, started, note
        )
    finally:
        bar.stop()
    if as_json:
        typer.echo(json.dumps(result.text) if result.text else json.dumps(result.tasks, indent=1))
    elif result.text:
        how = "--seq-len" if seq_len else "the model's context, model.max_seq_len; --seq-len to change"
        r = result.text
        stdout.print(
            f"{text}: loss {r['loss']:.4f} nats/token, ppl {r['ppl']:.2f} over "
            f"{r['tokens']:,} tokens, in windows of {r['seq_len']} tokens ({how})",
            highlight=False,
        )
    else:
        _print_tasks(result.tasks, f"{shots}-shot evaluation of {ckpt}", clean_against)


def _print_tasks(results: list[dict], title: str, clean_against: str | None) -> None:
    table = Table(title=title)
    extra = ("clean n", "clean acc", "clean acc_norm") if clean_against is not None else ()
    for col in ("task", "n", "acc", "acc_norm", "ppl", *extra):
        table.add_column(col)
    num = lambda x: "–" if x is None else f"{x:.3f}"  # noqa: E731
    for r in results:
        cells = (str(r["clean_n"]), num(r["clean_acc"]), num(r["clean_acc_norm"])) if extra else ()
        table.add_row(r["task"], str(r["n"]), num(r["acc"]), num(r["acc_norm"]), f"{r['ppl']:.2f}", *cells)
    stdout.print(table)
    if extra:
        stdout.print(f"[dim]clean: examples sharing no 13-gram of normalized words with {clean_against}[/]")


def lm_eval_cmd(ctx: typer.Context) -> None:
    """lm-evaluation-harness with `--model flopwise` registered and the built-in tasks as flopwise_NAME."""
    try:
        from flopwise.eval.harness import run_lm_eval as harness_main
    except ImportError:
        from flopwise.errors import ConfigError

        raise ConfigError("flopwise lm-eval needs lm-eval: pip install 'flopwise[lm-eval]'") from None
    harness_main(list(ctx.args))


def generate_cmd(
    ckpt: Path = typer.Argument(..., help="a checkpoint folder or a run folder"),
    prompt: str = typer.Option(..., "--prompt"),
    max_new_tokens: int = typer.Option(100, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.8, "--temperature", min=0.0, help="0 = greedy"),
    top_k: int | None = typer.Option(None, "--top-k", min=1),
    top_p: float | None = typer.Option(None, "--top-p", min=0.0, max=1.0),
    seed: int = typer.Option(0, "--seed"),
    no_cache: bool = typer.Option(False, "--no-cache", help="recompute the full context each token"),
) -> None:
    """Sample a continuation of a prompt with a KV cache."""
    from flopwise.eval.generate import complete

    c = complete(ckpt, prompt, max_new_tokens, temperature, top_k, top_p, seed, not no_cache, note)
    typer.echo(c.text)
    if c.at_context_limit:
        note(
            f"stopped after {c.new_tokens} new tokens at the model's context limit (max_seq_len={c.max_seq_len}, "
            f"the prompt is {c.prompt_tokens} tokens)"
        )
