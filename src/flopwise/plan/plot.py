"""Memory-breakdown bar chart of planned layouts (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

from pathlib import Path

from flopwise.plan.perf import Estimate

PARTS = ("params", "grads", "optimizer", "activations", "other")


def layout_label(e: Estimate) -> str:
    lo = e.layout
    sched = f" {lo.pp_schedule}" + (f"×{lo.virtual_stages}" if lo.virtual_stages > 1 else "") if lo.pp > 1 else ""
    return f"dp{lo.dp} tp{lo.tp} pp{lo.pp} cp{lo.cp}\nzero{lo.zero} mb{lo.micro_batch} {lo.recompute}{sched}"


def plot_memory(estimates: list[Estimate], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(estimates)), 5))
    xs = range(len(estimates))
    bottom = [0.0] * len(estimates)
    for part in PARTS:
        vals = [e.memory[part] / 2**30 for e in estimates]
        ax.bar(xs, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(estimates[0].usable_memory / 2**30, color="k", ls="--", lw=1, label="usable (after fit margin)")
    ax.set_xticks(list(xs), [layout_label(e) for e in estimates], fontsize=7)
    ax.set_ylabel("GiB per device (worst pipeline stage)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
