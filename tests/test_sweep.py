import csv
import math

import pytest

from flopwise.config.schema import load_config
from flopwise.scale.fit import read_points
from flopwise.train.ladder import launch_commands, plan_ladder, run_ladder, write_configs
from tests.conftest import tiny_overrides

pytestmark = pytest.mark.slow  # each test trains a ladder of runs: 1-2 minutes here


def test_ladder_plans_runs_resumes_and_collects(tiny_data, tmp_path):
    base = load_config(
        None, tiny_overrides(tmp_path / "base", tiny_data, **{"train.global_batch": 8, "train.micro_batch": 8})
    )
    out = tmp_path / "ladder"
    runs = plan_ladder(base, [2e9, 6e9], sizes=3, spread=16.0, out=out)
    assert len(runs) >= 4 and len({(r.budget, r.params) for r in runs}) == len(runs)  # duplicates dropped
    for r in runs:  # each run's schedule spans exactly its own token budget
        assert r.config.optim.schedule == "cosine" and r.config.optim.min_lr == 0.1 * base.optim.lr
        assert abs(6 * r.params * r.tokens / r.budget - 1) < 0.5
        assert r.config.train.steps * 8 * 32 == r.tokens
    wide = plan_ladder(base, [1e12, 1e13], sizes=5, spread=8.0, out=out)
    for k in (0, 5):
        sizes = [r.params for r in wide[k : k + 5]]
        assert sizes == sorted(sizes) and sizes[-1] / sizes[0] > 4
    table = run_ladder(base, runs, out)
    rows = list(csv.DictReader(table.open()))
    assert len(rows) == len(runs) and all(math.isfinite(float(r["loss"])) for r in rows)
    mtimes = [(out / r.name / "metrics.jsonl").stat().st_mtime for r in runs]
    run_ladder(base, runs, out)  # finished runs are skipped
    assert mtimes == [(out / r.name / "metrics.jsonl").stat().st_mtime for r in runs]
    pts = read_points(table)
    assert len(pts) == len(runs)
    from_dirs = read_points(out)  # the same points read straight from the run folders
    assert sorted(from_dirs.params.tolist()) == sorted(pts.params.tolist())
    assert sorted(from_dirs.loss.round(6).tolist()) == sorted(pts.loss.round(6).tolist())
    cmds = launch_commands(write_configs(runs, out), nproc=8)
    assert cmds[0].startswith("torchrun --standalone --nproc-per-node 8 -m flopwise train ")
    assert load_config(cmds[0].split()[-1]).train.steps == runs[0].steps


def test_ladder_jobs_train_runs_at_once_with_the_losses_of_one_at_a_time(tiny_data, tmp_path):
    """Worker processes on one thread each (--jobs 2) against the in-process sequential sweep."""
    base = load_config(
        None, tiny_overrides(tmp_path / "base", tiny_data, **{"train.global_batch": 8, "train.micro_batch": 8})
    )
    tables = {}
    for jobs in (1, 2):
        out = tmp_path / f"jobs{jobs}"
        runs = plan_ladder(base, [2e9, 6e9], sizes=2, spread=4.0, out=out)
        tables[jobs] = {r["name"]: float(r["loss"]) for r in csv.DictReader(run_ladder(base, runs, out, jobs).open())}
    assert len(tables[2]) == len(runs) >= 3 and tables[2].keys() == tables[1].keys()
    for name, loss in tables[1].items():
        assert abs(tables[2][name] - loss) < 1e-4 * loss, (name, loss, tables[2][name])
