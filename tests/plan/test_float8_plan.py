"""The planner's float8 speed-ups against torchao's published end-to-end table (pytorch/ao
docs/source/workflows/training.md at commit 36027d8, "e2e training benchmarks", NVIDIA H100):
torchtitan, Llama 3 8B on 8 H100s, FSDP2, batch 1 per GPU, seq 8192, torch.compile, per-op
selective activation checkpointing; median tokens/s per GPU: bf16 6150, tensorwise with float8
all-gather 7689.5, rowwise with bf16 all-gather 6768. benchmarks/published/plan_float8_published.py prints
the same comparison with the step's terms.

Per-op SAC is none of the planner's recompute modes, so every mode is held to the table. The
tolerance, 8% on each speed-up: the planner's H100 tables are one shape each, measured on an
H200 (hardware.hopper_calibration), the run is another engine on Meta's H100s, and torchao's own
tables of this benchmark put the tensorwise speed-up 4.7% apart (1.195 in pytorch/ao#1793 as first
proposed, 1.250 in the docs).
"""

import math
import statistics

import pytest

from flopwise.config.schema import ModelConfig
from flopwise.hardware.catalogue import get_hardware
from flopwise.layout.rules import Layout
from flopwise.plan import float8_speedup as float8_linear
from flopwise.plan.step import evaluate_layout
from tests.conftest import FIXTURES

PUBLISHED = {"none": 6150.0, "tensorwise": 7689.5, "rowwise": 6768.0}  # tokens/s per GPU
TOLERANCE = 0.08


def planned(recompute: str) -> dict[str, float]:
    """Tokens/s per GPU the planner gives the published run, per train.float8 recipe."""
    m, hw = ModelConfig(preset="llama3-8b"), get_hardware("h100-sxm")
    lo = Layout(dp=8, zero=3, micro_batch=1, recompute=recompute)
    return {r: evaluate_layout(m, hw, lo, 8192, 8, compile=True, float8=r).tokens_per_s / 8 for r in PUBLISHED}


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_llama3_8b_float8_speedups_match_torchaos_table(recompute):
    tok = planned(recompute)
    assert tok["tensorwise"] > tok["rowwise"] > tok["none"]
    for faster, slower in [("tensorwise", "none"), ("rowwise", "none"), ("tensorwise", "rowwise")]:
        predicted, published = tok[faster] / tok[slower], PUBLISHED[faster] / PUBLISHED[slower]
        assert predicted == pytest.approx(published, rel=TOLERANCE), (faster, slower)


# torchao's per-shape table (tests/fixtures/torchao_float8_rowwise_h100.json, transcribed from pytorch/ao
# docs/static/fp8-rowwise-perf.png at commit fdddb2cfa with its citation): rowwise float8 vs bf16
# speed-up of a compiled LayerNorm -> Linear -> Sigmoid, forward + backward, summed GPU kernel time, on
# Meta's 2.4 TB/s H100, for M, K, N each in 1024 ... 32768. The planner's side is
# flopwise.plan.float8_speedup (its docstring says what is booked and what is not).
TORCHAO_TABLE = FIXTURES / "torchao_float8_rowwise_h100.json"


def planned_rowwise() -> list[tuple[tuple[int, int, int], float, float]]:
    """(M, K, N), published speed-up, the planner's, on the table's GPU."""
    doc, table = float8_linear.published(TORCHAO_TABLE)
    hw = float8_linear.table_gpu(doc)
    return [(s, pub, float8_linear.speedup(*s, hw, "rowwise")) for s, pub in table.items()]


def test_rowwise_linear_pays_where_torchaos_table_says_it_does():
    """The planner's float8 question, does it pay for this shape: on each of the 216 shapes where the
    table is more than 10% from even, the planner is on the same side of 1 (it is on the wrong side of
    12 of them with the catalogue's 3.35 TB/s H100 instead of the table's 2.4 TB/s one). 10%: the
    table's own cell-to-cell scatter, |log| of a cell against the mean of its two neighbours along N,
    has median 0.037 and 90th percentile 0.082."""
    rows = planned_rowwise()
    assert len(rows) == 216
    wrong = [(s, pub, round(p, 2)) for s, pub, p in rows if (pub >= 1.1 and p <= 1) or (pub <= 0.9 and p >= 1)]
    assert not wrong


def test_rowwise_linear_speedups_match_torchaos_table_where_float8_can_pay():
    """Where the linear's output is at least 4096 wide (144 shapes, every one where the table shows a
    gain) the planner's speed-up is the table's within a median |log ratio| of 0.10 (reads 0.079)
    with no bias beyond 0.08 (reads +0.066). 0.10 is 2.7 times the table's own cell-to-cell scatter
    (previous test) and leaves room for the device: the planner's H100 GEMM shares are the H200's
    measured ones (hardware.hopper_calibration), not measured on the table's H100 variant. The bias read -0.001
    (median 0.051) while the H200's memory-bound rate was 3.28 TB/s; booking FSDP2's copies and the
    clip's kernels from the same profile raised that rate to 3.96 TB/s, which the float8 casts, scaled
    to this GPU, do not reach: the planner now overrates float8 here by 7% on average.
    Not held: narrower outputs (N <= 2048), where float8 loses everywhere in the table and the
    planner, though on the right side of 1, promises more speed than measured (median |log ratio|
    0.26, i.e. 30%; benchmarks/published/results/plan_float8_linear.json): the float8 side
    costs more there than the planner books (casts at its streaming rate, GEMMs at the fp8 peak's
    share). A fixed 2 us per cast kernel (torchao's roofline, KERNEL_LAUNCH_OVERHEAD_SEC) would
    close about a quarter of that; no kernel-level figure at hand explains the rest."""
    logs = [math.log(p / pub) for (_, _, n), pub, p in planned_rowwise() if n >= 4096]
    assert len(logs) == 144
    assert statistics.median(abs(x) for x in logs) <= 0.10
    assert abs(statistics.fmean(logs)) <= 0.08


def test_plan_says_whether_the_float8_asked_for_pays():
    """`flopwise plan` with train.float8 set (no search over it) sets its best layout beside the same
    layout without float8, and its verdict agrees with torchao's published figures: Llama 3 8B on 8
    H100s pays (the e2e table: rowwise 1.10x); GPT-2 124M does not (its linears are 768 and 3072
    wide: in the per-shape table every cell with K = 1024 and N <= 4096 at M = 8192, its 8 x 1024
    tokens, is below 1)."""
    from flopwise.config.schema import load_config
    from flopwise.plan.planner import plan

    _, table = float8_linear.published(TORCHAO_TABLE)
    cells = [pub for (m, k, n), pub in table.items() if m == 8192 and k == 1024 and n <= 4096]
    assert len(cells) == 3 and max(cells) < 1
    for preset, seq, pays in [("llama3-8b", 8192, True), ("gpt2-124m", 1024, False)]:
        cfg = load_config(
            None,
            [
                f'model.preset="{preset}"',
                f"data.seq_len={seq}",
                "train.global_batch=64",
                'cluster.hardware="h100-sxm"',
                "cluster.gpus=8",
                'train.float8="rowwise"',
            ],
        )
        note = plan(cfg, keep=1).float8_note()
        assert note.startswith("float8 pays" if pays else "float8 does not pay"), note
        assert "the same layout in bf16" in note
