"""`plan measure` on a busy machine: the "this machine is busy" note is for a run that goes ahead;
a refused one stays the house's one-line error (under load it once became two lines)."""

import os
import sys

import pytest

from flopwise.errors import ConfigError


@pytest.fixture
def busy(monkeypatch):
    """A 1-minute load average of twice the core count, whatever the machine is doing now."""
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (2.0 * cores, 1.0, 1.0))


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["measure", "--steps", "0"], "--steps=0"),
        (["measure", "parallel.tp=4", "parallel.dp=4"], "at most 8"),
        (["measure", "demo", "parallel.tp=3"], "parallel.tp=3 does not divide model.n_heads=8"),
    ],
)
def test_a_refused_measure_is_one_line_on_a_busy_machine(busy, monkeypatch, capsys, args, fragment):
    from flopwise.cli import main

    monkeypatch.setattr(sys, "argv", ["flopwise", "plan", *args])
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and fragment in err
    assert len(err.splitlines()) == 1 and err.startswith("error:") and "busy" not in err, err


def test_measure_calls_on_start_after_validation_only():
    """The hook runs for an accepted config, before the launch (the sentinel stops it there), and
    never for a refused one."""
    from flopwise.measure.step import measure_plan

    class Launching(Exception):
        pass

    def on_start():
        raise Launching

    with pytest.raises(ConfigError, match="does not divide"):
        measure_plan("demo", ["parallel.tp=3"], on_start=on_start)
    with pytest.raises(ConfigError, match="--steps=0"):
        measure_plan("demo", [], steps=0, on_start=on_start)
    with pytest.raises(Launching):
        measure_plan("demo", ["parallel.dp=2", "train.micro_batch=8"], on_start=on_start)
