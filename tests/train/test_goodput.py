"""Goodput, planned and measured, in CI: the tiny model on 2 ranks under torchrun --max-restarts, one
worker SIGKILLed at a fixed time after a fixed step (flopwise.train.chaos). The run resumes from
its newest checkpoint and finishes; its account (plan.reliability.account) splits the wall time into
productive steps, lost work, restarts and checkpoint stalls that add up to it; and the planner's
goodput fed the run's own step, write and restart times and failure rate is within BAND of the
measured one. The comparison at chosen MTBFs, with tens of failures a run, is benchmarks/goodput.py's
(an hour: not CI)."""

import re

import pytest

from flopwise.plan.reliability import account, goodput
from flopwise.train.chaos import run_under_failures
from tests.conftest import tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
STEPS, INTERVAL, KILL_AT = 60, 10, (25, 0.1)  # 0.1 s after step 25's line: a load-independent place
# The band is wide: one failure is one draw, not an expectation, and here R ~ 0.8 M (a restart takes
# most of the run). Fed M = wall / failures, the model expects about half a failure for this much work
# (some of its failures would strike restarts, which cost more) where this run had exactly one, so it
# predicts high: five runs on this 2-core machine (load 4 to 60) measured 0.13-0.18 against 0.32-0.37
# predicted, a gap of 0.17-0.19 every time. The 5-point target needs R << M and tens of failures a
# run: benchmarks/goodput.py, not CI.
BAND = 0.25


def test_a_killed_run_resumes_and_its_goodput_is_accounted_and_predicted(tiny_data, tmp_path):
    kw = {
        "train.steps": STEPS,
        "checkpoint.interval": INTERVAL,
        "train.eval_every": 0,
        "train.eval_batches": 1,
        "train.compile": "false",
    }
    step, after = KILL_AT
    t = run_under_failures(tiny_overrides(tmp_path, tiny_data, **kw), [after], from_step=step, timeout_s=600)
    out = "".join(t.output)
    assert t.returncode == 0 and len(t.kills) == 1 and t.lines[-1][1] == STEPS, out[-3000:]
    (t_before, before), kill = max(line for line in t.lines if line[0] < t.kills[0]), t.kills[0]
    after = [step for time, step in t.lines if time > kill]
    late = after[0] == before + 1 and after[1] <= after[0]  # the survivor logged a step its peer had done its part of
    done = before + late  # the last step logged before the restart
    resumed = re.search(r"resumed from \S+step-(\d+) at step (\d+)", out)
    assert resumed, out[-3000:]
    start = int(resumed[2])  # the newest complete checkpoint: the last multiple, or the one before if its save was cut
    assert start in (done // INTERVAL * INTERVAL, done // INTERVAL * INTERVAL - INTERVAL)
    assert after[int(late)] == start + 1

    a = account(t.lines, t.kills, INTERVAL)
    assert a.failures == 1 and a.restart_s is not None and a.restart_s > 0
    assert a.productive_s == pytest.approx(STEPS * a.step_s)  # every step counted new once
    cut = 0.0 if late else kill - t_before  # the work under way when the failure struck
    assert a.lost_s == pytest.approx((done - start) * a.step_s + cut)  # steps run twice, and the cut one
    saves = sum(1 for _, step in t.lines if step % INTERVAL == 0 and step < STEPS) - (done % INTERVAL == 0)
    assert a.stalls_s == pytest.approx(saves * a.stall_s)
    # the parts are counts x medians and a restart timed from the kill: they must cover the wall time
    assert abs(a.unaccounted_s) <= 0.1 * a.wall_s, a.to_json()

    mtbf = a.wall_s / a.failures  # the run's own failure rate
    predicted = a.predicted(INTERVAL, mtbf)
    assert predicted == goodput(INTERVAL * a.step_s, a.stall_s, a.restart_s, mtbf)
    assert abs(predicted - a.goodput) <= BAND, (predicted, a.to_json())
