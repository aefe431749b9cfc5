"""`flopwise config show|check|docs` and `flopwise presets`: the resolved config, its reference, the presets."""

from __future__ import annotations

import json

import typer

from flopwise.cli.common import ARGS_HELP, config_from, stdout
from flopwise.cli.render import human, new_table

app = typer.Typer(no_args_is_help=True, help="Inspect the resolved config.")


@app.command("show")
def show_cmd(args: list[str] | None = typer.Argument(None, help=ARGS_HELP)) -> None:
    """Print the resolved config as TOML."""
    from flopwise.config.schema import to_toml

    typer.echo(to_toml(config_from(args)), nl=False)


@app.command("check")
def check_cmd(
    args: list[str] | None = typer.Argument(None, help=ARGS_HELP),
    world: int = typer.Option(1, "--world", min=1, help="processes the job starts: its layout is checked for them"),
) -> None:
    """Validate a config and its layout on --world processes without torch: exit 2 and one line
    if not. Run once before a job's ranks start (examples/train.sbatch): a config error fails every
    rank alike, and a launcher that restarts failed ranks would only repeat it."""
    from flopwise.layout.rules import layout_of

    cfg = config_from(args)
    lo = layout_of(cfg, world)
    stdout.print(f"config ok: {cfg.model.preset or 'custom model'}, layout {lo.name()} on {world} process(es)")


@app.command("docs")
def docs_cmd() -> None:
    """Print the config reference (docs/config.md) generated from the config model."""
    from flopwise.config.reference import render

    typer.echo(render(), nl=False)


def presets_cmd(as_json: bool = typer.Option(False, "--json", help="print a JSON list")) -> None:
    """List the built-in model presets with their parameter counts."""
    from flopwise.flops import preset_table

    rows = preset_table()
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    columns = ("name", "arch", "params", "non-emb", "layers", "d_model", "heads", "kv", "ffn", "vocab")
    t = new_table("model presets", columns, left=("name", "arch"), no_wrap=True)
    for r in rows:
        counts = (r["n_layers"], r["d_model"], r["n_heads"], r["n_kv_heads"], r["ffn_dim"], r["vocab_size"])
        t.add_row(r["name"], r["arch"], human(r["params"]), human(r["non_embedding_params"]), *map(str, counts))
    stdout.print(t)
