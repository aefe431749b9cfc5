"""`flopwise plan`: every layout ranked (the default, `plan search`), the config's own layout
measured here (`plan measure`), its largest micro-batch (`plan max-micro-batch`), the cost of
serving the model (`plan serve`)."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import typer
from rich.markup import escape
from typer.core import TyperGroup

from flopwise.cli.common import note, note_if_busy, stdout
from flopwise.cli.render import (
    human,
    print_max_micro_batch,
    print_measured,
    print_plan,
    print_rehearsal,
    print_serve,
    print_serve_measured,
)
from flopwise.errors import ConfigError

DEFAULT = "search"
OLD_FLAGS = {"--measure": "measure", "--max-micro-batch": "max-micro-batch"}  # flags until the next release
REHEARSE = "--rehearse"  # `plan KEY=VALUE... --rehearse` is `plan rehearse KEY=VALUE...`
ARGS_HELP = escape("[CONFIG] [key=value ...]: model.*, data.seq_len, train.global_batch, cluster.*, parallel.*")


def route(args: list[str], commands: Collection[str]) -> list[str]:
    """`args` with their subcommand first: `plan KEY=VALUE...` is `plan search KEY=VALUE...`, and
    an old flag (`plan --measure ...`) is its subcommand, with a note; after a subcommand a flag is
    that subcommand's own (`plan serve --measure`)."""
    if args and (args[0] in commands or args[0] == "--help"):
        return args
    old = [flag for flag in OLD_FLAGS if flag in args]
    if len(old) > 1:
        raise ConfigError("--measure and --max-micro-batch: choose one")
    if REHEARSE in args:
        if old:
            raise ConfigError(f"{old[0]} and --rehearse: choose one")
        return ["rehearse", *(a for a in args if a != REHEARSE)]
    if old:
        flag, command = old[0], OLD_FLAGS[old[0]]
        note(f"`plan {flag}` is now `plan {command}`; the flag goes in the next release")
        return [command, *(a for a in args if a != flag)]
    return [DEFAULT, *args]


class PlanGroup(TyperGroup):
    """A group whose arguments, without a subcommand first, go to its default one."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:  # ctx: typer's own click Context
        return super().parse_args(ctx, route(args, self.commands))


app = typer.Typer(
    cls=PlanGroup,
    help="Predict memory, step time, MFU, days and GPU-hours of every layout; rank them "
    "(`flopwise plan CONFIG KEY=VALUE...` is `plan search`); measure a layout here; find its largest micro-batch; "
    "price serving it.",
)


@app.command(DEFAULT)
def search_cmd(
    args: list[str] | None = typer.Argument(None, help=ARGS_HELP + " (given = fixed), plan.tokens"),
    top: int = typer.Option(5, "--top", min=1, help="layouts to show"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    out_config: Path | None = typer.Option(None, "--out-config", help="write a training TOML of the best layout"),
    plot: Path | None = typer.Option(None, "--plot", help="memory-breakdown bar chart (PNG) of the top layouts"),
    hf: Path | None = typer.Option(
        None,
        "--hf",
        help="plan the model of a Hugging Face folder or config.json "
        "(replaces the config's model.*; model.* overrides still apply)",
    ),
) -> None:
    """Predict memory, step time, MFU, days and GPU-hours of every layout; rank them (the default)."""
    from flopwise.config.schema import split_cli_args
    from flopwise.data.mixture import mixture_of
    from flopwise.plan.planner import make_plan, model_name

    path, overrides = split_cli_args(args)
    planned = make_plan(path, overrides, hf, top, out_config, plot, mixture_of)
    report = planned.report
    if as_json:
        typer.echo(json.dumps(report.to_json(top), indent=1))
        return
    print_plan(report, top, model_name(report.cfg, hf))
    if out_config:
        stdout.print(
            f"wrote {out_config}: the best layout and train.steps for the planned {human(report.tokens)} "
            "tokens; data.*, optim.* and run.* as in the config given (check optim.lr and data.path)"
            if planned.out_config
            else "[red]no layout fits: --out-config not written[/]"
        )
    if plot:
        stdout.print(f"plot: {plot}")


@app.command("measure")
def measure_cmd(
    args: list[str] | None = typer.Argument(
        None, help="[CONFIG] [key=value ...]: the config whose layout (parallel.*) runs here"
    ),
    steps: int = typer.Option(
        3,
        "--steps",
        help="steps to run (the last is measured, and one more counts collectives; DDP syncs its bucket "
        "order once, in the second); as many more are timed (the median is reported) and 3 more profiled",
    ),
    nproc: int | None = typer.Option(
        None, "--nproc", min=1, help="processes (default: the product of the parallel degrees)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Run the config's own layout (parallel.*) a few steps under torchrun here: predicted vs measured per rank.

    No search: the layout is the one the config gives."""
    from flopwise.config.schema import split_cli_args
    from flopwise.measure.step import measure_plan

    path, overrides = split_cli_args(args)
    measured = measure_plan(path, overrides, nproc, steps, on_start=lambda: note_if_busy("the measured step times"))
    if as_json:
        typer.echo(json.dumps(measured, indent=1))
    else:
        print_measured(measured)


@app.command("rehearse")
def rehearse_cmd(
    args: list[str] | None = typer.Argument(
        None, help="[CONFIG] [key=value ...]: the config whose layout (parallel.*) is rehearsed at its full size"
    ),
    ranks: list[int] | None = typer.Option(
        None, "--rank", help="rehearse this rank (repeat; default: the first, a middle and the last pipeline stage)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Rehearse the config's layout at its full world on this CPU: each distinct rank built as `train`
    builds it and stepped once on fake tensors, its bytes beside the planner's (`plan KEY=VALUE... --rehearse`)."""
    from flopwise.config.schema import split_cli_args
    from flopwise.measure.rehearse import rehearse_plan

    path, overrides = split_cli_args(args)
    report = rehearse_plan(path, overrides, ranks or None)
    if as_json:
        typer.echo(json.dumps(report, indent=1))
    else:
        print_rehearsal(report)


@app.command("max-micro-batch")
def max_micro_batch_cmd(
    args: list[str] | None = typer.Argument(
        None, help="[CONFIG] [key=value ...]: the config whose layout (parallel.*) is filled"
    ),
    hf: Path | None = typer.Option(
        None, "--hf", help="the model of a Hugging Face folder or config.json (replaces the config's model.*)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """The largest micro-batch that fits the config's own layout (parallel.*, no search), per recompute policy."""
    from flopwise.config.schema import split_cli_args
    from flopwise.plan.planner import micro_batch_limits, model_name

    path, overrides = split_cli_args(args)
    limits = micro_batch_limits(path, overrides, hf)
    if as_json:
        typer.echo(json.dumps(limits.to_json(), indent=1))
    else:
        print_max_micro_batch(limits, model_name(limits.cfg, hf))


@app.command("serve")
def serve_cmd(
    args: list[str] | None = typer.Argument(
        None, help="[CONFIG] [key=value ...]: model.*, cluster.* (gpus, hardware, price_per_gpu_hour), serve.*"
    ),
    top: int = typer.Option(5, "--top", min=1, help="layouts to show"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    hf: Path | None = typer.Option(
        None, "--hf", help="the model of a Hugging Face folder or config.json (replaces the config's model.*)"
    ),
    measure: bool = typer.Option(
        False,
        "--measure",
        help="generate the planned workload here (one device, serve.batch) and time it beside the plan",
    ),
) -> None:
    """Serving cost per tensor/pipeline layout: memory, largest batch, prefill, decode and its bound, tokens/s, cost."""
    from flopwise.config.schema import split_cli_args, validate
    from flopwise.plan.planner import model_name, plan_tree
    from flopwise.plan.serve import plan_serve

    path, overrides = split_cli_args(args)
    planned = plan_serve(validate(plan_tree(path, overrides, hf)))
    measured = None
    if measure:
        from flopwise.measure.serve import measure_serve

        note_if_busy("the measured prefill and decode times")
        measured = measure_serve(planned.cfg, planned.hardware, planned.layouts[0])
    if as_json:
        typer.echo(json.dumps({**planned.to_json(top), **({"measured": measured} if measured else {})}, indent=1))
        return
    print_serve(planned, top, model_name(planned.cfg, hf))
    if measured:
        print_serve_measured(planned.layouts[0], measured)
