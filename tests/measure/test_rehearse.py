"""`plan --rehearse`: one rank of a world of 1,024 built by `flopwise train`'s own build and stepped
on fake tensors, its bytes set beside the planner's account of the same rank (plan.rank), which
was checked against real runs on its own (tests/dist/jobs.py, `plan measure`). Where the two part
by more than 5%, the test names the finding and fails once they agree (strict xfail).

The model is wide enough (rows of 2,048) that FSDP2 shards 1,024 ways without padding, which
the planner does not book."""

from __future__ import annotations

import functools

import pytest

from flopwise.cli.plan import route
from flopwise.layout.rules import Layout
from flopwise.measure.rehearse import CATEGORIES, distinct_ranks, rehearse_plan

MODEL = [
    "model.preset=demo-small",
    "model.n_layers=4",
    "model.d_model=2048",
    "model.ffn_dim=4096",
    "model.n_heads=16",
    "model.n_kv_heads=8",
    "model.vocab_size=8192",
    "data.seq_len=256",
    "train.global_batch=1024",
    "train.micro_batch=1",
]
LAYOUTS = {
    "fsdp2-tp": ["parallel.dp=512", "parallel.tp=2", "parallel.zero=2"],
    "zero3": ["parallel.dp=1024", "parallel.zero=3"],
    "pp-fsdp2-tp": ["parallel.pp=4", "parallel.dp=128", "parallel.tp=2", "parallel.zero=2"],
}
# (layout, category): why rehearsal and plan still part (the report of issue 52 has the figures)
KNOWN = {
    ("pp-fsdp2-tp", "peak"): "under 1F1B the rehearsed first-step peak is 1.6-1.8x the planned one "
    "(317/187, 205/131, 245/140 MB) although the planner now books the receive buffers a first step "
    "allocates; under interleaved 1F1B at Llama 3 405B's layout the two agree within 2.5% (docs/"
    "planning.md), and on a real pp2 run (plan measure) the planner is within 1.3% of both ranks' "
    "measured peaks, so the rehearsal keeps something a real 1F1B stage frees",
}


@functools.cache
def _rehearsed(layout: str) -> dict:
    return rehearse_plan(None, [*MODEL, *LAYOUTS[layout]])


def _cases():
    for layout in LAYOUTS:
        for q in CATEGORIES:
            why = KNOWN.get((layout, q))
            marks = [pytest.mark.slow] + ([pytest.mark.xfail(strict=True, reason=why)] if why else [])
            yield pytest.param(layout, q, marks=marks, id=f"{layout}-{q}")


@pytest.mark.parametrize(("layout", "category"), list(_cases()))
def test_rehearsal_agrees_with_plan(layout, category):
    """Every distinct rank of the layout, rehearsed as a rank of 1,024, holds what the planner
    books for it within 5%, category by category."""
    report = _rehearsed(layout)
    assert report["world"] == 1024
    for r in report["ranks"]:
        assert "error" not in r, r["error"]
        want, got = r["planned"][category], r["rehearsed"][category]
        assert got == pytest.approx(want, rel=0.05), (r["rank"], category, got, want)


@pytest.mark.slow
def test_pipeline_rehearses_every_distinct_stage():
    """First, middle and last pipeline stage, each with its own layers (the engine's split)."""
    report = _rehearsed("pp-fsdp2-tp")
    assert [(r["rank"], r["stage"], r["layers"]) for r in report["ranks"]] == [
        (0, 0, [0]),
        (512, 2, [2]),
        (768, 3, [3]),
    ]
    for r in report["ranks"]:  # each boundary's activations and gradients, as plan.comm counts them
        for kind in ("send", "recv"):
            c = r["collectives"][kind]
            assert c["rehearsed_elements"] == c["planned_elements"] > 0, (r["rank"], kind)


def test_distinct_ranks_are_the_first_middle_and_last_stage():
    lo = Layout(dp=128, tp=8, pp=16, zero=2)
    assert distinct_ranks(lo) == [0, 8 * 1024, 15 * 1024]
    assert distinct_ranks(Layout(dp=8)) == [0]


def test_rehearse_flag_routes_to_its_command():
    commands = {"search", "measure", "rehearse"}
    assert route(["a=1", "--rehearse", "--json"], commands) == ["rehearse", "a=1", "--json"]
    assert route(["a=1"], commands) == ["search", "a=1"]


@pytest.mark.slow
def test_train_rehearse_rehearses_and_trains_nothing(cli, tmp_path):
    """`flopwise train KEY=VALUE... --rehearse` is the plan's rehearsal of the same run: the table,
    the rank's states beside the planner's, and no run folder, data or checkpoint made."""
    run_dir = tmp_path / "run"
    r = cli(
        "train",
        "model.preset=demo-tiny",
        "parallel.dp=64",
        "parallel.zero=3",
        "train.global_batch=64",
        "train.micro_batch=1",
        "data.seq_len=128",
        f'run.dir="{run_dir}"',
        "--rehearse",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "one step of each rank below as rank r of 64" in r.stdout
    assert "parameters" in r.stdout and "+0.0%" in r.stdout  # FSDP2 shards: planned = rehearsed
    assert not run_dir.exists()
