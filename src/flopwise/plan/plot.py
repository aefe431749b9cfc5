"""Memory-breakdown bar chart of planned layouts (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

from pathlib import Path

from flopwise.files.outputs import pyplot, save_figure
from flopwise.plan.step import Estimate

_PARTS = ("params", "grads", "optimizer", "activations", "other")


def plot_memory(estimates: list[Estimate], out: Path, title: str) -> Path:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(estimates)), 5))
    xs = range(len(estimates))
    bottom = [0.0] * len(estimates)
    for part in _PARTS:
        vals = [e.memory[part] / 2**30 for e in estimates]
        ax.bar(xs, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.axhline(estimates[0].usable_memory / 2**30, color="k", ls="--", lw=1, label="usable (after fit margin)")
    ax.set_xticks(list(xs), [e.layout.name(detail=True) for e in estimates], fontsize=7)
    ax.set_ylabel("GiB per device (worst pipeline stage)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out, "--plot", dpi=120)
    plt.close(fig)
    return out
