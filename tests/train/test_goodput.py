"""Goodput, planned and measured, in CI: the tiny model on 2 ranks under torchrun --max-restarts, one
worker SIGKILLed at a fixed time after a fixed step (flopwise.train.chaos). The run resumes from
its newest checkpoint and finishes; its account (plan.reliability.account) holds every second of the
wall time once: productive steps, lost work, restarts and checkpoint stalls, and the step-time jitter
its medians leave; and the planner's goodput fed the run's own step, write and restart times and
failure rate is above the measured one, as one failure where the model expects fewer must put it.
Whether the planner's goodput is right to 5 points needs R << M and tens of failures a run:
benchmarks/long/goodput.py (an hour: not CI), benchmarks/long/goodput.md."""

import re
from itertools import pairwise

import pytest

from flopwise.plan.reliability import goodput, measured_account
from flopwise.train.chaos import run_under_failures
from tests.conftest import tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
STEPS, INTERVAL, KILL_AT = 60, 10, (25, 0.1)  # 0.1 s after step 25's line: a load-independent place


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

    a = measured_account(t.lines, t.kills, INTERVAL)
    assert a.failures == 1 and a.restart_s is not None and a.restart_s > 0
    assert a.productive_s == pytest.approx(STEPS * a.step_s)  # every step counted new once
    cut = 0.0 if late else kill - t_before  # the work under way when the failure struck
    assert a.lost_s == pytest.approx((done - start) * a.step_s + cut)  # steps run twice, and the cut one
    saves = sum(1 for _, step in t.lines if step % INTERVAL == 0 and step < STEPS) - (done % INTERVAL == 0)
    assert a.stalls_s == pytest.approx(saves * a.stall_s)
    # The parts are counts x medians; what they leave is each ordinary gap's excess over its median
    # (the restart's gap is held whole by lost work and restart). A part counted twice or missed
    # shows here. How big the excess is depends on the load: 9.0 s of 51.2 s on a 2-core EPYC at a
    # load of 7 (CI, 2026-12-07), so it is not bounded here; benchmarks/long/goodput.py: 0.6-2.9%, quiet.
    excess = sum(
        t1 - t0 - a.step_s - (a.stall_s if s0 % INTERVAL == 0 else 0.0)
        for (t0, s0), (t1, s1) in pairwise(t.lines)
        if s1 > s0
    )
    assert a.unaccounted_s == pytest.approx(excess, abs=1e-6), a.to_json()

    # Fed M = wall / failures, the model expects under one failure for this much work (it would let
    # some strike the restart, which is most of the run: R ~ 0.7-0.8 M) where this run had exactly
    # one, so it predicts high: 0.32-0.37 against 0.13-0.18 measured in five runs on an AMX Xeon,
    # 0.33 against 0.07 on the loaded EPYC (a 37 s restart). One failure is one draw: only the
    # direction is asserted, and that the planner is the function it is.
    mtbf = a.wall_s / a.failures  # the run's own failure rate
    predicted = a.predicted(INTERVAL, mtbf)
    assert predicted == goodput(INTERVAL * a.step_s, a.stall_s, a.restart_s, mtbf)
    assert a.goodput < predicted < 1, (predicted, a.to_json())
