"""The planner's float8 prediction beside two measurements made outside the project.

    python benchmarks/published/plan_float8_published.py  ->  benchmarks/published/results/plan_float8_published.json

(1) torchao's published end-to-end table (pytorch/ao docs/source/workflows/training.md, "e2e
training benchmarks", NVIDIA H100, read at commit 36027d8): torchtitan, Llama 3 8B on 8 H100s,
FSDP2, batch 1 per GPU, seq 8192, torch.compile, per-op selective activation checkpointing; median
tokens/s per GPU and peak memory (torchtitan's max reserved, GiB) for bf16, tensorwise with float8
all-gather and rowwise with bf16 all-gather. The planner: plan.step.evaluate_layout on h100-sxm, the
llama3-8b preset, dp 8 with ZeRO 3 (FSDP2), micro-batch 1, compile on. Per-op SAC is none of the
planner's recompute modes (none; selective: the attention core; full): it keeps every SDPA output
and every other aten.mm output and recomputes the rest (wk, wo and w3 of each block, 37% of the
blocks' forward matmul FLOPs), and under float8 every linear's forward (the save list of
torchtitan's parallelize_llama.py at the time, commit 542ca77, names aten.mm, not aten._scaled_mm).
All three modes are printed; `selective` stands beside the table: its recompute (the attention
forward) is the nearest in time to the bf16 run's, its memory the nearest to the published.

(2) A microbenchmark run outside the project on an H200 (torchao 0.18): one MLP 3072→8192→3072 over 16,384
tokens, compiled, forward + backward: bf16 8.27 ms, rowwise 7.47, tensorwise 6.49. Read as two
linears with an activation between them, not a SwiGLU: a SwiGLU's three GEMMs (7.4 TFLOP) in
8.27 ms would run at 897 TFLOP/s, 91% of the dense bf16 peak, above what Hopper's bf16 GEMMs
sustain (torchao's roofline takes 78%, torchao/testing/training/roofline_utils.py); two linears
(4.9 TFLOP) need 598 TFLOP/s, 60%. The planner's terms for it: flopwise.plan.float8_speedup.linear_times, the
terms plan.step.layer_times books for a block's linears: GEMMs (plan.step.gemm_fwd_bwd at the bf16
or fp8 peak, each direction at plan.float8.scaled_mm_speed), the amax, cast and rescale bytes
(plan.float8.linear_cast_bytes, bf16 weights as a module in a microbenchmark has them) and the
activation's element-wise bytes (read + write of the 8192-wide hidden, twice that in backward, as
plan.step.layer_elementwise_bytes counts it), both at plan.step.stream_time's rate for the layer's
16,384 x 3072 activation, as layer_times streams them. Until 2026-12-05 this script streamed them at
the uncalibrated 0.8 of nominal HBM bandwidth (3.84 TB/s on an H200) instead of the H200's measured
3.28 TB/s that layer_times uses (`BEFORE_STREAM`).

Prints both tables with the planner's figures before this comparison (`BEFORE`: commit 522923a,
rowwise matmuls at tensorwise speed and no rescale pass) beside today's.
"""

from __future__ import annotations

import json
from pathlib import Path

from flopwise.config.schema import ModelConfig
from flopwise.hardware.catalogue import get_hardware
from flopwise.layout.rules import Layout
from flopwise.plan.float8_speedup import linear_times
from flopwise.plan.step import ACT_BYTES, evaluate_layout

OUT = Path(__file__).parent / "results" / "plan_float8_published.json"
RECIPES = ("none", "tensorwise", "rowwise")
MODES = ("none", "selective", "full")
SHOWN = "selective"  # the recompute mode set beside per-op SAC (module docstring)
GPUS, SEQ = 8, 8192
# (1): median tokens/s per GPU, peak memory (GiB), torchao docs at commit 36027d8
PUBLISHED = {"none": (6150.0, 47.65), "tensorwise": (7689.5, 47.77), "rowwise": (6768.0, 47.79)}
# (2): ms per forward + backward
MLP_MEASURED = {"none": 8.27, "rowwise": 7.47, "tensorwise": 6.49}
MLP_TOKENS, MLP_D, MLP_F = 16384, 3072, 8192
# this script's figures with the planner at commit 522923a (before ROWWISE_FORWARD_SPEED and the
# rowwise rescale bytes): tokens/s per GPU by recompute mode and recipe; the MLP's ms by recipe
BEFORE = {
    "e2e": {
        "none": {"none": 10268.4, "tensorwise": 12154.8, "rowwise": 11893.8},
        "selective": {"none": 9682.0, "tensorwise": 11341.7, "rowwise": 11114.1},
        "full": {"none": 8006.0, "tensorwise": 9534.9, "rowwise": 9373.4},
    },
    "mlp_ms": {"none": 7.150, "tensorwise": 4.733, "rowwise": 4.877},
}
# the MLP's ms by recipe with the casts and the activation streamed at 0.8 of nominal HBM bandwidth
BEFORE_STREAM = {"none": 7.150, "tensorwise": 4.733, "rowwise": 5.246}


def e2e() -> dict:
    """The planner on (1): per recompute mode and recipe, tokens/s per GPU, speed-up over bf16,
    memory (GiB) and the step's terms (s)."""
    m, hw = ModelConfig(preset="llama3-8b"), get_hardware("h100-sxm")
    out: dict = {}
    for mode in MODES:
        lo = Layout(dp=GPUS, zero=3, micro_batch=1, recompute=mode)
        rows = {}
        for recipe in RECIPES:
            e = evaluate_layout(m, hw, lo, SEQ, GPUS, compile=True, float8=recipe)
            rows[recipe] = {
                "tokens_per_s_per_gpu": e.tokens_per_s / GPUS,
                "memory_total_gib": e.memory["total"] / 2**30,
                "step_peak_gib": e.memory["step_peak"] / 2**30,
                "time_breakdown_s": e.time,
            }
        for r in rows.values():
            r["speedup"] = r["tokens_per_s_per_gpu"] / rows["none"]["tokens_per_s_per_gpu"]
        out[mode] = rows
    return out


def mlp() -> dict:
    """The planner's terms for (2) on an H200, ms: GEMMs, casts, activation, their sum."""
    hw = get_hardware("h200")
    t, d, f = MLP_TOKENS, MLP_D, MLP_F
    shapes = [(t, d, f), (t, f, d)]  # (M, K, N): up, then down
    hidden = 3 * 2 * ACT_BYTES * t * f  # forward r+w of the hidden, backward twice that
    out = {}
    for recipe in RECIPES:
        r = linear_times(shapes, hw, recipe, hidden, ACT_BYTES * t * d)
        out[recipe] = {
            "gemm_ms": 1e3 * r["gemm"],
            "cast_ms": 1e3 * r["cast"],
            "activation_ms": 1e3 * r["elementwise"],
            "total_ms": 1e3 * r["total"],
            "measured_ms": MLP_MEASURED[recipe],
        }
    for recipe, r in out.items():
        r["speedup"] = out["none"]["total_ms"] / r["total_ms"]
        r["measured_speedup"] = MLP_MEASURED["none"] / r["measured_ms"]
        r["before_speedup"] = BEFORE["mlp_ms"]["none"] / BEFORE["mlp_ms"][recipe]
        r["before_stream_speedup"] = BEFORE_STREAM["none"] / BEFORE_STREAM[recipe]
    return out


def main() -> None:
    planner, terms = e2e(), mlp()
    pub_base = PUBLISHED["none"][0]
    print(
        f"(1) Llama 3 8B, 8x H100, FSDP2, b 1, seq {SEQ}, compile: torchao/torchtitan published (per-op SAC) "
        f"vs planner ({SHOWN}); speed-up over bf16 [before]; the other modes' speed-ups"
    )
    print(
        f"  {'recipe':10s} {'pub tok/s':>9s} {'pub x':>6s} {'plan tok/s':>10s} {'plan x':>7s} {'[before]':>8s} "
        f"{'none x':>7s} {'full x':>7s} {'pub GiB':>8s} {'plan GiB':>8s}"
    )
    for recipe in RECIPES:
        tok, mem = PUBLISHED[recipe]
        p = planner[SHOWN][recipe]
        before = BEFORE["e2e"][SHOWN]
        print(
            f"  {recipe:10s} {tok:9.0f} {tok / pub_base:6.3f} {p['tokens_per_s_per_gpu']:10.0f} "
            f"{p['speedup']:7.3f} {before[recipe] / before['none']:8.3f} {planner['none'][recipe]['speedup']:7.3f} "
            f"{planner['full'][recipe]['speedup']:7.3f} {mem:8.2f} {p['memory_total_gib']:8.2f}"
        )
    print(
        "(2) MLP 3072->8192->3072 (two linears), 16,384 tokens, H200, fwd+bwd ms: planner terms vs measured; "
        "[before]: commit 522923a; [0.8 bw]: casts and activation at 0.8 of nominal HBM bandwidth"
    )
    print(
        f"  {'recipe':10s} {'gemm':>6s} {'cast':>6s} {'act':>6s} {'total':>6s} {'meas':>6s} {'plan x':>7s} "
        f"{'[before]':>8s} {'[0.8 bw]':>8s} {'meas x':>7s}"
    )
    for recipe, r in terms.items():
        print(
            f"  {recipe:10s} {r['gemm_ms']:6.2f} {r['cast_ms']:6.2f} {r['activation_ms']:6.2f} {r['total_ms']:6.2f} "
            f"{r['measured_ms']:6.2f} {r['speedup']:7.3f} {r['before_speedup']:8.3f} "
            f"{r['before_stream_speedup']:8.3f} {r['measured_speedup']:7.3f}"
        )
    OUT.write_text(
        json.dumps(
            {
                "published_e2e": {
                    k: {"tokens_per_s_per_gpu": v[0], "peak_memory_gib": v[1], "speedup": v[0] / pub_base}
                    for k, v in PUBLISHED.items()
                },
                "published_source": "pytorch/ao docs/source/workflows/training.md @36027d8, "
                "e2e training benchmarks, H100",
                "planner_e2e": planner,
                "planner_e2e_shown": SHOWN,
                "mlp": terms,
                "before": BEFORE,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
