"""Per-step time and per-rank memory of each parallel layout on CPU/gloo, for one fixed small model,
and model-state memory per rank against dp for ZeRO 0-3 next to plan.memory's prediction.

    python benchmarks/throughput/layouts_cpu.py            -> benchmarks/throughput/results/layouts_cpu.json + a table

Model states are measured at rest (after the step: ZeRO ≤ 2 parameters are whole, ZeRO-2/3 hold
shards), so under ZeRO-2 the parameter column is the shard FSDP keeps between steps. Peak RSS
includes the Python/torch runtime (~300 MB per process here) and is the max over ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import tiny_overrides  # noqa: E402
from flopwise.data.prepare import prepare_data  # noqa: E402
from flopwise.data.shards import resolve_input  # noqa: E402
from flopwise.plan.memory import model_state_bytes  # noqa: E402

MODEL = {
    "model.preset": '"demo-tiny"',
    "model.n_layers": 4,
    "model.d_model": 128,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "model.ffn_dim": 384,
    "model.tie_embeddings": "false",
    "data.seq_len": 64,
    "train.global_batch": 8,
    "train.micro_batch": 2,
    "checkpoint.interval": 0,
    "train.eval_every": 0,
}
LAYOUTS = {
    1: {"single": {}},
    2: {
        "dp2 zero0": {"parallel.zero": 0},
        "dp2 zero1": {"parallel.zero": 1},
        "dp2 zero2": {"parallel.zero": 2},
        "dp2 zero3": {"parallel.zero": 3},
        "tp2": {"parallel.tp": 2},
        "tp2 sp": {"parallel.tp": 2, "parallel.sequence_parallel": "true"},
        "pp2 1f1b": {"parallel.pp": 2},
        "pp2 interleaved v2": {
            "parallel.pp": 2,
            "parallel.virtual_stages": 2,
            "parallel.pp_schedule": '"interleaved-1f1b"',
        },
        "cp2": {"parallel.cp": 2},
    },
    4: {
        "dp4 zero0": {"parallel.zero": 0},
        "dp4 zero1": {"parallel.zero": 1},
        "dp4 zero2": {"parallel.zero": 2},
        "dp4 zero3": {"parallel.zero": 3},
        "hsdp 2x2": {"parallel.zero": 3, "parallel.dp_replicate": 2},
        "tp2 x dp2": {"parallel.tp": 2, "parallel.zero": 3},
    },
    8: {"pp2 x tp2 x dp2": {"parallel.pp": 2, "parallel.tp": 2, "parallel.zero": 3}},
}


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    data = tmp / "data"
    prepare_data([str(resolve_input("builtin:alice"))], data, tokenizer="bpe:512", val_fraction=0.1, seed=0)
    results = {}
    for world, layouts in LAYOUTS.items():
        jobs = [
            {
                "name": n,
                "kind": "bench",
                "overrides": tiny_overrides(tmp / n.replace(" ", "_"), data, **{**MODEL, "train.dtype": '"fp32"', **x}),
            }
            for n, x in layouts.items()
        ]
        spec, out = tmp / f"jobs{world}.json", tmp / f"out{world}.json"
        spec.write_text(json.dumps(jobs))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests")}
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                str(world),
                str(ROOT / "tests" / "dist" / "worker.py"),
                str(spec),
                str(out),
            ],
            check=True,
            env=env,
            capture_output=True,
        )
        results.update(json.loads(out.read_text()))
    dest = Path(__file__).parent / "results" / "layouts_cpu.json"
    dest.write_text(json.dumps(results, indent=1))
    print(
        "| layout | ranks | step (s) | tokens/s | params+grads+optimizer per rank (MB, max) "
        "| peak RSS per rank (MB, max) |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | error: {r['error'][:80]} |")
            continue
        state = max(x["params"] + x["grads"] + x["optimizer"] for x in r["ranks"])
        rss = max(x["peak_rss"] for x in r["ranks"])
        print(
            f"| {name} | {len(r['ranks'])} | {r['step_s']:.3f} | {r['tokens_per_step'] / r['step_s']:,.0f} | "
            f"{state / 1e6:.2f} | {rss / 1e6:.0f} |"
        )
    print("\n| ZeRO | dp | measured params / grads / optimizer per rank (MB) | plan.memory (MB) |")
    print("|---|---|---|---|")
    for zero in range(4):
        for dp, name in ((1, "single"), (2, f"dp2 zero{zero}"), (4, f"dp4 zero{zero}")):
            r = results[name]
            x = r["ranks"][0]
            # at rest (between steps) FSDP's ZeRO-2 keeps parameter shards, as ZeRO-3 does
            want = model_state_bytes(r["psi"], 3 if zero == 2 else zero, shard=dp, k=8, param_bytes=4, grad_bytes=4)
            print(
                f"| {zero} | {dp} | {x['params'] / 1e6:.3f} / {x['grads'] / 1e6:.3f} / {x['optimizer'] / 1e6:.3f} | "
                f"{want.params / 1e6:.3f} / {want.grads / 1e6:.3f} / {want.optimizer / 1e6:.3f} |"
            )


if __name__ == "__main__":
    main()
