"""The planner's float8 speed-ups against torchao's published end-to-end table (pytorch/ao
docs/source/workflows/training.md at commit 36027d8, "e2e training benchmarks", NVIDIA H100):
torchtitan, Llama 3 8B on 8 H100s, FSDP2, batch 1 per GPU, seq 8192, torch.compile, per-op
selective activation checkpointing; median tokens/s per GPU: bf16 6150, tensorwise with float8
all-gather 7689.5, rowwise with bf16 all-gather 6768. benchmarks/plan_float8_published.py prints
the same comparison with the step's terms.

Per-op SAC is none of the planner's recompute modes, so every mode is held to the table. The
tolerance, 8% on each speed-up: the planner's H100 tables are one shape each, measured on an
H200 (hardware._hopper), the run is another engine on Meta's H100s, and torchao's own tables of this benchmark put the tensorwise speed-up 4.7% apart (1.195 in
pytorch/ao#1793 as first proposed, 1.250 in the docs).
"""

import pytest

from flopwise.config import ModelConfig
from flopwise.hardware import get_hardware
from flopwise.plan.layout import Layout
from flopwise.plan.perf import evaluate

PUBLISHED = {"none": 6150.0, "tensorwise": 7689.5, "rowwise": 6768.0}  # tokens/s per GPU
TOLERANCE = 0.08


def planned(recompute: str) -> dict[str, float]:
    """Tokens/s per GPU the planner gives the published run, per train.float8 recipe."""
    m, hw = ModelConfig(preset="llama3-8b"), get_hardware("h100-sxm")
    lo = Layout(dp=8, zero=3, micro_batch=1, recompute=recompute)
    return {r: evaluate(m, hw, lo, 8192, 8, compile=True, float8=r).tokens_per_s / 8 for r in PUBLISHED}


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_llama3_8b_float8_speedups_match_torchaos_table(recompute):
    tok = planned(recompute)
    assert tok["tensorwise"] > tok["rowwise"] > tok["none"]
    for faster, slower in [("tensorwise", "none"), ("rowwise", "none"), ("tensorwise", "rowwise")]:
        predicted, published = tok[faster] / tok[slower], PUBLISHED[faster] / PUBLISHED[slower]
        assert predicted == pytest.approx(published, rel=TOLERANCE), (faster, slower)
