"""The planner's terms on the published Megatron runs, to see which term a gap sits in.

    python benchmarks/published/plan_published.py

Prints the 22B layer against Korthikanti et al. 2022 Table 4 (forward, backward with its recompute,
ms per layer, tp 8, micro-batch 4), the step breakdown of the Korthikanti Table 5 rows (MFU) and
the Narayanan et al. 2021 Table 1 rows (hardware TFLOP/s per GPU), as tests/plan/test_plan.py sets them.
"""

from __future__ import annotations

from dataclasses import replace

from flopwise.config.schema import ModelConfig
from flopwise.hardware.catalogue import get_hardware
from flopwise.layout.rules import Layout
from flopwise.plan.search import search_layouts
from flopwise.plan.shape import model_shape
from flopwise.plan.stack import STACKS
from flopwise.plan.step import estimate, layer_times

A100 = get_hardware("a100-80gb")


def megatron(n_layers, d_model, heads):
    """A Megatron-LM GPT of the published runs: vocabulary 51,200, context 2,048."""
    return ModelConfig(
        arch="gpt2", n_layers=n_layers, d_model=d_model, n_heads=heads, vocab_size=51200, max_seq_len=2048, dropout=0.1
    )


# Korthikanti Table 4: (recompute, sequence parallel) -> published forward, backward ms of one 22B layer.
TABLE4 = {
    ("none", False): (7.7, 11.9),
    ("none", True): (7.2, 11.8),
    ("selective", False): (7.7, 13.2),
    ("selective", True): (7.2, 13.1),
}
KORTHIKANTI = [
    ("22B", (48, 6144, 64), Layout(dp=1, tp=8, pp=1, micro_batch=4), 4, 41.5),
    (
        "175B",
        (96, 12288, 96),
        Layout(dp=1, tp=8, pp=8, micro_batch=1, pp_schedule="interleaved-1f1b", virtual_stages=3),
        64,
        51.4,
    ),
    (
        "530B",
        (105, 20480, 128),
        Layout(dp=1, tp=8, pp=35, micro_batch=1, pp_schedule="interleaved-1f1b", virtual_stages=3),
        280,
        56.0,
    ),
    ("1T", (128, 25600, 160), Layout(dp=1, tp=8, pp=64, micro_batch=1), 512, 56.3),
]
NARAYANAN = [
    (24, 2304, 24, 1, 1, 32, 512, 137),
    (40, 6144, 48, 8, 1, 256, 1024, 135),
    (80, 12288, 96, 8, 8, 1536, 2304, 148),
    (128, 25600, 160, 8, 64, 3072, 3072, 163),
]


def main() -> None:
    stack = STACKS["megatron-2022"]
    sh = model_shape(megatron(48, 6144, 64), 2048)
    print("22B layer vs Korthikanti Table 4 (ms): recompute, sp: fwd model/published, bwd model/published")
    for (recompute, sp), (f_pub, b_pub) in TABLE4.items():
        lt = layer_times(sh, A100, stack, 2048, 4, 8, 1, sp)
        fwd = lt.fwd + lt.tp_fwd
        bwd = lt.bwd + lt.tp_bwd + (lt.attn_fwd if recompute == "selective" else 0.0)
        print(
            f"  {recompute:9s} sp={sp!s:5s}  fwd {1e3 * fwd:5.2f}/{f_pub}  bwd {1e3 * bwd:5.2f}/{b_pub}  "
            f"(of which tp comm {1e3 * lt.tp_fwd:.2f} + {1e3 * lt.tp_bwd:.2f})"
        )
    for name, shape, layout, batch, published in KORTHIKANTI:
        lo = replace(layout, recompute="selective", sequence_parallel=True)
        e = estimate(model_shape(megatron(*shape), 2048), A100, lo, 2048, batch, stack)
        terms = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in e.time.items() if v)
        print(
            f"Korthikanti {name}: MFU {100 * e.mfu:.2f} (published {published}, {100 * e.mfu - published:+.2f} "
            f"points); step {1e3 * e.step_time:.1f} ms = {terms}"
        )
    fixed_all = {"cp": 1, "recompute": "full", "sequence_parallel": False, "zero": 0, "dp_replicate": 1}
    for layers, hidden, heads, tp, pp, gpus, batch, published in NARAYANAN:
        fixed = {**fixed_all, "tp": tp, "pp": pp, "pp_schedule": "interleaved-1f1b" if pp > 1 else "1f1b"}
        if pp > 1:
            fixed["micro_batch"] = 1
        best = search_layouts(
            model_shape(megatron(layers, hidden, heads), 2048), A100, gpus, 2048, batch, STACKS["megatron-2021"], fixed
        ).best
        print(
            f"Narayanan {layers}x{hidden}: {best.hardware_tflops:.1f} TFLOP/s (published {published}, "
            f"{100 * (best.hardware_tflops / published - 1):+.1f}%)"
        )


if __name__ == "__main__":
    main()
