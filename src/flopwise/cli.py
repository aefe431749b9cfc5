"""The `flopwise` command line: parse, validate, call a library function, print. No logic here."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from flopwise.errors import FlopwiseError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan, train and audit compute-optimal dense LLMs.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect the resolved config.")
data_app = typer.Typer(no_args_is_help=True, help="Prepare token shards.")
app.add_typer(config_app, name="config")
app.add_typer(data_app, name="data")
console = Console()

DEFAULT_CONFIG = "demo"
ARGS_HELP = "[CONFIG] [key=value ...]: a TOML file or built-in name (default: demo), then overrides"


def _config(args: list[str] | None):
    from flopwise.config import load_config, split_cli_args

    path, overrides = split_cli_args(args)
    return load_config(path or DEFAULT_CONFIG, overrides)


@app.command()
def train(args: Optional[list[str]] = typer.Argument(None, help=ARGS_HELP)) -> None:
    """Train a model (default: a small GPT on the embedded Shakespeare corpus)."""
    from flopwise.train.trainer import summary_table, train as run_training

    result = run_training(_config(args), console)
    console.print(summary_table(result))
    if result.sample:
        console.rule("sample")
        console.print(result.sample, markup=False, highlight=False)


@config_app.command("show")
def config_show(args: Optional[list[str]] = typer.Argument(None, help=ARGS_HELP)) -> None:
    """Print the resolved config as TOML."""
    from flopwise.config import to_toml

    typer.echo(to_toml(_config(args)), nl=False)


@app.command()
def presets(as_json: bool = typer.Option(False, "--json", help="print a JSON list")) -> None:
    """List the built-in model presets with their parameter counts."""
    from flopwise.config import ModelConfig
    from flopwise.flops import count_params
    from flopwise.model.presets import PRESETS

    rows = []
    for name in PRESETS:
        m = ModelConfig(preset=name)
        c = count_params(m)
        rows.append({"name": name, "arch": m.arch, "params": c.total, "non_embedding_params": c.non_embedding,
                     "n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
                     "ffn_dim": m.ffn_dim, "vocab_size": m.vocab_size})
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    table = Table(title="model presets")
    for col in ("name", "arch", "params", "non-emb", "layers", "d_model", "heads", "kv", "ffn", "vocab"):
        table.add_column(col, justify="left" if col in ("name", "arch") else "right", no_wrap=True)
    for r in rows:
        table.add_row(r["name"], r["arch"], _human(r["params"]), _human(r["non_embedding_params"]), str(r["n_layers"]),
                      str(r["d_model"]), str(r["n_heads"]), str(r["n_kv_heads"]), str(r["ffn_dim"]), str(r["vocab_size"]))
    console.print(table)


def _human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


@data_app.command("prepare")
def data_prepare(
    inputs: list[str] = typer.Argument(..., help="text files, folders, .jsonl (text field), .parquet, or builtin:NAME"),
    out: Path = typer.Option(..., "--out", help="output folder"),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="an existing tokenizer.json"),
    train_tokenizer: int = typer.Option(4096, "--train-tokenizer", help="train a byte-level BPE of this vocab size"),
    val_fraction: float = typer.Option(0.05, "--val-fraction", min=0.0, max=0.99),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Tokenize text into token shards with an index and a train/val split by document."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from flopwise.data.shards import prepare

    spec = str(tokenizer) if tokenizer else f"bpe:{train_tokenizer}"
    with Progress(BarColumn(), DownloadColumn(), TransferSpeedColumn(), console=console) as bar:
        task = bar.add_task("tokenize", total=None)
        stats = prepare(inputs, out, tokenizer=spec, val_fraction=val_fraction, seed=seed,
                        progress=lambda done, total: bar.update(task, completed=done, total=total))
    console.print(f"{stats.documents} documents, {stats.tokens:,} tokens (train {stats.splits['train']:,}, "
                  f"val {stats.splits['val']:,}), {stats.bytes:,} bytes in {stats.seconds:.1f} s "
                  f"= {stats.tokens_per_s:,.0f} tokens/s -> {out}")


@app.command("eval")
def eval_cmd(
    ckpt: Path = typer.Argument(..., help="a checkpoint folder or a run folder (its newest checkpoint)"),
    text: Path = typer.Option(..., "--text", help="a UTF-8 text file to score"),
    as_json: bool = typer.Option(False, "--json"),
    batch: int = typer.Option(8, "--batch", min=1),
) -> None:
    """Mean loss per token and perplexity on a text file."""
    from flopwise.data.shards import _read_text
    from flopwise.errors import DataError
    from flopwise.eval.perplexity import text_loss
    from flopwise.train.trainer import load_for_inference

    if not text.is_file():
        raise DataError(f"--text {text}: no such file")
    model, cfg, tok = load_for_inference(ckpt)
    ids = tok.encode(_read_text(text)).ids
    result = text_loss(model, ids, cfg.data.seq_len, batch)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        console.print(f"{text}: loss {result['loss']:.4f} nats/token, ppl {result['ppl']:.2f} over "
                      f"{result['tokens']:,} tokens")


@app.command()
def generate(
    ckpt: Path = typer.Argument(..., help="a checkpoint folder or a run folder"),
    prompt: str = typer.Option(..., "--prompt"),
    max_new_tokens: int = typer.Option(100, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.8, "--temperature", min=0.0, help="0 = greedy"),
    top_k: Optional[int] = typer.Option(None, "--top-k", min=1),
    top_p: Optional[float] = typer.Option(None, "--top-p", min=0.0, max=1.0),
    seed: int = typer.Option(0, "--seed"),
    no_cache: bool = typer.Option(False, "--no-cache", help="recompute the full context each token"),
) -> None:
    """Sample a continuation of a prompt with a KV cache."""
    from flopwise.data.tokenizer import eos_id
    from flopwise.eval.generate import generate as run_generate
    from flopwise.train.trainer import load_for_inference

    model, cfg, tok = load_for_inference(ckpt)
    ids = tok.encode(prompt).ids
    out = run_generate(model, ids, max_new_tokens, temperature, top_k, top_p, seed, use_cache=not no_cache,
                       stop_id=eos_id(tok))
    typer.echo(tok.decode(ids + out))


def main() -> None:
    try:
        app()
    except FlopwiseError as e:
        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/] {e}", markup=True, highlight=False)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
