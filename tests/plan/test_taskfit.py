"""The Llama 3 two-step task fit recovers known laws, its interval covers a held-out point, and the
jaggedness flags fire on the shapes they name."""

import numpy as np
import pytest

from flopwise.errors import DataError
from flopwise.scale.tasks import TaskPoints, fit_task, jaggedness, plot_tasks, predict_task, read_task_table


def synthetic(seed=0, noise=0.01):
    """A known ground truth: NLL = exp(3) * C^-0.08, acc = 0.25 + 0.75 / (1 + exp(4 (NLL - 1.1)))."""
    rng = np.random.default_rng(seed)
    flops = np.geomspace(1e12, 1e14, 9)
    nll = np.exp(3.0) * flops**-0.08
    acc = 0.25 + 0.75 / (1 + np.exp(4 * (nll - 1.1)))
    return TaskPoints("t", flops, acc + rng.normal(0, noise, 9), nll * np.exp(rng.normal(0, noise, 9)), 0.25)


def test_two_step_fit_recovers_the_generating_law():
    law = fit_task(synthetic(noise=0.0))
    assert (law.log_a, law.alpha, law.k, law.m) == pytest.approx((3.0, 0.08, 4.0, 1.1), rel=1e-4)


def test_held_out_prediction_lies_in_its_bootstrap_interval():
    p = synthetic(noise=0.01)
    target = 1e15  # 10x beyond the largest run
    truth_nll = np.exp(3.0) * target**-0.08
    truth_acc = 0.25 + 0.75 / (1 + np.exp(4 * (truth_nll - 1.1)))
    pred = predict_task(p, target, bootstrap=300, seed=0)
    assert pred.nll_interval[0] <= truth_nll <= pred.nll_interval[1]
    assert pred.acc_interval[0] <= truth_acc <= pred.acc_interval[1]
    assert pred.nll_interval[1] - pred.nll_interval[0] < 0.1


def test_jaggedness_flags():
    flops = np.geomspace(1e12, 1e14, 5)
    smooth_nll = np.array([2.0, 1.9, 1.8, 1.7, 1.6])
    jumpy = TaskPoints("j", flops, np.array([0.25, 0.25, 0.26, 0.70, 0.72]), smooth_nll, 0.25)
    assert jaggedness(jumpy)["jump"] and not jaggedness(jumpy)["inverse"]
    steady = TaskPoints("s", flops, np.array([0.3, 0.4, 0.5, 0.6, 0.7]), smooth_nll, 0.25)
    assert not jaggedness(steady)["jump"]
    inverse = TaskPoints("i", flops, np.array([0.5, 0.45, 0.4, 0.38, 0.35]), smooth_nll[::-1].copy(), 0.25)
    assert jaggedness(inverse)["inverse"]


def test_table_io_and_plot(tmp_path):
    p = synthetic()
    rows = ["name,flops,task,acc,nll,chance"] + [
        f"r{i},{c},t,{a},{n},0.25" for i, (c, a, n) in enumerate(zip(p.flops, p.acc, p.nll, strict=True))
    ]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    tasks = read_task_table(tmp_path / "t.csv")
    assert np.allclose(tasks["t"].nll, p.nll) and tasks["t"].chance == 0.25
    png = plot_tasks(tasks, {"t": fit_task(tasks["t"])}, tmp_path)
    assert png.stat().st_size > 10_000
    (tmp_path / "bad.csv").write_text("name,flops\nx,1\n")
    with pytest.raises(DataError, match="needs columns"):
        read_task_table(tmp_path / "bad.csv")


def test_cli_predict_task(tmp_path):
    from typer.testing import CliRunner

    from flopwise.cli import app

    p = synthetic()
    rows = ["name,flops,task,acc,nll,chance"] + [
        f"r{i},{c},t,{a},{n},0.25" for i, (c, a, n) in enumerate(zip(p.flops, p.acc, p.nll, strict=True))
    ]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    res = CliRunner().invoke(
        app,
        [
            "scale",
            "predict-task",
            str(tmp_path / "t.csv"),
            "--flops",
            "1e15",
            "--out",
            str(tmp_path / "o"),
            "--bootstrap",
            "50",
        ],
    )
    assert res.exit_code == 0, res.output
    import json

    rec = json.loads((tmp_path / "o" / "prediction.json").read_text())["tasks"]["t"]
    assert rec["nll_interval_95"][0] <= np.exp(3.0) * 1e15**-0.08 <= rec["nll_interval_95"][1]
    assert (tmp_path / "o" / "tasks.png").is_file()


def write_table(path):
    p = synthetic()
    rows = ["name,flops,task,acc,nll,chance"] + [
        f"r{i},{c},t,{a},{n},0.25" for i, (c, a, n) in enumerate(zip(p.flops, p.acc, p.nll, strict=True))
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_table_that_is_not_a_csv_or_holds_bad_values(tmp_path):
    """A pickle once raised UnicodeDecodeError; a negative FLOP count or text reached the log."""
    import pickle

    (tmp_path / "t.pkl").write_bytes(pickle.dumps({"flops": [1e12, 1e13]}))
    with pytest.raises(DataError, match="not a CSV"):
        read_task_table(tmp_path / "t.pkl")
    for bad, message in (
        ("r,abc,t,0.5,1.0,0.25", "row 1: non-numeric"),
        ("r,-1,t,0.5,1.0,0.25", "row 1: needs"),
        ("r,1e12,t,1.5,1.0,0.25", "row 1: needs"),
        ("r,1e12,t,0.5,0,0.25", "row 1: needs"),
    ):
        (tmp_path / "bad.csv").write_text(f"name,flops,task,acc,nll,chance\n{bad}\n")
        with pytest.raises(DataError, match=message):
            read_task_table(tmp_path / "bad.csv")


@pytest.mark.parametrize("flops", ["-1", "nan", "0"])
def test_cli_predict_task_bad_flops_writes_nothing(tmp_path, flops):
    """--flops -1 once exited 0 with NaN predictions, a RuntimeWarning and both files written."""
    import subprocess
    import sys

    table = write_table(tmp_path / "t.csv")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "flopwise",
            "scale",
            "predict-task",
            str(table),
            "--flops",
            flops,
            "--out",
            str(tmp_path / "o"),
            "--bootstrap",
            "10",
        ],
        capture_output=True,
        text=True,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and f"--flops {flops}" in lines[0], r.stderr
    assert not (tmp_path / "o").exists()


def test_cli_predict_task_pickle_table_is_one_line(tmp_path):
    import pickle
    import subprocess
    import sys

    (tmp_path / "t.pkl").write_bytes(pickle.dumps([1, 2, 3]))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "flopwise",
            "scale",
            "predict-task",
            str(tmp_path / "t.pkl"),
            "--flops",
            "1e15",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "not a CSV" in lines[0], r.stderr
    assert not (tmp_path / "o").exists()
