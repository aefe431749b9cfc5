"""`flopwise hardware calibrate`: this machine measured into a hardware file for the planner."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from flopwise import log
from flopwise.cli.common import DEFAULT_CONFIG, note_if_busy, stdout

app = typer.Typer(no_args_is_help=True, help="Measure this machine for the planner.")


@app.command("calibrate")
def calibrate_cmd(
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
    from rich.progress import Progress

    from flopwise.config.schema import split_cli_args
    from flopwise.measure.machine import calibrate_machine

    path, overrides = split_cli_args(args)
    bar = Progress(console=log.console(), transient=True)
    task = bar.add_task("calibrating", total=None)  # known once the peak that sizes the work is measured
    started = [time.perf_counter()]

    def start() -> None:  # after validation: a refused run gets its one-line error, nothing more
        note_if_busy("the tables measured now (and every plan made from them)")
        started[0] = time.perf_counter()
        bar.start()

    try:
        hw = calibrate_machine(
            path or DEFAULT_CONFIG,
            overrides,
            out,
            nproc,
            device,
            start,
            lambda what: bar.update(task, advance=1, description=what),
            lambda n: bar.update(task, total=n),
        )
    finally:
        bar.stop()
    _print_calibrated(hw, out, time.perf_counter() - started[0])


def _print_calibrated(hw, out: Path, seconds: float) -> None:
    c = hw.calibration
    effs = [r[3] for r in c.gemm]
    stdout.print(
        f"{hw.name}: {hw.peak_flops[c.dtype] / 1e12:.3g} TFLOP/s {c.dtype} peak; {len(c.gemm)} GEMMs at "
        f"{min(effs):.0%}-{max(effs):.0%} of it; attention {len(c.attention)} shapes; element-wise "
        f"{min(r[2] for r in c.elementwise) / 1e9:.3g}-{max(r[2] for r in c.elementwise) / 1e9:.3g} GB/s; "
        f"{len(c.collectives)} collectives over {hw.devices_per_node} ranks; {seconds:.0f} s"
    )
    if r := hw.recovery:
        stdout.print(
            f"checkpoint write {r.write_latency_s:.3g} s + {r.write_bytes_per_s / 1e9:.3g} GB/s; restart "
            f"{r.restart_fixed_s:.3g} s + a read at {r.read_bytes_per_s / 1e9:.3g} GB/s (one process; the planner's "
            "write and restart times unless cluster.storage_gbps_per_gpu or cluster.restart_minutes is set)"
        )
    stdout.print(f"wrote {out}: plan with cluster.hardware={hw.name} cluster.hardware_file={out}")
