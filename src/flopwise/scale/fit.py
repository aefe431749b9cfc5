"""Fitting scaling laws to (N, D, loss) points: Chinchilla Approaches 2 and 3 and Kaplan's L(N, D).

Approach 3 follows Hoffmann et al. 2022 eq. (11) as Besiroglu et al. 2024 re-ran it: minimise the
*summed* Huber loss (δ = 1e-3) of log-space residuals LSE(a − α·log N, b − β·log D, e) − log L with
L-BFGS from the published grid of starts, then bootstrap the points for confidence intervals.
numpy + scipy, no torch.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

from flopwise.errors import DataError, FlopwiseError
from flopwise.files.outputs import check_writable, pyplot, read_records, save_figure, write_json
from flopwise.flops import scaling_flops, scaling_tokens
from flopwise.scale.laws import ParametricLaw

_GRID = dict(
    alpha=np.arange(0, 2.01, 0.5),
    beta=np.arange(0, 2.01, 0.5),
    e=np.arange(-1, 1.01, 0.5),
    a=np.arange(0, 25.1, 5),
    b=np.arange(0, 25.1, 5),
)  # Hoffmann et al. 2022 §D.2


@dataclass
class Points:
    params: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray
    embeddings: bool = True  # params count the embeddings; False: a sweep's non-embedding N

    def __len__(self) -> int:
        return len(self.loss)

    @property
    def flops(self) -> np.ndarray:
        return scaling_flops(self.params, self.tokens)

    def subset(self, idx: np.ndarray) -> Points:
        return Points(self.params[idx], self.tokens[idx], self.loss[idx], self.embeddings)


def read_csv_rows(path: Path, what: str) -> list[dict[str, str]]:
    """A CSV file's rows as dicts; a file that is not UTF-8 CSV text (a pickle, a PNG) fails in one
    line naming `what` instead of a decoding traceback."""
    try:
        return list(csv.DictReader(path.read_text(encoding="utf-8").splitlines()))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{what} {path}: not a CSV ({e})") from None


def read_points(path: str | Path) -> Points:
    """A CSV with params,tokens,loss (or params,flops,loss: tokens = flops / 6·params; Epoch AI's
    `Model Size`/`Training FLOP` column names are accepted), or a folder
    of flopwise runs (best validation loss, non-embedding parameters and tokens of each run)."""
    p = Path(path)
    if p.is_dir():
        return _points_from_runs(p)
    if not p.is_file():
        raise DataError(f"scale fit input {p}: no such file or directory")
    rows = read_csv_rows(p, "scale fit input")
    aliases = {"Model Size": "params", "Training FLOP": "flops"}  # Epoch AI's Chinchilla extraction
    rows = [{aliases.get(k, k): v for k, v in r.items()} for r in rows]
    if not rows or "params" not in rows[0] or "loss" not in rows[0] or not ({"tokens", "flops"} & set(rows[0])):
        raise DataError(f"scale fit input {p}: needs columns params,tokens,loss (or params,flops,loss)")
    try:
        n = np.array([float(r["params"]) for r in rows])
        loss = np.array([float(r["loss"]) for r in rows])
        d = (
            np.array([float(r["tokens"]) for r in rows])
            if "tokens" in rows[0]
            else scaling_tokens(np.array([float(r["flops"]) for r in rows]), n)
        )
    except (TypeError, ValueError) as e:
        raise DataError(f"scale fit input {p}: non-numeric value ({e})") from None
    sweep = {"name", "budget"} <= set(rows[0])  # `scale sweep`'s runs.csv: non-embedding N
    return _checked(Points(n, d, loss, embeddings=not sweep), f"scale fit input {p}: row", 2)


def _checked(pts: Points, where: str, first: int) -> Points:
    """`pts` if every value is a finite positive number (NaN passed `<= 0` checks and broke the fit);
    else one line naming the first bad row (`first`: the number of row 0)."""
    good = np.isfinite(pts.params) & np.isfinite(pts.tokens) & np.isfinite(pts.loss)
    good &= (pts.params > 0) & (pts.tokens > 0) & (pts.loss > 0)
    if not good.all():
        i = int(np.argmin(good))
        raise DataError(
            f"{where} {i + first}: params, tokens and loss must be finite positive numbers (got "
            f"{pts.params[i]:g}, {pts.tokens[i]:g}, {pts.loss[i]:g}); fix or remove it"
        )
    return pts


def _points_from_runs(root: Path) -> Points:
    import tomllib

    from flopwise.config.schema import ModelConfig
    from flopwise.flops import count_params

    rows = []
    for run in sorted(q for q in root.iterdir() if (q / "metrics.jsonl").is_file() and (q / "config.toml").is_file()):
        cfg = tomllib.loads((run / "config.toml").read_text())
        records = read_records(run / "metrics.jsonl")
        val = [r["val_loss"] for r in records if "val_loss" in r]
        tokens = [r["tokens"] for r in records if "tokens" in r]
        if val and tokens:  # non-embedding N, the convention of `flopwise scale sweep`
            rows.append((count_params(ModelConfig(**cfg["model"])).non_embedding, max(tokens), min(val)))
    if len(rows) < 3:
        raise DataError(f"scale fit input {root}: found {len(rows)} finished flopwise runs; need at least 3")
    n, d, loss = (np.array(c, dtype=float) for c in zip(*rows, strict=True))
    return _checked(Points(n, d, loss, embeddings=False), f"scale fit input {root}: run", 1)


def _huber(r: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    small = np.abs(r) <= delta
    value = np.where(small, 0.5 * r**2, delta * (np.abs(r) - 0.5 * delta))
    grad = np.where(small, r, delta * np.sign(r))
    return value, grad


def _lse(terms: np.ndarray) -> np.ndarray:
    top = terms.max(axis=0)
    return top + np.log(np.exp(terms - top).sum(axis=0))


def _objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, delta: float):
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    lse = _lse(terms)
    value, g = _huber(lse - log_l, delta)
    w = np.exp(terms - lse)  # softmax weights: d lse / d term
    grad = np.array(
        [(g * w[0]).sum(), (g * w[1]).sum(), (g * w[2]).sum(), (g * w[0] * -log_n).sum(), (g * w[1] * -log_d).sum()]
    )
    return value.sum(), grad


def _fit_from(starts, pts: Points, delta: float) -> tuple[np.ndarray, float]:
    args = (np.log(pts.params), np.log(pts.tokens), np.log(pts.loss), delta)
    best_theta, best_value = None, math.inf
    for x0 in starts:
        res = minimize(
            _objective,
            np.asarray(x0, dtype=float),
            args=args,
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": 1000, "ftol": 1e-15, "gtol": 1e-12},
        )
        if res.fun < best_value:
            best_theta, best_value = res.x, float(res.fun)
    if best_theta is None:
        raise DataError("scale fit: the Huber objective is not finite from any start; check the points")
    return best_theta, best_value


def _law(theta: np.ndarray, name: str, embeddings: bool = True) -> ParametricLaw:
    a, b, e, alpha, beta = theta
    return ParametricLaw(
        name=name,
        E=math.exp(e),
        A=math.exp(a),
        B=math.exp(b),
        alpha=float(alpha),
        beta=float(beta),
        source="fitted by flopwise (Approach 3, summed Huber δ=1e-3, L-BFGS)",
        embeddings=embeddings,
    )


@dataclass(kw_only=True)
class Approach3Fit:
    law: ParametricLaw
    objective: float
    n_points: int
    ci: dict[str, tuple[float, float]] = field(default_factory=dict)
    bootstrap: int = 0
    samples: list[ParametricLaw] = field(default_factory=list)  # the bootstrap refits

    def predict(self, n: float, d: float) -> tuple[float, tuple[float, float] | None]:
        """L(N, D) and its 95% bootstrap interval (None without bootstrap)."""
        if not self.samples:
            return self.law.loss(n, d), None
        values = np.array([law.loss(n, d) for law in self.samples])
        return self.law.loss(n, d), (float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5)))

    def to_json(self) -> dict:
        L = self.law
        return {
            "E": L.E,
            "A": L.A,
            "B": L.B,
            "alpha": L.alpha,
            "beta": L.beta,
            "a": L.a,
            "b": 1 - L.a,
            "embeddings": L.embeddings,
            "objective": self.objective,
            "n_points": self.n_points,
            "bootstrap": self.bootstrap,
            "ci": {k: list(v) for k, v in self.ci.items()},
        }


def _best_starts(pts: Points, delta: float, grid: dict, keep: int) -> np.ndarray:
    """The `keep` grid points with the lowest initial objective (all 4,500 evaluated at once)."""
    starts = np.array(list(itertools.product(grid["a"], grid["b"], grid["e"], grid["alpha"], grid["beta"])))
    a, b, e, al, be = (starts[:, i : i + 1] for i in range(5))
    log_n, log_d, log_l = np.log(pts.params), np.log(pts.tokens), np.log(pts.loss)
    terms = np.stack([a - al * log_n, b - be * log_d, np.broadcast_to(e, (len(starts), len(pts)))])
    value, _ = _huber(_lse(terms) - log_l, delta)
    return starts[np.argsort(value.sum(axis=1))[:keep]]


def fit_approach3(
    pts: Points,
    delta: float = 1e-3,
    bootstrap: int = 0,
    seed: int = 0,
    grid: dict | None = None,
    keep_starts: int = 64,
    progress: Callable[[int, int], None] | None = None,
) -> Approach3Fit:
    """Point estimate by L-BFGS from the `keep_starts` best points of Hoffmann's grid (on the
    Chinchilla data this finds the same optimum as all 4,500 starts, tested); bootstrap refits start
    from the point estimate; `progress(done, total)` hears each refit."""
    if len(pts) < 5:
        raise DataError(f"scale fit: {len(pts)} points; Approach 3 has 5 parameters and needs at least 5")
    theta, value = _fit_from(_best_starts(pts, delta, grid or _GRID, keep_starts), pts, delta)
    fit = Approach3Fit(law=_law(theta, "fitted", pts.embeddings), objective=value, n_points=len(pts))
    if bootstrap:
        rng = np.random.default_rng(seed)
        samples = []
        for _ in range(bootstrap):
            idx = rng.integers(0, len(pts), len(pts))
            t, _ = _fit_from([theta], pts.subset(idx), delta)
            law = _law(t, "boot")
            fit.samples.append(law)
            samples.append((law.E, law.A, law.B, law.alpha, law.beta, law.a))
            if progress:
                progress(len(samples), bootstrap)
        arr = np.array(samples)
        for k, name in enumerate(("E", "A", "B", "alpha", "beta", "a")):
            fit.ci[name] = (float(np.percentile(arr[:, k], 2.5)), float(np.percentile(arr[:, k], 97.5)))
        fit.bootstrap = bootstrap
    return fit


@dataclass(kw_only=True)
class IsoFlopFit:
    budgets: list[float]
    n_opt: list[float]
    parabolas: list[tuple[float, float, float]]  # loss = c0 + c1·x + c2·x², x = log10 N
    a: float  # N_opt ∝ C^a
    k: float  # N_opt = k·C^a
    groups: list[list[int]] = field(default_factory=list)  # each parabola's points, smallest first

    def to_json(self) -> dict:
        return {"budgets": self.budgets, "n_opt": self.n_opt, "a": self.a, "b": 1 - self.a, "k": self.k}


def isoflop_groups(pts: Points, rel_tol: float = 0.1) -> list[list[int]]:
    """The points' budgets: indices of points whose 6ND agree within rel_tol, each group by size."""
    order = np.argsort(pts.flops)
    groups: list[list[int]] = []
    for i in order:
        if groups and pts.flops[i] <= pts.flops[groups[-1][0]] * (1 + rel_tol):
            groups[-1].append(int(i))
        else:
            groups.append([int(i)])
    return [sorted(g, key=lambda i: pts.params[i]) for g in groups]


def fit_approach2(pts: Points, rel_tol: float = 0.1) -> IsoFlopFit:
    """IsoFLOP profiles: group points whose 6ND agree within rel_tol, fit a parabola of loss in log N
    per group, take its minimum, then fit log N_opt against log C."""
    budgets, n_opt, parabolas, groups = [], [], [], []
    for grp in isoflop_groups(pts, rel_tol):
        if len(grp) < 3:
            continue
        x = np.log10(pts.params[grp])
        c2, c1, c0 = np.polyfit(x, pts.loss[grp], 2)
        if c2 <= 0:
            continue  # no minimum inside: the budget's sizes do not bracket the optimum
        budgets.append(float(np.exp(np.log(pts.flops[grp]).mean())))
        n_opt.append(float(10 ** (-c1 / (2 * c2))))
        parabolas.append((float(c0), float(c1), float(c2)))
        groups.append(grp)
    if len(budgets) < 2:
        raise DataError("scale fit: Approach 2 needs at least 2 budgets with 3+ sizes that bracket the optimum")
    a, log_k = np.polyfit(np.log(budgets), np.log(n_opt), 1)
    return IsoFlopFit(
        budgets=budgets, n_opt=n_opt, parabolas=parabolas, a=float(a), k=float(math.exp(log_k)), groups=groups
    )


@dataclass(kw_only=True)
class KaplanFit:
    alpha_n: float
    alpha_d: float
    n_c: float
    d_c: float

    def loss(self, n, d):
        return ((self.n_c / n) ** (self.alpha_n / self.alpha_d) + self.d_c / d) ** self.alpha_d

    def to_json(self) -> dict:
        return {"alpha_n": self.alpha_n, "alpha_d": self.alpha_d, "n_c": self.n_c, "d_c": self.d_c}


def fit_kaplan(pts: Points) -> KaplanFit:
    """Kaplan eq. 1.5, least squares on log loss from a few starts (log-parametrised constants)."""
    log_n, log_d, log_l = np.log(pts.params), np.log(pts.tokens), np.log(pts.loss)

    def resid(theta):
        an, ad, lnc, ldc = theta
        inner = np.logaddexp((an / ad) * (lnc - log_n), ldc - log_d)
        return ((ad * inner - log_l) ** 2).sum()

    best = min(
        (
            minimize(resid, np.array(x0), method="L-BFGS-B", bounds=[(1e-3, 3), (1e-3, 3), (-50, 80), (-50, 80)])
            for x0 in itertools.product((0.05, 0.1, 0.3), (0.05, 0.1, 0.3), (20, 30), (20, 30))
        ),
        key=lambda res: res.fun,
    )  # the first of the lowest
    an, ad, lnc, ldc = best.x
    return KaplanFit(alpha_n=float(an), alpha_d=float(ad), n_c=float(math.exp(lnc)), d_c=float(math.exp(ldc)))


def save_law(fit: Approach3Fit, path: str | Path, option: str = "--out") -> None:
    write_json(path, fit.to_json(), option, "scale fit")


def fitted_law(name: str) -> ParametricLaw | None:
    """The law a `--law fitted:FILE` name points to (read from FILE), None for a built-in name:
    what plan.scaling.get_law and allocate take as `fitted`."""
    return _load_law(name.split(":", 1)[1]) if name.startswith("fitted:") else None


def _load_law(path: str | Path) -> ParametricLaw:
    p = Path(path)
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
        return ParametricLaw(
            name=f"fitted:{p.name}",
            E=float(d["E"]),
            A=float(d["A"]),
            B=float(d["B"]),
            alpha=float(d["alpha"]),
            beta=float(d["beta"]),
            source=str(p),
            embeddings=bool(d.get("embeddings", True)),
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"fitted law {p}: cannot read E, A, B, alpha, beta ({e})") from None


PLOT_NAMES = ("isoflop.png", "fit.png", "frontier.png")  # what plot_fits writes into its folder


def plot_fits(pts: Points, fit3: Approach3Fit | None, iso: IsoFlopFit | None, out_dir: str | Path) -> list[Path]:
    """IsoFLOP curves with parabolas; fitted law vs points; N_opt vs C against the published laws."""
    plt = pyplot()

    from flopwise.scale.laws import LAWS

    out = Path(out_dir)
    written = []
    if iso is not None:
        fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=110)
        order = np.argsort(pts.flops)
        sc = ax.scatter(pts.params[order], pts.loss[order], c=np.log10(pts.flops[order]), s=14, cmap="viridis")
        for (c0, c1, c2), n, grp in zip(iso.parabolas, iso.n_opt, iso.groups, strict=True):
            sizes = np.log10(pts.params[grp])  # drawn over its own points, not around a far-off minimum
            x = np.linspace(sizes.min() - 0.1, sizes.max() + 0.1, 50)
            ax.plot(10**x, c0 + c1 * x + c2 * x**2, lw=1, color="gray")
            if sizes.min() <= math.log10(n) <= sizes.max():
                ax.axvline(n, lw=0.5, ls=":", color="gray")
        ax.set_xscale("log")
        ax.set(xlabel="parameters N", ylabel="loss", title="IsoFLOP profiles (Approach 2)")
        fig.colorbar(sc, label="log10 C")
        fig.tight_layout()
        written.append(save_figure(fig, out / "isoflop.png", "--plots"))
        plt.close(fig)
    if fit3 is not None:
        fig, ax = plt.subplots(figsize=(5, 4.2), dpi=110)
        pred = [fit3.law.loss(n, d) for n, d in zip(pts.params, pts.tokens, strict=True)]
        ax.scatter(pts.loss, pred, s=10)
        lo, hi = pts.loss.min(), pts.loss.max()
        ax.plot([lo, hi], [lo, hi], color="gray", lw=1)
        ax.set(xlabel="observed loss", ylabel="fitted L(N, D)", title="Approach 3 fit")
        fig.tight_layout()
        written.append(save_figure(fig, out / "fit.png", "--plots"))
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(6, 4.2), dpi=110)
        cs = np.logspace(math.log10(pts.flops.min()), 26, 60)
        ax.plot(cs, [fit3.law.frontier(c)[0] for c in cs], label=f"fitted (a={fit3.law.a:.3f})", lw=2)
        for name in ("kaplan", "chinchilla-1", "chinchilla-3", "epoch"):
            ax.plot(cs, [LAWS[name].frontier(c)[0] for c in cs], label=name, lw=1, ls="--")
        if iso is not None:
            ax.scatter(iso.budgets, iso.n_opt, color="k", zorder=3, label="IsoFLOP minima")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set(xlabel="training FLOPs C", ylabel="N_opt", title="compute-optimal model size")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(save_figure(fig, out / "frontier.png", "--plots"))
        plt.close(fig)
    return written


# What a fit is judged by (fit_warnings)
_POINTS_PER_PARAM = 3  # Approach 3 fits 5 parameters: fewer than 15 points leave them loose
_MIN_BUDGETS = 3  # an exponent through 2 IsoFLOP minima has no check and no error
_MISS = 0.02  # a curve whose points sit further than this share of the loss from it misses them
_EXPONENT = (0.05, 2.0)  # α and β of real language models: Hoffmann's grid spans 0-2; at its edge, a bound


def fit_warnings(pts: Points, fit3: Approach3Fit, iso: IsoFlopFit | None) -> list[str]:
    """What makes a fit untrustworthy, one line each naming the fix: too few points or budgets,
    minima not bracketed, parameters at a bound, degenerate or sign-spanning intervals, curves that
    miss their points."""
    lines = _ladder_warnings(pts, iso) + _approach3_warnings(pts, fit3) + _approach2_warnings(pts, iso)
    return _summarised(lines, _MAX_PER_KIND)


_MAX_PER_KIND = 3  # budget lines of one kind beyond this are one line: a scatter of budgets (Epoch's
# extraction of Chinchilla's points groups into 33) would otherwise bury the other warnings


def _summarised(lines: list[str], most: int) -> list[str]:
    """`lines`, with each kind of per-budget line ("budget C: ...") beyond `most` folded into one."""

    def kind(line: str) -> str:  # the line without its budget and numbers
        return re.sub(r"\([^)]*\)|[\d.,%+]+", "", line.split(": ", 1)[1])

    kinds: dict[str, list[str]] = {}
    for line in lines:
        if line.startswith("budget "):
            kinds.setdefault(kind(line), []).append(line)
    out = []
    for line in lines:
        same = kinds.get(kind(line), []) if line.startswith("budget ") else []
        if len(same) <= most:
            out.append(line)
        elif line is same[0]:
            out.append(f"{len(same)} budgets alike, the first: {line}")
    return out


def _ladder_warnings(pts: Points, iso: IsoFlopFit | None) -> list[str]:
    """The points themselves: how many, how many budgets, and whether each budget brackets its minimum."""
    lines = []
    if len(pts) < 5 * _POINTS_PER_PARAM:
        lines.append(
            f"{len(pts)} points for Approach 3's 5 parameters: they are loosely pinned; "
            f"train more sizes or budgets ({5 * _POINTS_PER_PARAM}+ points)"
        )
    groups = [g for g in isoflop_groups(pts) if len(g) >= 3]
    if len(groups) < _MIN_BUDGETS:
        lines.append(
            f"{len(groups)} budget(s) with 3+ sizes: an IsoFLOP exponent needs {_MIN_BUDGETS}+ to be checked; "
            "add budgets"
        )
    for g in groups:
        best = min(g, key=lambda i: pts.loss[i])
        if best in (g[0], g[-1]):
            end, fix = ("smallest", "smaller") if best == g[0] else ("largest", "larger")
            lines.append(
                f"budget {pts.flops[g].mean():.2g}: the {end} size ({pts.params[best]:,.0f}) has the lowest "
                f"loss, so the optimum is not bracketed; add {fix} sizes (or widen --spread)"
            )
    return lines


def _approach3_warnings(pts: Points, fit3: Approach3Fit) -> list[str]:
    """Approach 3's parameters at a bound, its bootstrap intervals, and how far its curve is from the points."""
    law, lines = fit3.law, []
    if law.E < 1e-3 * pts.loss.min():
        lines.append(
            f"E = {law.E:.3g}: the irreducible loss went to zero (a bound), the points do not pin it; "
            "train wider sizes and more budgets"
        )
    for name in ("alpha", "beta"):
        value = getattr(law, name)
        if not _EXPONENT[0] <= value <= _EXPONENT[1]:
            lines.append(
                f"{name} = {value:.3g}: at the edge of what language models show ({_EXPONENT[0]}-{_EXPONENT[1]}); "
                "train wider sizes (a decade or more within a budget)"
            )
    pred = np.array([law.loss(n, d) for n, d in zip(pts.params, pts.tokens, strict=True)])
    miss = float(np.sqrt(np.mean(((pred - pts.loss) / pts.loss) ** 2)))
    flat = [k for k, (lo, hi) in fit3.ci.items() if hi - lo <= 1e-6 * max(abs(getattr(law, k)), 1e-12)]
    if flat and miss > 1e-6:  # points on the law exactly resample to the same fit: no fault
        lines.append(
            f"{', '.join(flat)}: bootstrap intervals of no width (every resample lands on the same "
            "fit, a bound); train more sizes"
        )
    across = [
        f"{k} [{lo:.3g}, {hi:.3g}]" for k, (lo, hi) in fit3.ci.items() if k in ("alpha", "beta", "a") and lo < 0 < hi
    ]
    if across:
        lines.append(f"{', '.join(across)}: intervals that span zero; train more sizes and budgets")
    if miss > _MISS:
        lines.append(
            f"Approach 3's curve misses its points by {miss:.1%} (rms); the law's form does not hold "
            "over them: check for unfinished or diverged runs, or drop the highest losses (--drop-highest)"
        )
    return lines


def _approach2_warnings(pts: Points, iso: IsoFlopFit | None) -> list[str]:
    """Approach 2's exponent, minima outside their sizes, and parabolas that miss their points."""
    if iso is None:
        return ["Approach 2: no budget's parabola has a minimum (no IsoFLOP fit); add sizes either side"]
    lines = []
    if not 0 < iso.a < 1:
        lines.append(
            f"Approach 2: N_opt ∝ C^{iso.a:.2f} is outside (0, 1), not a compute-optimal frontier; "
            "bracket each budget's minimum and add budgets"
        )
    for (c0, c1, c2), n, grp in zip(iso.parabolas, iso.n_opt, iso.groups, strict=True):
        x = np.log10(pts.params[grp])
        if not x.min() <= math.log10(n) <= x.max():
            lines.append(
                f"budget {pts.flops[grp].mean():.2g}: its parabola's minimum ({n:,.0f}) lies outside the "
                f"sizes trained ({pts.params[grp].min():,.0f}-{pts.params[grp].max():,.0f}), extrapolated; "
                "add sizes on that side"
            )
        off = np.abs(c0 + c1 * x + c2 * x**2 - pts.loss[grp]) / pts.loss[grp]
        if off.max() > _MISS:
            lines.append(
                f"budget {pts.flops[grp].mean():.2g}: its parabola misses a point by {off.max():.1%}; "
                "add sizes nearer the minimum"
            )
    return lines


@dataclass
class FitReport:
    points: Points
    approach3: Approach3Fit
    approach2: IsoFlopFit | None  # None: the points hold no IsoFLOP profile to fit
    kaplan: KaplanFit
    plots: list[Path]  # the figures written
    warnings: list[str] = field(default_factory=list)  # fit_warnings: why not to trust it, and the fix

    def to_json(self) -> dict:
        return {
            **self.approach3.to_json(),
            "approach2": self.approach2.to_json() if self.approach2 else None,
            "kaplan": self.kaplan.to_json(),
            "warnings": self.warnings,
        }


def fit_runs(
    runs: str | Path,
    bootstrap: int = 200,
    drop_highest: int = 0,
    plots: Path | None = None,
    out: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> FitReport:
    """`flopwise scale fit`: Approach 3 (with bootstrap CIs), IsoFLOP parabolas where the points
    allow, and Kaplan's form, on the points of `runs` less its `drop_highest` highest losses, judged
    (`fit_warnings`); the fitted law saved to `out` and the figures to `plots`, every output checked
    writable first; `progress(done, total)` hears each bootstrap refit."""
    for path in ([out] if out else []) + ([plots / n for n in PLOT_NAMES] if plots else []):
        check_writable(path, "--out" if path == out else "--plots")
    pts = read_points(runs)
    if drop_highest:
        pts = pts.subset(np.argsort(pts.loss)[:-drop_highest])
    fit3 = fit_approach3(pts, bootstrap=bootstrap, progress=progress)
    try:
        iso: IsoFlopFit | None = fit_approach2(pts)
    except FlopwiseError:
        iso = None
    kaplan = fit_kaplan(pts)
    if out:
        save_law(fit3, out, "--out")
    written = plot_fits(pts, fit3, iso, plots) if plots else []
    return FitReport(pts, fit3, iso, kaplan, written, fit_warnings(pts, fit3, iso))
