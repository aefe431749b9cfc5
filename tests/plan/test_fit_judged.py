"""`scale fit` judges its own fit: ladders drawn from Chinchilla's published law (Hoffmann et al.
2022, Approach 3) whose minima are bracketed give no warning; one whose minima are not, or a
degenerate one, is named with its fix."""

import json

import numpy as np
import pytest

from flopwise.scale.fit import Approach3Fit, Points, fit_approach2, fit_approach3, fit_warnings
from flopwise.scale.laws import EPOCH, HOFFMANN

BUDGETS = [1e18, 1e19, 1e20, 1e21]


def ladder(budgets, centre: float, sizes: int = 5, spread: float = 16.0, noise: float = 0.003) -> Points:
    """`sizes` sizes per budget spread geometrically around `centre` × Hoffmann's N_opt, each
    trained for C/(6N) tokens, their losses from Hoffmann's law with `noise` (log-normal)."""
    rng = np.random.default_rng(0)
    n = np.array([HOFFMANN.frontier(c)[0] * centre * spread**f for c in budgets for f in np.linspace(-0.5, 0.5, sizes)])
    c = np.repeat(budgets, sizes)
    d = c / (6 * n)
    loss = np.array([HOFFMANN.loss(a, b) for a, b in zip(n, d, strict=True)]) * np.exp(rng.normal(0, noise, len(n)))
    return Points(n, d, loss)


def judged(pts: Points) -> list[str]:
    fit3 = fit_approach3(pts, keep_starts=8)
    return fit_warnings(pts, fit3, fit_approach2(pts))


def test_bracketed_ladder_is_not_warned():
    assert judged(ladder(BUDGETS, centre=1.0)) == []


def test_unbracketed_minima_are_named_with_the_fix():
    """Every size 3x-48x Chinchilla's optimum: the smallest is best at every budget."""
    warnings = judged(ladder(BUDGETS, centre=12.0))
    bracket = [w for w in warnings if "not bracketed" in w]  # 4 budgets alike: one line, not four
    assert bracket == [w for w in bracket if w.startswith("4 budgets alike, the first: budget 1e+18: the smallest")]
    assert len(bracket) == 1 and "add smaller sizes" in bracket[0]
    assert any("lies outside the sizes trained" in w for w in warnings)


def test_degenerate_fit_is_named():
    """The issue's ladder: 2 budgets, the smallest size best at both, a fit whose E went to zero,
    intervals without width or across zero, a curve away from its points."""
    pts = ladder([1e18, 3e18], centre=12.0, sizes=4)
    fit3 = Approach3Fit(
        law=HOFFMANN.__class__("fitted", E=9.3e-9, A=EPOCH.A, B=EPOCH.B, alpha=0.02, beta=EPOCH.beta),
        objective=1.0,
        n_points=len(pts),
        ci={"E": (9.3e-9, 9.3e-9), "alpha": (-0.2, 0.3), "a": (-0.5, 1.5)},
        bootstrap=20,
    )
    text = "\n".join(fit_warnings(pts, fit3, None))
    for expected in (
        "8 points for Approach 3's 5 parameters",
        "2 budget(s) with 3+ sizes",
        "the smallest size",
        "E = 9.3e-09: the irreducible loss went to zero",
        "alpha = 0.02",
        "E: bootstrap intervals of no width",
        "alpha [-0.2, 0.3], a [-0.5, 1.5]: intervals that span zero",
        "curve misses its points",
        "Approach 2: no budget's parabola has a minimum",
    ):
        assert expected in text, (expected, text)


@pytest.mark.slow  # two fits from 64 starts: minutes on a busy machine
def test_fit_cli_prints_warnings_and_json_lists_them(tmp_path, cli):
    pts = ladder([1e18, 3e18], centre=12.0, sizes=4)
    table = tmp_path / "runs.csv"
    rows = [f"{n},{d},{loss}" for n, d, loss in zip(pts.params, pts.tokens, pts.loss, strict=True)]
    table.write_text("params,tokens,loss\n" + "\n".join(rows) + "\n")
    r = cli("scale", "fit", table, "--bootstrap", "3", "--json")
    assert r.returncode == 0, r.stderr
    warnings = json.loads(r.stdout)["warnings"]
    assert any("not bracketed" in w for w in warnings) and any("budget(s) with 3+ sizes" in w for w in warnings)
    r = cli("scale", "fit", table, "--bootstrap", "3")
    assert r.returncode == 0 and "warning: budget 1e+18: the smallest size" in r.stdout, r.stdout


@pytest.mark.parametrize("name", ["runs.csv", "other.csv"])
def test_a_sweeps_law_keeps_its_n_convention(tmp_path, name):
    """A law fitted to `scale sweep`'s runs.csv (non-embedding N) chooses non-embedding shapes."""
    from flopwise.scale.fit import read_points

    p = tmp_path / name
    sweep = name == "runs.csv"
    header = "name,budget,params,tokens,flops,loss" if sweep else "params,tokens,loss"
    row = "a,1e12,50000,3e6,9e11,3.1" if sweep else "50000,3e6,3.1"
    p.write_text(f"{header}\n{row}\n")
    assert read_points(p).embeddings is not sweep
