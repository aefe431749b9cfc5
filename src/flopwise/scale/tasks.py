"""Predicting downstream task scores from a ladder (Llama 3, Dubey et al. 2024, Sec. 3.2.1), and
flagging jagged ones (Schaeffer et al. 2023).

Two steps per task: training compute C -> the correct answer's negative log-likelihood, a power law
NLL = A * C^-alpha fitted in log-log space; then NLL -> accuracy, a sigmoid from chance to 1,
acc = chance + (1 - chance) * sigmoid(-k (NLL - m)). Llama 3 fits the second step on older, larger
models; a CPU ladder has only its own runs, so both steps are fitted on them (say so in any result).
Intervals: refit both steps on bootstrap resamples of the runs, take the 2.5/97.5 percentiles.

Input: a CSV with one row per (run, task): name, flops, task, acc, nll[, chance, brier].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import curve_fit

from flopwise.errors import ConfigError, DataError
from flopwise.files.outputs import check_writable, pyplot, save_figure, write_json
from flopwise.scale.fit import read_csv_rows

_TASK_FIELDS = ("name", "flops", "task", "acc", "nll")


@dataclass(frozen=True)
class TaskPoints:
    task: str
    flops: np.ndarray
    acc: np.ndarray
    nll: np.ndarray
    chance: float


def read_task_table(path: str | Path) -> dict[str, TaskPoints]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"task table {path}: no such file")
    rows = read_csv_rows(path, "task table")
    missing = [k for k in _TASK_FIELDS if rows and k not in rows[0]]
    if not rows or missing:
        raise DataError(
            f"task table {path}: needs columns {', '.join(_TASK_FIELDS)} (missing: {', '.join(missing) or 'rows'})"
        )
    out: dict[str, list[dict]] = {}
    for row, r in enumerate(rows, start=1):
        try:
            values = {k: float(r[k] or "nan") for k in ("flops", "acc", "nll")}
            values["chance"] = float(r.get("chance") or 0)
        except ValueError as e:
            raise DataError(f"task table {path} row {row}: non-numeric value ({e})") from None
        # flops and NLL are fitted in log space; accuracy and chance are shares
        if not (
            values["flops"] > 0 and 0 < values["nll"] < np.inf and 0 <= values["acc"] <= 1 and 0 <= values["chance"] < 1
        ):
            raise DataError(
                f"task table {path} row {row}: needs flops > 0, nll > 0 (finite), acc in [0, 1] and "
                f"chance in [0, 1) (got {', '.join(f'{k}={v:g}' for k, v in values.items())})"
            )
        out.setdefault(r["task"], []).append(values)
    tasks = {}
    for task, rs in out.items():
        rs.sort(key=lambda r: r["flops"])
        tasks[task] = TaskPoints(
            task=task,
            flops=np.array([r["flops"] for r in rs]),
            acc=np.array([r["acc"] for r in rs]),
            nll=np.array([r["nll"] for r in rs]),
            chance=rs[0]["chance"],
        )
    return tasks


def _power(log_c, log_a, alpha):
    return log_a - alpha * log_c


def _sigmoid(nll, k, m, chance):
    return chance + (1 - chance) / (1 + np.exp(np.clip(k * (nll - m), -50, 50)))


@dataclass(frozen=True, kw_only=True)
class TaskLaw:
    log_a: float
    alpha: float
    k: float
    m: float
    chance: float

    def nll(self, flops: float | np.ndarray) -> np.ndarray:
        return np.exp(_power(np.log(flops), self.log_a, self.alpha))

    def acc(self, flops: float | np.ndarray) -> np.ndarray:
        return _sigmoid(self.nll(flops), self.k, self.m, self.chance)


def fit_task(p: TaskPoints) -> TaskLaw:
    """Both steps by least squares (scipy curve_fit); step 2 starts at the middle of the observed NLLs."""
    if len(p.flops) < 3:
        raise DataError(f"task {p.task}: {len(p.flops)} runs; the two-step fit needs at least 3")
    (log_a, alpha), _ = curve_fit(_power, np.log(p.flops), np.log(p.nll), p0=(float(np.log(p.nll).mean()), 0.05))
    (k, m), _ = curve_fit(
        lambda x, k, m: _sigmoid(x, k, m, p.chance), p.nll, p.acc, p0=(1.0, float(np.median(p.nll))), maxfev=20000
    )
    return TaskLaw(log_a=float(log_a), alpha=float(alpha), k=float(k), m=float(m), chance=p.chance)


@dataclass(frozen=True, kw_only=True)
class TaskPrediction:
    task: str
    flops: float
    nll: float
    nll_interval: tuple[float, float]
    acc: float
    acc_interval: tuple[float, float]
    law: TaskLaw

    def to_json(self) -> dict:
        return {
            "task": self.task,
            "flops": self.flops,
            "nll": self.nll,
            "nll_interval_95": list(self.nll_interval),
            "acc": self.acc,
            "acc_interval_95": list(self.acc_interval),
            "law": self.law.__dict__,
        }


def predict_task(p: TaskPoints, flops: float, bootstrap: int = 1000, seed: int = 0) -> TaskPrediction:
    """The two-step prediction at `flops`, with a 95% interval from bootstrap refits of the runs."""
    if not (math.isfinite(flops) and flops > 0):  # the power law takes log(flops): NaN otherwise
        raise ConfigError(
            f"--flops {flops:g}: expected the training FLOPs to predict at, finite and > 0 (e.g. --flops 1e21)"
        )
    law = fit_task(p)
    rng = np.random.default_rng(seed)
    nlls, accs = [], []
    for _ in range(bootstrap):
        idx = rng.integers(0, len(p.flops), len(p.flops))
        if len(set(p.flops[idx])) < 3:
            continue
        try:
            b = fit_task(TaskPoints(task=p.task, flops=p.flops[idx], acc=p.acc[idx], nll=p.nll[idx], chance=p.chance))
        except (RuntimeError, ValueError):  # curve_fit found no optimum on this resample: skip it
            continue
        nlls.append(float(b.nll(flops)))
        accs.append(float(b.acc(flops)))
    if not nlls:
        raise DataError(f"task {p.task}: no bootstrap resample could be fitted; add runs")
    q = lambda xs: (float(np.percentile(xs, 2.5)), float(np.percentile(xs, 97.5)))  # noqa: E731
    return TaskPrediction(
        task=p.task,
        flops=flops,
        nll=float(law.nll(flops)),
        nll_interval=q(nlls),
        acc=float(law.acc(flops)),
        acc_interval=q(accs),
        law=law,
    )


def jaggedness(p: TaskPoints, jump_share: float = 0.5) -> dict[str, bool | float]:
    """Flags for one task over increasing compute.

    jump: one step between neighbouring runs carries at least `jump_share` of the accuracy's total rise
      while the NLL's largest step carries less (a discontinuous metric jumps, the continuous one is smooth);
    inverse: accuracy falls from the smallest to the largest run, or the NLL rises (inverse scaling).
    """

    def largest_share(x: np.ndarray, sign: float) -> float:
        steps = np.diff(x) * sign
        total = float(np.clip(steps, 0, None).sum())
        return float(steps.max() / total) if total > 0 else 0.0

    acc_share, nll_share = largest_share(p.acc, 1.0), largest_share(p.nll, -1.0)
    return {
        "jump": acc_share >= jump_share and nll_share < jump_share and len(p.acc) >= 3,
        "inverse": bool(p.acc[-1] < p.acc[0] or p.nll[-1] > p.nll[0]),
        "acc_largest_step_share": acc_share,
        "nll_largest_step_share": nll_share,
    }


def plot_tasks(
    tasks: dict[str, TaskPoints],
    laws: dict[str, TaskLaw],
    out_dir: str | Path,
    observed: dict[str, tuple[float, float, float]] | None = None,
) -> Path:
    """Per task: accuracy (discontinuous) and correct-answer NLL (continuous) against compute, with fits;
    `observed` marks a held-out run (flops, acc, nll)."""
    plt = pyplot()

    out = Path(out_dir) / "tasks.png"
    fig, axes = plt.subplots(2, len(tasks), figsize=(3.6 * len(tasks), 6), squeeze=False)
    for j, (name, p) in enumerate(tasks.items()):
        flags = jaggedness(p)
        title = name + "".join(f" [{k}]" for k in ("jump", "inverse") if flags[k])
        grid = np.geomspace(p.flops.min(), max([p.flops.max(), *(o[0] for o in (observed or {}).values())]) * 1.5, 50)
        for row, (y, label) in enumerate(((p.acc, "accuracy"), (p.nll, "correct-answer NLL (nats)"))):
            ax = axes[row, j]
            ax.scatter(p.flops, y, s=14)
            if name in laws:
                ax.plot(grid, (laws[name].acc if row == 0 else laws[name].nll)(grid), lw=1)
            if observed and name in observed:
                ax.scatter([observed[name][0]], [observed[name][1 + row]], marker="*", s=80, c="red")
            if row == 0 and p.chance:
                ax.axhline(p.chance, ls=":", c="gray")
            ax.set_xscale("log")
            ax.set_ylabel(label)
            ax.set_title(title if row == 0 else "", fontsize=9)
        axes[1, j].set_xlabel("training FLOPs")
    fig.tight_layout()
    save_figure(fig, out, "--out", dpi=110)
    plt.close(fig)
    return out


@dataclass(frozen=True)
class TaskReport:
    predictions: dict[str, TaskPrediction]
    record: dict  # what prediction.json holds: each task's prediction and jaggedness flags
    written: list[Path]  # prediction.json, tasks.png


def predict_tasks(table: Path, flops: float, out: Path, bootstrap: int = 1000) -> TaskReport:
    """`flopwise scale predict-task`: every task of `table` predicted at `flops`, written to
    `out`/prediction.json with a figure, both checked writable first."""
    for name in ("prediction.json", "tasks.png"):
        check_writable(out / name, "--out")
    tasks = read_task_table(table)
    preds = {name: predict_task(p, flops, bootstrap) for name, p in tasks.items()}
    record = {
        "flops": flops,
        "table": str(table),
        "tasks": {n: {**preds[n].to_json(), **jaggedness(tasks[n])} for n in tasks},
    }
    write_json(out / "prediction.json", record, "--out", "scale predict-task")
    png = plot_tasks(tasks, {n: p.law for n, p in preds.items()}, out)
    return TaskReport(preds, record, [out / "prediction.json", png])
