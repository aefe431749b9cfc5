"""A plan as `flopwise plan` makes one: the config from a file and overrides (or a Hugging Face
config), the ranked layouts, and the files asked for beside them (a training TOML of the best
layout, a memory chart). The planner reads no data: a run's data mixture is handed in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flopwise.config.schema import Config, to_toml, validate
from flopwise.files.outputs import check_writable, write_text
from flopwise.plan.planner import MicroBatchReport, PlanReport, max_micro_batch, plan, plan_tree, planned_run_config

Mixture = Callable[[float], list]


@dataclass(frozen=True)
class Planned:
    report: PlanReport
    out_config: Path | None  # the training TOML written: None when not asked for or nothing fits
    plot: Path | None


def model_name(cfg: Config, hf: Path | None) -> str:
    """What a plan calls its model: the Hugging Face source, else the preset."""
    return f"{hf} ({cfg.model.arch})" if hf else cfg.model.preset or "model"


def make_plan(
    path: str | None,
    overrides: list[str],
    hf: Path | None = None,
    top: int = 5,
    out_config: Path | None = None,
    plot: Path | None = None,
    mixture_of: Callable[[Config], Mixture | None] | None = None,
) -> Planned:
    """Rank every layout of the config; write the best one's training TOML to `out_config` (when one
    fits) and a memory chart of the `top` layouts to `plot`, both checked writable before the search."""
    for target, option in ((out_config, "--out-config"), (plot, "--plot")):
        if target:
            check_writable(target, option)
    tree = plan_tree(path, overrides, hf)
    cfg = validate(tree)
    report = plan(cfg, tree, mixture=mixture_of(cfg) if mixture_of else None, hf=hf)
    if out_config and report.best.fits:
        write_text(out_config, to_toml(planned_run_config(report)), "--out-config")
    if plot:
        from flopwise.plan.plot import plot_memory

        title = f"{model_name(report.cfg, hf)} on {report.cfg.cluster.gpus} × {report.hardware.name}"
        plot_memory(report.result.ranked[:top], plot, title)
    return Planned(report, out_config if out_config and report.best.fits else None, plot)


def micro_batch_limits(path: str | None, overrides: list[str], hf: Path | None = None) -> MicroBatchReport:
    """The largest micro-batch that fits the config's own layout, per recompute policy."""
    return max_micro_batch(validate(plan_tree(path, overrides, hf)))
