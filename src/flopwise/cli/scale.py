"""`flopwise scale optimal|fit|predict-task|sweep`: budgets allocated, laws fitted, ladders run."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.markup import escape

from flopwise.cli.common import ARGS_HELP, config_from, note, stdout
from flopwise.cli.render import human, new_table, serve_regime

app = typer.Typer(no_args_is_help=True, help="Compute-optimal allocation, scaling-law fits, IsoFLOP ladders.")


@app.command("optimal")
def optimal_cmd(
    serving: list[str] | None = typer.Argument(
        None,
        help="the serving regime --inference-tokens is priced in: serve.KEY=VALUE, cluster.gpus=G "
        "(default: one node of --hardware), cluster.price_per_gpu_hour=P",
    ),
    flops: float | None = typer.Option(None, "--flops", help="training budget in FLOPs"),
    gpu_hours: float | None = typer.Option(None, "--gpu-hours", help="budget in device-hours (with --hardware)"),
    hardware: str = typer.Option(
        "h100-sxm", "--hardware", help="device of --gpu-hours, --inference-tokens and the --out-config run"
    ),
    mfu: float = typer.Option(
        0.40, "--mfu", min=0.01, max=1.0, help="training's model FLOP utilisation (--gpu-hours, --inference-tokens)"
    ),
    law: list[str] = typer.Option(
        ["chinchilla-3"], "--law", help="kaplan, chinchilla-1/2/3, epoch, cpu-tiny, fitted:FILE; repeat to compare"
    ),
    inference_tokens: list[float] = typer.Option(
        [],
        "--inference-tokens",
        help="lifetime tokens to serve, priced by the serving plan on --hardware; repeat to compare (0: none)",
    ),
    unique_tokens: str | None = typer.Option(
        None,
        "--unique-tokens",
        help="unique training tokens available: a number, or prepared data dirs (comma-separated) to count",
    ),
    vocab_size: int = typer.Option(32000, "--vocab-size", min=2),
    seq_len: int = typer.Option(4096, "--seq-len", min=1, help="sequence length of the written config"),
    as_json: bool = typer.Option(False, "--json"),
    out_config: Path | None = typer.Option(
        None,
        "--out-config",
        help="write a training TOML for the first law: its shape, plan.tokens, --gpus × --hardware, "
        "the layout left to `flopwise plan FILE`",
    ),
    gpus: int | None = typer.Option(
        None,
        "--gpus",
        min=1,
        help="devices the --out-config run plans for (default: the fewest power-of-two nodes that hold "
        "the model and train it in 30 days at --mfu)",
    ),
) -> None:
    """Model size, tokens, shape, batch and LR for a compute budget under a scaling law."""
    from flopwise.data.mixture import parse_unique_tokens
    from flopwise.scale.optimal import optimal_allocations

    unique = parse_unique_tokens(unique_tokens) if unique_tokens is not None else None
    budget = optimal_allocations(
        flops, gpu_hours, hardware, mfu, law, inference_tokens, unique, vocab_size, seq_len, out_config, serving, gpus
    )
    if budget.lifetimes:
        _print_lifetimes(budget, as_json)
    elif as_json:
        rows = [a.to_json() for a in budget.allocations]
        typer.echo(json.dumps(rows[0] if len(rows) == 1 else rows, indent=1))
    else:
        _print_allocations(budget)
    if budget.written and not as_json:
        stdout.print(budget.written, highlight=False)


def _print_allocations(budget) -> None:
    """One row per law: N, D, shape, batch, LR, and the notes."""
    allocs = budget.allocations
    columns = ("law", "N", "D", "D/N", "pred. loss", "shape L×d (heads, ffn)", "batch tok", "lr")
    table = new_table(f"compute-optimal allocation for C = {budget.flops:.3g} FLOPs", columns, columns, no_wrap=True)
    for a in allocs:
        s = a.shape
        table.add_row(
            a.law,
            human(a.params),
            human(a.tokens),
            f"{a.tokens_per_param:.1f}",
            f"{a.predicted_loss:.3f}",
            f"{s.n_layers}×{s.d_model} ({s.n_heads}, {s.ffn_dim})",
            human(a.global_batch_tokens),
            f"{a.lr:.2e}",
        )
    stdout.print(table)
    for a in allocs:
        for line in a.notes:
            stdout.print(f"[dim]{a.law}: {line}[/]")
    stdout.print(
        f"[dim]loss predicted by: {', '.join(sorted({a.loss_law for a in allocs}))}; "
        f"batch/LR rule: {allocs[0].batch_rule}[/]"
    )


def _print_lifetimes(budget, as_json: bool) -> None:
    """The allocations that train and serve each demand for the fewest device-hours, with their costs."""
    lts = budget.lifetimes
    if as_json:
        rows = [lt.to_json() for lt in lts]
        typer.echo(json.dumps(rows[0] if len(rows) == 1 else rows, indent=1))
        return
    first, price = lts[0], lts[0].price_per_gpu_hour
    columns: tuple[str, ...] = ("law", "served T", "N", "D", "D/N", "pred. loss", "shape L×d (heads, ffn)")
    columns += ("serving", "train GPU-h", "serve GPU-h", "total GPU-h", "vs Chinchilla") + (
        ("total cost",) * bool(price)
    )
    title = (
        f"lifetime-optimal allocation for C = {budget.flops:.3g} FLOPs: trained at MFU {first.mfu:.0%}, "
        f"served on {first.gpus} × {first.hardware}"
    )
    table = new_table(title, columns, columns[:8], no_wrap=True)
    for lt in lts:
        a, s, lay = lt.allocation, lt.allocation.shape, lt.layout
        row = [a.law, f"{lt.inference_tokens:.3g}", human(a.params), human(a.tokens), f"{a.tokens_per_param:.1f}"]
        row += [f"{a.predicted_loss:.3f}", f"{s.n_layers}×{s.d_model} ({s.n_heads}, {s.ffn_dim})"]
        row += [f"tp{lay.tp} pp{lay.pp} b{lay.batch}", human(lt.train_gpu_hours), human(lt.serve_gpu_hours)]
        row += [human(lt.total_gpu_hours), f"{-round(100 * lt.saving) or 0:+d}%"]
        table.add_row(*row, *((human(price * lt.total_gpu_hours),) if price else ()))
    stdout.print(table)
    for lt in lts:
        for line in lt.allocation.notes:
            stdout.print(f"[dim]{lt.allocation.law}: {line}[/]")
    stdout.print(
        f"[dim]serving: {serve_regime(first.serve)}; the cheapest layout that qualifies (batch per replica); "
        "vs Chinchilla: the total against the same law's compute-optimal model serving the same tokens[/]"
    )


@app.command("fit")
def fit_cmd(
    runs: Path = typer.Argument(..., help="CSV with params,tokens,loss (or params,flops,loss), or a folder of runs"),
    bootstrap: int = typer.Option(200, "--bootstrap", min=0),
    drop_highest: int = typer.Option(0, "--drop-highest", min=0, help="drop the N highest-loss points (Epoch: 5)"),
    plots: Path | None = typer.Option(None, "--plots", help="folder for isoflop.png, fit.png, frontier.png"),
    out: Path | None = typer.Option(None, "--out", help="write the fitted law (JSON) for --law fitted:FILE"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Fit L(N, D) = E + A/N^α + B/D^β (Approach 3, with bootstrap CIs), IsoFLOP parabolas, Kaplan's form.

    Then judge the fit: points or budgets too few, minima not bracketed, parameters at a bound,
    intervals without width or across zero, curves that miss their points; each a warning line
    naming the fix (--json: "warnings")."""
    from rich.console import Console
    from rich.progress import Progress

    from flopwise.scale.fit import fit_runs

    bar = Progress(console=Console(stderr=True), transient=True)
    task = bar.add_task(f"bootstrap ({bootstrap} refits)", total=bootstrap)

    def progress(done: int, total: int) -> None:
        if done == 1:
            bar.start()
        bar.update(task, completed=done)

    try:
        fit = fit_runs(runs, bootstrap, drop_highest, plots, out, progress)
    finally:
        bar.stop()
    result = fit.to_json()
    if as_json:
        typer.echo(json.dumps(result, indent=1))
        return
    fit3, iso, kap = fit.approach3, fit.approach2, fit.kaplan
    title = f"Approach 3 fit on {len(fit.points)} points ({fit3.bootstrap} bootstrap resamples, 95% CI)"
    table = new_table(title, ("param", "estimate", "95% CI"), ("param", "estimate", "95% CI"))
    for k in ("E", "A", "B", "alpha", "beta", "a"):
        ci = fit3.ci.get(k)
        table.add_row(k, f"{result[k]:.4g}", f"[{ci[0]:.4g}, {ci[1]:.4g}]" if ci else "–")
    stdout.print(table)
    if iso:
        stdout.print(f"Approach 2 (IsoFLOP): N_opt ∝ C^{iso.a:.3f} over {len(iso.budgets)} budgets")
    stdout.print(f"Kaplan L(N, D): α_N={kap.alpha_n:.3f} α_D={kap.alpha_d:.3f} N_c={kap.n_c:.3g} D_c={kap.d_c:.3g}")
    for p in fit.plots:
        stdout.print(f"plot: {p}")
    for line in fit.warnings:
        stdout.print(f"[yellow]warning[/]: {escape(line)}", highlight=False)


@app.command("predict-task")
def predict_task_cmd(
    table: Path = typer.Argument(..., help="CSV, one row per (run, task): name,flops,task,acc,nll[,chance]"),
    flops: float = typer.Option(..., "--flops", help="training FLOPs of the run to predict"),
    out: Path = typer.Option(Path("runs/predict-task"), "--out", help="folder for prediction.json and tasks.png"),
    bootstrap: int = typer.Option(1000, "--bootstrap", min=10),
) -> None:
    """Llama 3's two-step task prediction (compute -> correct-answer NLL -> accuracy) and jaggedness flags."""
    from flopwise.scale.tasks import predict_tasks

    report = predict_tasks(table, flops, out, bootstrap)
    columns = ("task", "NLL", "95% interval", "accuracy", "95% interval", "flags")
    title = f"task prediction at {flops:.3g} FLOPs (both steps fitted on the ladder's own runs)"
    t = new_table(title, columns, columns)
    for n, p in report.predictions.items():
        flags = ",".join(k for k in ("jump", "inverse") if report.record["tasks"][n][k]) or "–"
        t.add_row(
            n,
            f"{p.nll:.3f}",
            f"[{p.nll_interval[0]:.3f}, {p.nll_interval[1]:.3f}]",
            f"{p.acc:.3f}",
            f"[{p.acc_interval[0]:.3f}, {p.acc_interval[1]:.3f}]",
            flags,
        )
    stdout.print(t)
    stdout.print(f"wrote {' and '.join(map(str, report.written))}")


@app.command("sweep")
def sweep_cmd(
    args: list[str] | None = typer.Argument(None, help=ARGS_HELP + " (the base config)"),
    preset: str | None = typer.Option(
        None,
        "--preset",
        help="a ladder chosen whole (data, shapes, budgets, law; the flags below override it): cpu-tiny, "
        "3 budgets x 5 sizes of 13K-332K parameters (docs/scaling-laws.md)",
    ),
    budgets: str | None = typer.Option(
        None, "--budgets", help="comma-separated FLOP budgets (default: 3e12,1e13,3e13)"
    ),
    sizes: int | None = typer.Option(None, "--sizes", min=1, help="model sizes per budget (default: 5)"),
    spread: float | None = typer.Option(
        None, "--spread", min=1.0, help="largest / smallest size within a budget (default: 8)"
    ),
    law: str | None = typer.Option(
        None, "--law", help="law that centres each budget's sizes: a built-in or fitted:FILE (default: chinchilla-3)"
    ),
    out: Path = typer.Option(Path("runs/ladder"), "--out"),
    emit: bool = typer.Option(False, "--emit", help="write configs and print torchrun commands instead of running"),
    nproc: int = typer.Option(1, "--nproc", min=1, help="processes per run in the emitted commands"),
    jobs: int = typer.Option(1, "--jobs", min=1, help="runs trained at once here, sharing the CPU's threads"),
) -> None:
    """An IsoFLOP ladder: configs for K budgets × M sizes, run here (resumable) or emitted for a cluster.

    Raw data is prepared once into a cache named by its content (FLOPWISE_CACHE_DIR, else
    ~/.cache/flopwise), shared by every ladder over the same corpus and tokenizer."""
    from flopwise.config.schema import split_cli_args
    from flopwise.train.ladder import ladder_preset, sweep_ladder

    p = ladder_preset(preset)
    path, given = split_cli_args(args)
    base = config_from([*([path] if path else []), *p.overrides, *given])
    done = sweep_ladder(
        base,
        budgets or p.budgets,
        sizes or p.sizes,
        spread or p.spread,
        law or p.law,
        out,
        emit,
        nproc,
        jobs,
        note,
    )
    for cmd in done.commands or []:
        typer.echo(cmd)
    if done.table:
        stdout.print(f"collected {done.table}; fit it with: flopwise scale fit {done.table}", highlight=False)
        if p.heldout and not budgets:  # the preset's own ladder, not its held-out run
            law_file = out / "law.json"
            stdout.print(
                f"then predict and train the held-out budget: flopwise scale fit {done.table} --out {law_file}; "
                f"flopwise scale sweep --preset {preset} --budgets {p.heldout:g} --sizes 1 "
                f"--law fitted:{law_file} --out {out}-heldout",
                highlight=False,
            )
