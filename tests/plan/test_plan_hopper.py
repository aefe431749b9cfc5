"""The built-in H100/H200 time tables against the H200 runs this project recorded (one lent H200,
2026-12-04, torch 2.11: tests/fixtures/h200/gpu_llama1b_*.json, benchmarks/gpu/llama1b.md).

The tables come from the kernel profile of one of those runs (flopwise.measure.hopper_tables; printed by
benchmarks/published/hopper_tables.py): the first test ties the shipped numbers to that recording, so they can
be re-derived rather than trusted. The reference for the step time is the wall clock of the other
recorded runs, which the tables were not taken from (another batch size, another data-parallel wrapper).
"""

import json

import pytest

from flopwise.hardware.catalogue import get_hardware
from flopwise.measure import hopper_tables as hopper
from tests.conftest import FIXTURES


def _rows(c) -> list[float]:
    return [x for name in ("gemm", "attention", "elementwise", "optimizer") for row in getattr(c, name) for x in row]


def test_built_in_h200_tables_are_the_recorded_profile():
    profiled = json.loads((FIXTURES / "h200" / "gpu_llama1b_z3_b8.json").read_text())
    assert _rows(get_hardware("h200").calibration) == pytest.approx(_rows(hopper.derive(profiled)), rel=2e-3)


@pytest.mark.parametrize(
    ("run", "within"), [("gpu_llama1b_z3_b16", 0.05), ("gpu_llama1b_z0_b8", 0.05), ("gpu_llama1b_z0_b8_eager", 0.13)]
)
def test_h200_step_time_of_runs_the_tables_were_not_taken_from(run, within):
    """measured/predicted: 1.038, 1.043 and 1.111 (A100's assumed shares left the compiled runs
    1.09-1.10). One memory-bound rate, from the compiled profile, where a third of that time is
    large copies (FSDP2's, the clip's foreach kernels); the eager run's element-wise work is the
    planner's op-by-op count, fitted to nothing here, in many smaller kernels that this rate
    overrates (1.40 before that count; 1.08 while FSDP2's copies, autocast's weight casts and the
    clip went unbooked and the rate absorbed the compiled runs' missing bytes)."""
    rec = json.loads((FIXTURES / "h200" / f"{run}.json").read_text())
    cfg = hopper.run_config(rec["batch"], 3 if "fsdp2" in rec["layout"] else 0, rec["compile"])
    predicted, _ = hopper.predict(cfg, get_hardware("h200"))
    assert rec["median_step_s"] / predicted == pytest.approx(1.0, abs=within)
