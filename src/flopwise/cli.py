"""The `flopwise` command line: parse, validate, call a library function, print. No logic here."""

from __future__ import annotations

import errno
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flopwise import log
from flopwise.errors import FlopwiseError
from flopwise.files.outputs import check_writable, write_json, write_text

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Plan, train and audit compute-optimal dense LLMs.",
)
config_app = typer.Typer(no_args_is_help=True, help="Inspect the resolved config.")
data_app = typer.Typer(no_args_is_help=True, help="Prepare token shards.")
convert_app = typer.Typer(no_args_is_help=True, help="Convert checkpoints to and from Hugging Face format.")
scale_app = typer.Typer(no_args_is_help=True, help="Compute-optimal allocation, scaling-law fits, IsoFLOP ladders.")
app.add_typer(config_app, name="config")
app.add_typer(data_app, name="data")
app.add_typer(scale_app, name="scale")
app.add_typer(convert_app, name="convert")
checkpoint_app = typer.Typer(no_args_is_help=True, help="Consolidate sharded checkpoints.")
app.add_typer(checkpoint_app, name="checkpoint")
hardware_app = typer.Typer(no_args_is_help=True, help="Measure this machine for the planner.")
app.add_typer(hardware_app, name="hardware")
# Piped or logged, rich would lay tables out at 80 columns and cut numbers to "4…": never cut them
console = Console() if sys.stdout.isatty() else Console(width=200)
logger = logging.getLogger("flopwise.cli")


@app.callback()
def _messages(
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print only warnings and errors"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="print debug messages too"),
) -> None:
    """How much flopwise says while it works (results are printed either way)."""
    log.setup(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO, console)


DEFAULT_CONFIG = "demo"
ARGS_HELP = "[CONFIG] [key=value ...]: a TOML file or built-in name (default: demo), then overrides"


def _config(args: list[str] | None, applied: list[str] | None = None):
    from flopwise.config.schema import load_config, split_cli_args

    path, overrides = split_cli_args(args)
    return load_config(path or DEFAULT_CONFIG, overrides, applied)


@app.command()
def train(args: list[str] | None = typer.Argument(None, help=ARGS_HELP)) -> None:
    """Train a model (default: a small Llama-style model on the embedded Shakespeare corpus)."""
    from flopwise.train.launch import train as run_training
    from flopwise.train.trainer import summary_table

    applied: list[str] = []
    cfg = _config(args, applied)
    if applied:
        logger.info(
            f"[bold]continued pre-training[/] defaults (docs/continued-pretraining.md; Gupta et al. 2023, "
            f"Ibrahim et al. 2024), set where you gave none: {' '.join(applied)}",
            extra={"highlighter": None},
        )
    result = run_training(cfg)
    if not result.is_main:
        return
    console.print(summary_table(result))
    if result.preempted is not None:
        verb = "stopped" if result.signal == "SIGINT" else "preempted"
        console.print(
            f"[bold]{verb}[/] by {result.signal or 'a signal to another rank'} at step {result.preempted}: checkpoint "
            f"{result.checkpoint} written; run the same command again to continue"
        )
    if result.sample:
        console.rule("sample")
        console.print(result.sample, markup=False, highlight=False)


@config_app.command("show")
def config_show(args: list[str] | None = typer.Argument(None, help=ARGS_HELP)) -> None:
    """Print the resolved config as TOML."""
    from flopwise.config.schema import to_toml

    typer.echo(to_toml(_config(args)), nl=False)


@config_app.command("docs")
def config_docs() -> None:
    """Print the config reference (docs/config.md) generated from the config model."""
    from flopwise.config.reference import render

    typer.echo(render(), nl=False)


@app.command()
def presets(as_json: bool = typer.Option(False, "--json", help="print a JSON list")) -> None:
    """List the built-in model presets with their parameter counts."""
    from flopwise.config.presets import PRESETS
    from flopwise.config.schema import ModelConfig
    from flopwise.flops import count_params

    rows: list[dict[str, Any]] = []
    for name in PRESETS:
        m = ModelConfig(preset=name)
        c = count_params(m)
        rows.append(
            {
                "name": name,
                "arch": m.arch,
                "params": c.total,
                "non_embedding_params": c.non_embedding,
                "n_layers": m.n_layers,
                "d_model": m.d_model,
                "n_heads": m.n_heads,
                "n_kv_heads": m.n_kv_heads,
                "ffn_dim": m.ffn_dim,
                "vocab_size": m.vocab_size,
            }
        )
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    table = Table(title="model presets")
    for col in ("name", "arch", "params", "non-emb", "layers", "d_model", "heads", "kv", "ffn", "vocab"):
        table.add_column(col, justify="left" if col in ("name", "arch") else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            r["name"],
            r["arch"],
            _human(r["params"]),
            _human(r["non_embedding_params"]),
            str(r["n_layers"]),
            str(r["d_model"]),
            str(r["n_heads"]),
            str(r["n_kv_heads"]),
            str(r["ffn_dim"]),
            str(r["vocab_size"]),
        )
    console.print(table)


def _duration(days: float) -> str:
    """A duration in the unit that shows it: "3.2 days", "5.1 h", "12 min", "40 s" (a small plan
    printed "0.0 days")."""
    for unit, per_day, fmt in (("days", 1, ".1f"), ("h", 24, ".1f"), ("min", 1440, ".0f")):
        if days * per_day >= 1:
            return f"{days * per_day:{fmt}} {unit}"
    return f"{days * 86400:.0f} s"


def _size(n: float) -> str:
    """Bytes in the decimal unit that shows them: "1.30 TB", "538 MB" (a small plan printed "0.00 TB")."""
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n / 1e3:.3g} kB"


def _human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


@data_app.command("prepare")
def data_prepare(
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
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from flopwise.config.schema import DataConfig, RunConfig
    from flopwise.data.prepare import prepare_data as prepare
    from flopwise.data.shards import skipped_note

    val_fraction = DataConfig.model_fields["val_fraction"].default if val_fraction is None else val_fraction
    seed = RunConfig.model_fields["seed"].default if seed is None else seed
    if tokenizer is not None and train_tokenizer is not None:
        from flopwise.errors import ConfigError

        raise ConfigError(
            f"--tokenizer {tokenizer} and --train-tokenizer {train_tokenizer} conflict: give one "
            "(--tokenizer uses that tokenizer, --train-tokenizer trains a new one)"
        )
    spec = str(tokenizer) if tokenizer else f"bpe:{train_tokenizer or 4096}"
    started = time.perf_counter()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        console=console,
    ) as bar:
        task = bar.add_task("tokenize", total=None, rate="")

        def show(stage: str, done: int, total: int, tokens: int) -> None:
            rate = tokens / max(time.perf_counter() - started, 1e-9)
            bar.update(
                task, description=stage, completed=done, total=total, rate=f"{tokens:,} tokens, {rate:,.0f} tokens/s"
            )

        stats = prepare(
            inputs,
            out,
            tokenizer=spec,
            val_fraction=val_fraction,
            seed=seed,
            force=force,
            workers=workers,
            filters=filters,
            dedup=dedup,
            decontaminate=decontaminate,
            progress=show,
        )
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
        console.print(table)
    console.print(
        f"{stats.documents} documents, {stats.tokens:,} tokens (train {stats.splits['train']:,}, "
        f"val {stats.splits['val']:,}), {stats.bytes:,} bytes in {stats.seconds:.1f} s "
        f"= {stats.tokens_per_s:,.0f} tokens/s -> {out} (report.json)"
    )
    if report.get("skipped"):
        console.print(f"[yellow]skipped[/]: {escape(skipped_note(report['skipped']))} (report.json: skipped)")


@data_app.command("mix")
def data_mix(
    args: list[str] | None = typer.Argument(None, help=ARGS_HELP),
    tokens: float | None = typer.Option(
        None, "--tokens", help="planned training tokens (default: the config's train.steps × global_batch × seq_len)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print a JSON list"),
) -> None:
    """A config's data mixture: tokens per source, and the epochs a planned run takes of each."""
    from flopwise.data.mixture import EPOCH_WARNING, draws
    from flopwise.train.build import ensure_data

    cfg = _config(args)
    planned = tokens if tokens is not None else cfg.train.steps * cfg.train.global_batch * cfg.data.seq_len
    from flopwise.files.ownership import folder_lock

    with folder_lock(cfg.run.dir, "run.dir") as run_dir, log.printing_to(Console(stderr=True)):
        # one writer per folder (its data is prepared there); stdout carries the table or the JSON
        rows = draws(ensure_data(cfg, run_dir), planned)
    if as_json:
        typer.echo(json.dumps([r.__dict__ for r in rows], indent=1))
        return
    table = Table(title=f"data mixture for {_human(planned)} training tokens")
    for col in ("source", "weight", "unique tokens", "documents", "drawn", "epochs", "effective tokens"):
        table.add_column(col, justify="left" if col == "source" else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            r.name,
            f"{r.share:.3f}",
            _human(r.unique_tokens),
            str(r.documents),
            _human(r.drawn_tokens),
            f"{r.epochs:.2f}",
            _human(r.effective_tokens),
        )
    console.print(table)
    console.print(
        f"effective tokens {_human(sum(r.effective_tokens for r in rows))} of {_human(planned)} drawn "
        "(repeats discounted per source, Muennighoff et al. 2023)"
    )
    for r in rows:
        if r.over_repeated:
            console.print(
                f"[yellow]warning[/]: source {r.name!r} is seen {r.epochs:.1f} times (over {EPOCH_WARNING:g} "
                "epochs, repeats add little); lower its weight or add unique data"
            )


@data_app.command("contamination")
def data_contamination(
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
    from flopwise.data.contamination import measure_contamination as measure
    from flopwise.data.tasks import load_task

    if ids_out:
        check_writable(ids_out, "--ids-out")
    report = measure(data, [load_task(t.strip()) for t in tasks.split(",") if t.strip()], n)
    if ids_out:
        write_json(
            ids_out, dict(zip(report.tasks, report.contaminated, strict=True)), "--ids-out", "data contamination"
        )
    if as_json:
        typer.echo(json.dumps(report.rows(), indent=1))
        return
    table = Table(title=f"contamination of tasks by {data} ({n}-grams of normalized words)")
    for col in ("task", "examples", "contaminated", "share"):
        table.add_column(col, justify="left" if col == "task" else "right")
    for r in report.rows():
        table.add_row(r["task"], str(r["examples"]), str(r["contaminated"]), f"{r['share']:.1%}")
    console.print(table)
    console.print(
        f"{len(report.touched):,} of {report.documents:,} training documents contain a task n-gram; "
        f"{report.words:,} words ({report.bytes / 1e6:.1f} MB) scanned in {report.seconds:.1f} s"
    )


@app.command("eval")
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
    from flopwise.data.shards import read_text
    from flopwise.data.tasks import builtin_tasks, load_task
    from flopwise.errors import ConfigError, DataError
    from flopwise.eval.load import load_for_inference
    from flopwise.eval.perplexity import text_loss
    from flopwise.eval.tasks import evaluate_task

    if (text is None) == (tasks is None):
        raise ConfigError(f"give one of --text FILE or --tasks NAMES (built-in: {', '.join(builtin_tasks())})")
    if text is not None and not text.is_file():
        raise DataError(f"--text {text}: no such file")
    if clean_against is not None and tasks is None:
        raise ConfigError("--clean-against needs --tasks: it splits task examples into clean and contaminated")
    loaded = [load_task(t.strip()) for t in tasks.split(",") if t.strip()] if tasks else []
    clean: list[set[int] | None] = [None] * len(loaded)
    if clean_against is not None:
        from flopwise.data.contamination import measure_contamination as measure

        dirty = measure(clean_against, loaded).contaminated
        clean = [set(range(len(ex))) - set(d) for (_, ex), d in zip(loaded, dirty, strict=True)]
    model, cfg, tok = load_for_inference(ckpt, report=_note)
    if text is not None:
        if seq_len is not None and seq_len > cfg.model.max_seq_len:
            raise ConfigError(
                f"--seq-len {seq_len}: beyond the model's context (model.max_seq_len="
                f"{cfg.model.max_seq_len}); give at most that"
            )
        window = seq_len or cfg.model.max_seq_len
        result = {**text_loss(model, tok.encode(read_text(text)).ids, window, batch), "seq_len": window}
        if as_json:
            typer.echo(json.dumps(result))
        else:
            how = "--seq-len" if seq_len else "the model's context, model.max_seq_len; --seq-len to change"
            console.print(
                f"{text}: loss {result['loss']:.4f} nats/token, ppl {result['ppl']:.2f} over "
                f"{result['tokens']:,} tokens, in windows of {window} tokens ({how})",
                highlight=False,
            )
        return
    from rich.progress import Progress

    results = []
    with Progress(console=Console(stderr=True), transient=True) as bar:
        for (name, examples), keep in zip(loaded, clean, strict=True):
            n = min(limit or len(examples), len(examples))
            task = bar.add_task(name, total=sum(len(e.choices or (1,)) for e in examples[:n]))
            results.append(
                evaluate_task(
                    model,
                    tok,
                    name,
                    examples,
                    shots,
                    seed,
                    batch,
                    limit,
                    progress=lambda k, t=task: bar.advance(t, k),
                    clean=keep,
                )
            )
    if as_json:
        typer.echo(json.dumps(results, indent=1))
        return
    table = Table(title=f"{shots}-shot evaluation of {ckpt}")
    extra = ("clean n", "clean acc", "clean acc_norm") if clean_against is not None else ()
    for col in ("task", "n", "acc", "acc_norm", "ppl", *extra):
        table.add_column(col)
    num = lambda x: "–" if x is None else f"{x:.3f}"  # noqa: E731
    for r in results:
        cells = (str(r["clean_n"]), num(r["clean_acc"]), num(r["clean_acc_norm"])) if extra else ()
        table.add_row(r["task"], str(r["n"]), num(r["acc"]), num(r["acc_norm"]), f"{r['ppl']:.2f}", *cells)
    console.print(table)
    if extra:
        console.print(f"[dim]clean: examples sharing no 13-gram of normalized words with {clean_against}[/]")


@app.command(
    "lm-eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False
)
def lm_eval_cmd(ctx: typer.Context) -> None:
    """lm-evaluation-harness with `--model flopwise` registered and the built-in tasks as flopwise_NAME."""
    try:
        from flopwise.eval.harness import run_lm_eval as harness_main
    except ImportError:
        from flopwise.errors import ConfigError

        raise ConfigError("flopwise lm-eval needs lm-eval: pip install 'flopwise[lm-eval]'") from None
    harness_main(list(ctx.args))


@app.command()
def generate(
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
    from flopwise.checkpoints.checkpoint import resolve
    from flopwise.data.tokenizer import special_ids
    from flopwise.eval.generate import generate_tokens as run_generate
    from flopwise.eval.load import load_for_inference

    model, cfg, tok = load_for_inference(ckpt, report=_note)
    ids = tok.encode(prompt).ids
    out = run_generate(
        model,
        ids,
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        seed,
        use_cache=not no_cache,
        stop_id=special_ids(tok, resolve(ckpt))["eos"],
    )  # the model's own end token
    typer.echo(tok.decode(ids + out))
    if len(out) < max_new_tokens and len(ids) + len(out) == cfg.model.max_seq_len:
        Console(stderr=True, soft_wrap=True).print(
            f"[yellow]note[/]: stopped after {len(out)} new tokens at the "
            f"model's context limit (max_seq_len={cfg.model.max_seq_len}, "
            f"the prompt is {len(ids)} tokens)"
        )


@scale_app.command("optimal")
def scale_optimal(
    flops: float | None = typer.Option(None, "--flops", help="training budget in FLOPs"),
    gpu_hours: float | None = typer.Option(None, "--gpu-hours", help="budget in device-hours (with --hardware)"),
    hardware: str = typer.Option("h100-sxm", "--hardware"),
    mfu: float = typer.Option(0.40, "--mfu", min=0.01, max=1.0, help="model FLOP utilisation for --gpu-hours"),
    law: list[str] = typer.Option(
        ["chinchilla-3"], "--law", help="kaplan, chinchilla-1/2/3, epoch, fitted:FILE; repeat to compare"
    ),
    inference_tokens: float = typer.Option(0.0, "--inference-tokens", help="lifetime inference tokens to serve"),
    unique_tokens: str | None = typer.Option(
        None,
        "--unique-tokens",
        help="unique training tokens available: a number, or prepared data dirs (comma-separated) to count",
    ),
    vocab_size: int = typer.Option(32000, "--vocab-size", min=2),
    seq_len: int = typer.Option(4096, "--seq-len", min=1, help="sequence length of the written config"),
    as_json: bool = typer.Option(False, "--json"),
    out_config: Path | None = typer.Option(None, "--out-config", help="write a training TOML for the first law"),
) -> None:
    """Model size, tokens, shape, batch and LR for a compute budget under a scaling law."""
    import math

    from flopwise.errors import ConfigError
    from flopwise.hardware.catalogue import get_hardware
    from flopwise.scale.fit import fitted_law
    from flopwise.scale.laws import allocate

    if out_config:
        check_writable(out_config, "--out-config")

    if (flops is None) == (gpu_hours is None):
        raise ConfigError("give exactly one of --flops or --gpu-hours (with --hardware and --mfu)")
    if gpu_hours is not None:
        if not (math.isfinite(gpu_hours) and gpu_hours > 0):
            raise ConfigError(f"--gpu-hours {gpu_hours:g}: expected a finite number of device-hours > 0")
        hw = get_hardware(hardware, option="--hardware")
        if not (peak := hw.peak_16bit):
            raise ConfigError(
                f"--hardware {hw.name}: no 16-bit dense peak in the catalogue to turn --gpu-hours into "
                "FLOPs; choose an accelerator (e.g. h100-sxm) or give --flops"
            )
        flops = gpu_hours * 3600 * peak * mfu
    assert flops is not None  # given, or made from --gpu-hours (exactly one, checked above)
    unique = None
    if unique_tokens is not None:
        from flopwise.data.mixture import parse_unique_tokens

        unique = parse_unique_tokens(unique_tokens)
    allocs = []
    for name in law:
        allocs.append(allocate(flops, name, inference_tokens, unique, vocab_size, fitted_law(name)))
    if out_config:
        from flopwise.scale.laws import allocation_config

        write_text(out_config, allocation_config(allocs[0], seq_len), "--out-config")
    if as_json:
        rows = [a.to_json() for a in allocs]
        typer.echo(json.dumps(rows[0] if len(rows) == 1 else rows, indent=1))
        return
    table = Table(title=f"compute-optimal allocation for C = {flops:.3g} FLOPs")
    for col in ("law", "N", "D", "D/N", "pred. loss", "shape L×d (heads, ffn)", "batch tok", "lr"):
        table.add_column(col, no_wrap=True)
    for a in allocs:
        s = a.shape
        table.add_row(
            a.law,
            _human(a.params),
            _human(a.tokens),
            f"{a.tokens_per_param:.1f}",
            f"{a.predicted_loss:.3f}",
            f"{s.n_layers}×{s.d_model} ({s.n_heads}, {s.ffn_dim})",
            _human(a.global_batch_tokens),
            f"{a.lr:.2e}",
        )
    console.print(table)
    for a in allocs:
        for note in a.notes:
            console.print(f"[dim]{a.law}: {note}[/]")
    console.print(
        f"[dim]loss predicted by: {', '.join(sorted({a.loss_law for a in allocs}))}; "
        f"batch/LR rule: {allocs[0].batch_rule}[/]"
    )


@scale_app.command("fit")
def scale_fit(
    runs: Path = typer.Argument(..., help="CSV with params,tokens,loss (or params,flops,loss), or a folder of runs"),
    bootstrap: int = typer.Option(200, "--bootstrap", min=0),
    drop_highest: int = typer.Option(0, "--drop-highest", min=0, help="drop the N highest-loss points (Epoch: 5)"),
    plots: Path | None = typer.Option(None, "--plots", help="folder for isoflop.png, fit.png, frontier.png"),
    out: Path | None = typer.Option(None, "--out", help="write the fitted law (JSON) for --law fitted:FILE"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Fit L(N, D) = E + A/N^α + B/D^β (Approach 3, with bootstrap CIs), IsoFLOP parabolas, Kaplan's form."""
    import numpy as np

    from flopwise.errors import FlopwiseError
    from flopwise.scale.fit import (
        PLOT_NAMES,
        fit_approach2,
        fit_approach3,
        fit_kaplan,
        plot_fits,
        read_points,
        save_law,
    )

    for path in ([out] if out else []) + ([plots / n for n in PLOT_NAMES] if plots else []):
        check_writable(path, "--out" if path == out else "--plots")
    pts = read_points(runs)
    if drop_highest:
        pts = pts.subset(np.argsort(pts.loss)[:-drop_highest])
    fit3 = fit_approach3(pts, bootstrap=bootstrap)
    try:
        iso = fit_approach2(pts)
    except FlopwiseError:
        iso = None
    kap = fit_kaplan(pts)
    if out:
        save_law(fit3, out, "--out")
    written = plot_fits(pts, fit3, iso, plots) if plots else []
    result = {**fit3.to_json(), "approach2": iso.to_json() if iso else None, "kaplan": kap.to_json()}
    if as_json:
        typer.echo(json.dumps(result, indent=1))
        return
    table = Table(title=f"Approach 3 fit on {len(pts)} points ({fit3.bootstrap} bootstrap resamples, 95% CI)")
    for col in ("param", "estimate", "95% CI"):
        table.add_column(col)
    for k in ("E", "A", "B", "alpha", "beta", "a"):
        value = result[k]
        ci = fit3.ci.get(k)
        table.add_row(k, f"{value:.4g}", f"[{ci[0]:.4g}, {ci[1]:.4g}]" if ci else "–")
    console.print(table)
    if iso:
        console.print(f"Approach 2 (IsoFLOP): N_opt ∝ C^{iso.a:.3f} over {len(iso.budgets)} budgets")
    console.print(f"Kaplan L(N, D): α_N={kap.alpha_n:.3f} α_D={kap.alpha_d:.3f} N_c={kap.n_c:.3g} D_c={kap.d_c:.3g}")
    for p in written:
        console.print(f"plot: {p}")


@scale_app.command("predict-task")
def scale_predict_task(
    table: Path = typer.Argument(..., help="CSV, one row per (run, task): name,flops,task,acc,nll[,chance]"),
    flops: float = typer.Option(..., "--flops", help="training FLOPs of the run to predict"),
    out: Path = typer.Option(Path("runs/predict-task"), "--out", help="folder for prediction.json and tasks.png"),
    bootstrap: int = typer.Option(1000, "--bootstrap", min=10),
) -> None:
    """Llama 3's two-step task prediction (compute -> correct-answer NLL -> accuracy) and jaggedness flags."""
    from flopwise.scale.tasks import jaggedness, plot_tasks, predict_task, read_task_table

    for name in ("prediction.json", "tasks.png"):
        check_writable(out / name, "--out")
    tasks = read_task_table(table)
    preds = {name: predict_task(p, flops, bootstrap) for name, p in tasks.items()}
    record: dict[str, Any] = {
        "flops": flops,
        "table": str(table),
        "tasks": {n: {**preds[n].to_json(), **jaggedness(tasks[n])} for n in tasks},
    }
    write_json(out / "prediction.json", record, "--out", "scale predict-task")
    png = plot_tasks(tasks, {n: p.law for n, p in preds.items()}, out)
    t = Table(title=f"task prediction at {flops:.3g} FLOPs (both steps fitted on the ladder's own runs)")
    for col in ("task", "NLL", "95% interval", "accuracy", "95% interval", "flags"):
        t.add_column(col)
    for n, p in preds.items():
        flags = ",".join(k for k in ("jump", "inverse") if record["tasks"][n][k]) or "–"
        t.add_row(
            n,
            f"{p.nll:.3f}",
            f"[{p.nll_interval[0]:.3f}, {p.nll_interval[1]:.3f}]",
            f"{p.acc:.3f}",
            f"[{p.acc_interval[0]:.3f}, {p.acc_interval[1]:.3f}]",
            flags,
        )
    console.print(t)
    console.print(f"wrote {out / 'prediction.json'} and {png}")


@scale_app.command("sweep")
def scale_sweep(
    args: list[str] | None = typer.Argument(None, help=ARGS_HELP + " (the base config)"),
    budgets: str = typer.Option("3e12,1e13,3e13", "--budgets", help="comma-separated FLOP budgets"),
    sizes: int = typer.Option(5, "--sizes", min=1, help="model sizes per budget"),
    spread: float = typer.Option(8.0, "--spread", min=1.0, help="largest / smallest size within a budget"),
    law: str = typer.Option("chinchilla-3", "--law", help="law that centres each budget's sizes"),
    out: Path = typer.Option(Path("runs/ladder"), "--out"),
    emit: bool = typer.Option(False, "--emit", help="write configs and print torchrun commands instead of running"),
    nproc: int = typer.Option(1, "--nproc", min=1, help="processes per run in the emitted commands"),
    jobs: int = typer.Option(1, "--jobs", min=1, help="runs trained at once here, sharing the CPU's threads"),
) -> None:
    """An IsoFLOP ladder: configs for K budgets × M sizes, run here (resumable) or emitted for a cluster."""
    from flopwise.train.ladder import budgets_from, launch_commands, plan_ladder, run_ladder, write_configs

    base = _config(args)
    planned = budgets_from(budgets)
    runs = plan_ladder(base, planned, sizes, spread, law, out)
    if len(runs) < len(planned) * sizes:  # printed first: `scale fit` needs enough distinct points
        Console(stderr=True, soft_wrap=True).print(
            f"[yellow]note[/]: {len(runs)} runs, not {len(planned)} budgets × {sizes} sizes: "
            f"{len(planned) * sizes - len(runs)} of them round to a shape already in their budget (small models) "
            "and are trained once; widen --spread for more distinct sizes"
        )
    from flopwise.files.ownership import folder_lock

    with folder_lock(out, "--out"):  # one sweep writes a ladder folder (each run locks its own)
        if emit:
            for cmd in launch_commands(write_configs(runs, out), nproc):
                typer.echo(cmd)
            return
        table = run_ladder(base, runs, out, jobs)
    console.print(f"collected {table}; fit it with: flopwise scale fit {table}")


@checkpoint_app.command("export")
def checkpoint_export(
    path: str = typer.Argument(..., help="a run dir (its newest complete checkpoint) or a step-N folder"),
    out: Path = typer.Option(..., "--out", help="folder to write <out>/checkpoints/step-N into"),
    force: bool = typer.Option(False, "--force", help="replace a checkpoint of the same step in OUT"),
) -> None:
    """Consolidate a checkpoint written by any parallel layout into a one-process checkpoint
    (added beside OUT's checkpoints; none is deleted)."""
    from flopwise.checkpoints.export import export_checkpoint, resume_advice

    dest = export_checkpoint(path, out, force)
    console.print(f"exported {path} -> {dest} (one process; resume with {resume_advice(out, dest)})")


@convert_app.command("from-hf")
def convert_from_hf(
    hf_dir: Path = typer.Argument(..., help="config.json + model*.safetensors (+ tokenizer)"),
    out: Path = typer.Argument(..., help="flopwise run folder to write (checkpoints/step-00000000)"),
    force: bool = typer.Option(False, "--force", help="replace a step-00000000 already in OUT"),
):
    """Import a Hugging Face model as a flopwise checkpoint (usable by eval, generate, train),
    added beside OUT's checkpoints; none is deleted."""
    from flopwise.interop.convert import import_hf

    ckpt = import_hf(hf_dir, out, force)
    console.print(f"wrote {ckpt}")


@convert_app.command("to-hf")
def convert_to_hf(
    ckpt: Path = typer.Argument(..., help="a checkpoint folder or a run folder"),
    out_dir: Path = typer.Argument(..., help="Hugging Face folder to write"),
    max_shard_gb: float = typer.Option(5.0, "--max-shard-gb", min=0.0001),
):
    """Export a flopwise checkpoint to config.json + safetensors + tokenizer files."""
    from flopwise.interop.convert import export_hf

    path = export_hf(ckpt, out_dir, int(max_shard_gb * 2**30))
    console.print(f"wrote {path} (loads with transformers' AutoModelForCausalLM.from_pretrained)")


@app.command("plan")
def plan_cmd(
    args: list[str] | None = typer.Argument(
        None,
        help="[CONFIG] [key=value ...]: model.*, data.seq_len, "
        "train.global_batch, cluster.*, parallel.* (given = fixed), plan.tokens",
    ),
    top: int = typer.Option(5, "--top", min=1, help="layouts to show"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    out_config: Path | None = typer.Option(None, "--out-config", help="write a training TOML of the best layout"),
    plot: Path | None = typer.Option(None, "--plot", help="memory-breakdown bar chart (PNG) of the top layouts"),
    measure: bool = typer.Option(
        False,
        "--measure",
        help="run the config's own layout (parallel.*) for a few steps "
        "under torchrun here and print predicted vs measured per rank (no search)",
    ),
    steps: int = typer.Option(
        3,
        "--steps",
        help="steps to run with --measure (the last is measured, and one more "
        "counts collectives; DDP syncs its bucket order once, in the second); as many more "
        "are timed (the median is reported) and 3 more profiled",
    ),
    nproc: int | None = typer.Option(
        None, "--nproc", min=1, help="processes for --measure (default: the product of the parallel degrees)"
    ),
    hf: Path | None = typer.Option(
        None,
        "--hf",
        help="plan the model of a Hugging Face folder or config.json "
        "(replaces the config's model.*; model.* overrides still apply)",
    ),
    max_mb: bool = typer.Option(
        False,
        "--max-micro-batch",
        help="for the config's own layout (parallel.*, no "
        "search): the largest micro-batch that fits per recompute policy",
    ),
) -> None:
    """Predict memory, step time, MFU, days and GPU-hours of every layout; rank them."""
    from flopwise.config.schema import split_cli_args, to_toml, validate
    from flopwise.data.mixture import draws, prepared_sources
    from flopwise.errors import ConfigError
    from flopwise.hardware.catalogue import busy_note
    from flopwise.plan.planner import max_micro_batch, plan, plan_tree, planned_run_config

    path, overrides = split_cli_args(args)
    if measure and max_mb:
        raise ConfigError("--measure and --max-micro-batch: choose one")
    if measure and hf:
        raise ConfigError(
            "--measure runs a config file, not --hf: write one with `flopwise plan --hf PATH "
            "--out-config FILE`, then run `flopwise plan FILE --measure`"
        )
    if measure:
        from flopwise.measure.step import measure_plan as run_measure

        def say_if_busy() -> None:  # after validation: a refused run gets its one-line error, nothing more
            if note := busy_note("the measured step times"):
                Console(stderr=True, soft_wrap=True).print(f"[yellow]note[/]: {note}")

        measured = run_measure(path, overrides, nproc, steps, on_start=say_if_busy)
        if as_json:
            typer.echo(json.dumps(measured, indent=1))
        else:
            _print_measured(measured)
        return
    for target, option in ((out_config, "--out-config"), (plot, "--plot")):
        if target:
            check_writable(target, option)
    tree = plan_tree(path, overrides, hf)
    cfg = validate(tree)
    if max_mb:
        if out_config or plot:
            raise ConfigError("--max-micro-batch prints a table only: drop --out-config and --plot")
        limits = max_micro_batch(cfg)
        if as_json:
            typer.echo(json.dumps(limits.to_json(), indent=1))
        else:
            _print_max_micro_batch(limits, _model_name(cfg, hf))
        return
    sources = prepared_sources(cfg)
    report = plan(cfg, tree, mixture=(lambda tokens: draws(sources, tokens)) if sources else None, hf=hf)
    best = report.best
    if out_config and best.fits:
        write_text(out_config, to_toml(planned_run_config(report)), "--out-config")
    if plot:
        from flopwise.plan.plot import plot_memory

        plot_memory(
            report.result.ranked[:top],
            plot,
            f"{_model_name(report.cfg, hf)} on {report.cfg.cluster.gpus} × {report.hardware.name}",
        )
    if as_json:
        typer.echo(json.dumps(report.to_json(top), indent=1))
        return
    _print_plan(report, top, _model_name(report.cfg, hf))
    if out_config:
        console.print(
            f"wrote {out_config}: the best layout and train.steps for the planned {_human(report.tokens)} "
            "tokens; data.*, optim.* and run.* as in the config given (check optim.lr and data.path)"
            if best.fits
            else "[red]no layout fits: --out-config not written[/]"
        )
    if plot:
        console.print(f"plot: {plot}")


def _model_name(cfg, hf: Path | None) -> str:
    return f"{hf} ({cfg.model.arch})" if hf else cfg.model.preset or "model"


def _print_plan(report, top: int, name: str) -> None:
    from flopwise.plan.planner import compile_note

    cfg, hw = report.cfg, report.hardware
    console.print(
        f"{escape(name)}: {_human(report.params)} params ({report.params:,}), "
        f"{report.flops_per_token:.3g} FLOPs/token at seq {cfg.data.seq_len}; batch "
        f"{cfg.train.global_batch} seqs; {cfg.cluster.gpus} × {hw.name}; {_human(report.tokens)} tokens "
        f"({'plan.tokens' if cfg.plan.tokens else 'plan.tokens unset: 20 per parameter'}); "
        f"searched {report.result.evaluated} layouts, {report.result.fitting} fit"
    )
    src = report.hf
    if src and src["elements"] is not None:
        same = src["elements"] == report.params
        console.print(
            f"HF weights: {src['tensors']} tensors, {src['elements']:,} elements "
            + (
                "= the parameter count"
                if same
                else f"[yellow]≠ the parameter count ({src['elements'] - report.params:+,}): tensors this model "
                "does not hold (buffers such as attention masks or rotary tables) or a misread config[/]"
            )
        )
    table = Table(title="layouts, best first" if report.best.fits else "NOTHING FITS: smallest first")
    for col in (
        "dp(rep)",
        "zero",
        "tp",
        "pp",
        "cp",
        "schedule",
        "mb",
        "recompute",
        "GiB",
        "step s",
        "tok/s",
        "MFU",
        "HFU",
        "time",
        "GPU-h",
        "why not first",
    ):
        table.add_column(col, no_wrap=col != "why not first")
    for e, why in list(zip(report.result.ranked, report.reasons(), strict=True))[:top]:
        lo = e.layout
        j = e.to_json(report.tokens, cfg.cluster.gpus)
        sched = (lo.pp_schedule + (f"×{lo.virtual_stages}" if lo.virtual_stages > 1 else "")) if lo.pp > 1 else "–"
        table.add_row(
            f"{lo.dp}({lo.dp_replicate})",
            str(lo.zero),
            str(lo.tp) + ("sp" if lo.sequence_parallel else ""),
            str(lo.pp),
            str(lo.cp),
            sched,
            str(lo.micro_batch),
            lo.recompute + ({"rowwise": " +fp8r", "tensorwise": " +fp8t"}.get(e.float8, "")),
            f"{e.memory['total'] / 2**30:.1f}",
            f"{e.step_time:.3g}",
            _human(e.tokens_per_s),
            f"{e.mfu:.1%}",
            f"{e.hfu:.1%}",
            _duration(j["train_days"]),
            _human(j["gpu_hours"]),
            why,
        )
    console.print(table)
    if note := report.float8_note():
        console.print(note)
    b = report.best
    console.print("time of the best step: " + ", ".join(f"{k} {v:.3g} s" for k, v in b.time.items() if v))
    console.print(compile_note(cfg, report.tokens, b.layout), highlight=False)
    if hw.extra.get("uncalibrated"):
        console.print(f"[yellow]uncalibrated[/]: {escape(hw.source)}", highlight=False)
    r = report.reliability
    if r:
        days = b.to_json(report.tokens, cfg.cluster.gpus)["train_days"]
        console.print(
            f"checkpoint {_size(r.checkpoint_bytes)}, write {r.write_s:.3g} s, restart {r.restart_s:.3g} s; cluster "
            f"MTBF {r.cluster_mtbf_h:.2f} h; Young/Daly interval {r.interval_daly_s / 60:.0f} min; expected "
            f"goodput {r.goodput:.1%}, {r.failures_expected:.0f} failures over the run: "
            f"{_duration(r.wall_days)} of wall-clock with them ({_duration(days)} without)"
        )
        console.print(f"[dim]failure rate: {escape(r.failure_source)}[/]", highlight=False)
        console.print(f"[dim]write time: {escape(r.write_source)}[/]", highlight=False)
        console.print(f"[dim]restart time: {escape(r.restart_source)}[/]", highlight=False)
    for d in report.data or []:
        warn = " [yellow](over 4 epochs: repeats add little)[/]" if d.over_repeated else ""
        console.print(
            f"data {d.name}: {_human(d.unique_tokens)} unique tokens, {d.share:.0%} of the run = "
            f"{d.epochs:.2f} epochs, {_human(d.effective_tokens)} effective{warn}"
        )
    console.print(f"[dim]stack: {cfg.plan.stack}; memory keeps a {0.1:.0%} fit margin and a 1 GiB runtime reserve[/]")


def _print_max_micro_batch(r, name: str) -> None:
    """The largest micro-batch per recompute policy, the next valid one and why it is refused."""
    lo, gib = r.layout, 2**30
    table = Table(
        title=f"largest micro-batch that fits: {escape(name)}, {lo.name()} on {lo.world} × "
        f"{r.hardware.name} ({r.usable_memory / gib:.1f} GiB usable), global batch "
        f"{r.cfg.train.global_batch}, seq {r.cfg.data.seq_len}"
    )
    for col in ("recompute", "max mb", "GiB", "next mb", "GiB ", "past the batch"):
        table.add_column(col, justify="left" if col == "recompute" else "right")
    for lim in r.limits:
        beyond = "–"
        if lim.beyond:
            mb, gb = lim.beyond
            beyond = f"{'≥ ' if lim.beyond_capped else ''}{mb} (batch {gb})"
        elif lim.micro_batch is not None and lim.next_micro_batch is None:
            beyond = f"{lim.micro_batch} (no larger one fits)"
        table.add_row(
            lim.recompute,
            str(lim.micro_batch) if lim.micro_batch else "[red]none fits[/]",
            f"{lim.memory / gib:.2f}" if lim.memory else "–",
            str(lim.next_micro_batch) if lim.next_micro_batch else "– (batch limit)",
            f"{lim.next_memory / gib:.2f}" if lim.next_memory else "–",
            beyond,
        )
    console.print(table)
    a = r.to_json()["assumptions"]
    console.print(
        f"[dim]valid micro-batches: {', '.join(map(str, r.valid))} (they divide the per-rank batch "
        f"{r.cfg.train.global_batch // lo.dp} and keep the pipeline's rules); GiB: the search's per-device "
        f"total (worst rank, {a['runtime_reserve_bytes'] / gib:g} GiB runtime reserve included) against "
        f"{1 - a['fit_margin']:.0%} of memory; past the batch: when every valid one fits, the largest "
        "that would with train.global_batch raised (same micro-batches per step)[/]"
    )


def _print_measured(r: dict) -> None:
    """Per rank, predicted beside measured: model-state and activation bytes, collective elements
    and seconds per step; then the step's components."""
    from flopwise.measure.step import QUANTITIES

    def row(table: Table, rank: str | None, name: str, v: dict, fmt: str, last: bool = False) -> None:
        """One quantity; `rank` None: a table without the rank column."""
        ratio = f"{v['measured'] / v['predicted']:.3f}" if v["predicted"] else "–"
        cells = [
            name,
            "–" if v["predicted"] is None else format(v["predicted"], fmt),
            format(v["measured"], fmt),
            ratio,
        ]
        table.add_row(*([] if rank is None else [rank]), *cells, end_section=last)

    table = Table(
        title=f"{r['layout']} on {r['world']} local processes: planner vs engine "
        f"(last of {r['steps']} steps, {r['dtype']})"
    )
    for col in ("rank", "quantity", "predicted", "measured", "measured/predicted"):
        table.add_column(col, justify="left" if col == "quantity" else "right")
    for rank in r["ranks"]:
        rows = [
            (f"{q} bytes", rank[q], ",.0f")
            for q in QUANTITIES
            if q not in ("gathered", "fsdp_copies") or rank[q]["predicted"] or rank[q]["measured"]
        ]
        rows += [(f"{k} elements", v, ",.0f") for k, v in rank["collectives"].items()]
        rows += [
            (
                "step time s",
                {"predicted": r["step_time_s"]["predicted"], "measured": rank["step_time_s"]["measured"]},
                ".4g",
            )
        ]
        for i, (name, v, fmt) in enumerate(rows):
            row(table, str(rank["rank"]) if i == 0 else "", name, v, fmt, i == len(rows) - 1)
        if rank["layers"]["predicted"] != rank["layers"]["measured"]:
            console.print(
                f"[red]rank {rank['rank']}: planner's layers {rank['layers']['predicted']}, engine's "
                f"{rank['layers']['measured']}[/]"
            )
    console.print(table)
    console.print(
        "[dim]params at rest, grads as the optimizer steps, optimizer: AdamW moments; activations: peak "
        "saved for backward (the planner's: this engine's, eager or compiled as the run is); gathered: "
        "FSDP2's all-gathered parameters then; peak: the step's high-water mark above the resident states; "
        "fsdp_copies: what FSDP2's copy kernels read and write around its collectives in a step; "
        "collectives: elements per step by kind, single-element ones (loss, norm, flags) left out; step "
        "time: the median of the timed steps[/]"
    )
    parts = Table(title=f"step time s by component: rank {r['components_rank']}'s profiled step (torch.profiler)")
    for col in ("component", "predicted", "measured", "measured/predicted"):
        parts.add_column(col, justify="left" if col == "component" else "right")
    items = list(r["step_time_components_s"].items())
    for i, (name, v) in enumerate(items):
        row(parts, None, name.replace("_", " "), v, ".4g", i == len(items) - 1)
    row(parts, None, "step (median, slowest rank)", r["step_time_s"], ".4g")
    console.print(parts)
    console.print(f"[dim]{r['step_time_note']}[/]")


@hardware_app.command("calibrate")
def hardware_calibrate(
    args: list[str] | None = typer.Argument(
        None,
        help="[CONFIG] [key=value ...]: the model whose GEMM and attention "
        "shapes are measured, and train.dtype (default: demo)",
    ),
    out: Path = typer.Option(
        Path("hardware.toml"),
        "--out",
        help="hardware TOML to write (an entry in a file flopwise wrote before is replaced, the others kept)",
    ),
    nproc: int | None = typer.Option(
        None,
        "--nproc",
        min=1,
        help="local ranks for the collectives (default: 2 on a CPU, every GPU on CUDA; 1 skips them)",
    ),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto"),
) -> None:
    """Measure GEMMs, attention, element-wise bandwidth, the optimizer step and collectives here;
    write a hardware entry that `cluster.hardware_file=FILE` makes the planner use."""
    import torch
    from rich.progress import Progress

    from flopwise.config.schema import split_cli_args
    from flopwise.hardware.catalogue import busy_note
    from flopwise.measure.calibrate import calibrate_device as calibrate
    from flopwise.measure.calibrate import calibration_config, require_bf16_device
    from flopwise.measure.calibrate import save_hardware as save

    check_writable(out, "--out")
    if device not in ("auto", "cpu", "cuda"):
        raise FlopwiseError(f"--device {device}: choose cpu, cuda or auto")
    if device == "cuda" and not torch.cuda.is_available():
        raise FlopwiseError("--device cuda: no CUDA device here; use --device cpu")
    dev = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    ranks = nproc or (torch.cuda.device_count() if dev.type == "cuda" else 2)
    path, overrides = split_cli_args(args)
    cfg = calibration_config(path or DEFAULT_CONFIG, overrides)
    require_bf16_device(dev)  # before the busy note: nothing to measure here
    if note := busy_note("the tables measured now (and every plan made from them)"):
        Console(stderr=True, soft_wrap=True).print(f"[yellow]note[/]: {note}")
    started = time.perf_counter()
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("calibrating", total=None)  # known once the peak that sizes the work is measured
        hw = calibrate(
            cfg,
            dev,
            ranks,
            lambda what: bar.update(task, advance=1, description=what),
            lambda n: bar.update(task, total=n),
        )
    save(hw, out)
    c = hw.calibration
    assert c is not None  # calibrate() measured it
    effs = [r[3] for r in c.gemm]
    console.print(
        f"{hw.name}: {hw.peak_flops[c.dtype] / 1e12:.3g} TFLOP/s {c.dtype} peak; {len(c.gemm)} GEMMs at "
        f"{min(effs):.0%}-{max(effs):.0%} of it; attention {len(c.attention)} shapes; element-wise "
        f"{min(r[2] for r in c.elementwise) / 1e9:.3g}-{max(r[2] for r in c.elementwise) / 1e9:.3g} GB/s; "
        f"{len(c.collectives)} collectives over {hw.devices_per_node} ranks; "
        f"{time.perf_counter() - started:.0f} s"
    )
    if r := hw.recovery:
        console.print(
            f"checkpoint write {r.write_latency_s:.3g} s + {r.write_bytes_per_s / 1e9:.3g} GB/s; restart "
            f"{r.restart_fixed_s:.3g} s + a read at {r.read_bytes_per_s / 1e9:.3g} GB/s (one process; the planner's "
            "write and restart times unless cluster.storage_gbps_per_gpu or cluster.restart_minutes is set)"
        )
    console.print(f"wrote {out}: plan with cluster.hardware={hw.name} cluster.hardware_file={out}")


@app.command("audit")
def audit_cmd(
    claim: list[str] | None = typer.Argument(
        None,
        help="key=value claim (preset or params, tokens, hardware, "
        "devices, days | device_hours | tokens_per_s_per_device, seq_len, "
        "batch_tokens); or one catalogue entry's name (e.g. llama3-405b); "
        "none: the whole bundled catalogue",
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Check published (or your) training claims: FLOPs, implied MFU, planner's best MFU, verdict."""
    from flopwise.plan.audit import audit_claims as audit
    from flopwise.plan.audit import catalogue, parse_claim

    claims = [parse_claim(claim)] if claim else list(catalogue().values())
    verdicts = audit(claims)
    if as_json:
        typer.echo(json.dumps([v.to_json() for v in verdicts], indent=1))
        return
    table = Table(title="training claims audited (FLOPs: flopwise convention)")
    for col in ("run", "params", "tokens", "FLOPs", "implied MFU", "basis", "planner best", "verdict", "status"):
        table.add_column(col, no_wrap=col not in ("basis", "verdict"))
    for v in verdicts:
        table.add_row(
            v.name,
            _human(v.params),
            _human(v.tokens) if v.tokens else "?",
            f"{v.flops:.3g}" if v.flops else "?",
            f"{v.implied_mfu:.1%}" if v.implied_mfu is not None else "?",
            v.basis or "–",
            f"{v.predicted_mfu:.1%}" if v.predicted_mfu else "–",
            v.verdict + (f" (missing: {', '.join(v.missing)})" if v.missing else ""),
            v.status,
        )
    console.print(table)
    for v in verdicts:
        for note in v.notes:
            console.print(f"[dim]{v.name}: {note}[/]")
    console.print(
        "[dim]status: V read in the paper, V2 secondary copy, U recalled (re-check). Wall-clock bases "
        "include downtime, so implied MFU below the planner's is expected.[/]"
    )


# paths no command can use, whatever it does with them: the OS's reason and the fix
BAD_PATHS = {
    errno.ENAMETOOLONG: "choose a shorter name (at most 255 bytes per part of a path)",
    errno.ELOOP: "a symbolic link there points back round to itself: fix or remove the link",
}


def _note(message: str) -> None:
    """A one-line note on stderr (stdout stays the command's output)."""
    Console(stderr=True, soft_wrap=True).print(f"[yellow]note[/]: {escape(message)}", markup=True, highlight=False)


def _refuse(message: str) -> NoReturn:
    """The one-line error of a refused command, printed as every error is (stderr, after its rank in a job)."""
    logger.error(f"[red]error:[/] {escape(message)}", extra={"highlighter": None})
    sys.exit(2)


def main() -> None:
    log.setup(console=console)  # the options (app's callback) set it up again, at their level
    try:
        app()
    except FlopwiseError as e:
        if getattr(e, "quiet", False):  # already said, by the rank that saw it
            sys.exit(2)
        _refuse(str(e))
    except OSError as e:  # a path the OS refused that no command turned into its option's error: still one line
        from flopwise.files.outputs import UNWRITABLE

        where = f"{e.filename or 'a path'}: {e.strerror or type(e).__name__}"
        if e.errno in BAD_PATHS:
            _refuse(f"{where}; {BAD_PATHS[e.errno]}")
        if e.errno not in UNWRITABLE:
            raise
        _refuse(f"{where}; choose a path you can write, fix its permissions or free space there")
    except RuntimeError as e:  # pathlib's resolve() of a symlink loop before Python 3.13 (then OSError ELOOP)
        if not str(e).startswith("Symlink loop from "):
            raise
        _refuse(f"{str(e).removeprefix('Symlink loop from ').strip(chr(39))}: {BAD_PATHS[errno.ELOOP]}")
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        dist = sys.modules.get("torch.distributed")  # never import torch just for this (plan stays fast)
        if dist is not None and dist.is_initialized():  # a torchrun rank: leave the group cleanly
            dist.destroy_process_group()
