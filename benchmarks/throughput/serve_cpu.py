"""Planned against measured serving on this machine: `flopwise plan serve --measure` at a few batch
and context sizes, after `flopwise hardware calibrate` (its tables and memory bandwidth).

    python benchmarks/throughput/serve_cpu.py                          # calibrates first (minutes)
    python benchmarks/throughput/serve_cpu.py --hardware-file hw.toml  # reuse a calibration

The model is GPT-2 124M (random weights: time does not depend on the values), one device: this CPU
(on a machine with a GPU the calibration and the measurement run on CUDA, the entry named after the
GPU). Each shape: the plan's prefill of the batch's prompts and its mean decode step, beside what
the engine's KV-cache generation took here (flopwise.measure.serve): the median of --rounds runs
of the whole workload, so a row's prefill and decode are timed together, each round back to back;
the CPU seconds of the same spans beside the wall seconds (one thread: what the work cost whatever
else runs). The load average before and after each row is recorded: on a shared machine it moves
the measured side, not the planned one. Writes benchmarks/throughput/results/serve_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import tomllib
from datetime import UTC, datetime
from pathlib import Path

from flopwise.config.schema import load_config
from flopwise.measure.serve import measure_serve
from flopwise.plan.serve import plan_serve

MODEL = ["model.preset=gpt2-124m", "data.seq_len=256", "train.micro_batch=1"]
SHAPES = [  # batch, prompt tokens, cached tokens, output tokens
    (1, 128, 0, 16),
    (4, 128, 0, 16),
    (16, 64, 0, 16),
    (4, 64, 448, 16),
]


def calibrate(out: Path, device: str) -> None:
    """The tables the plan reads, at this model's training and serving shapes."""
    cmd = [sys.executable, "-m", "flopwise", "hardware", "calibrate", *MODEL, "serve.prompt_tokens=128"]
    subprocess.run([*cmd, "--out", str(out), "--device", device], check=True)


def row(hw_file: Path, hardware: str, rounds: int, batch: int, prompt: int, cached: int, output: int) -> dict:
    regime = [f"serve.batch={batch}", f"serve.prompt_tokens={prompt}", f"serve.cached_tokens={cached}"]
    cfg = load_config(
        None,
        [*MODEL, *regime, f"serve.output_tokens={output}", f"cluster.hardware={hardware}", "cluster.gpus=1"]
        + [f'cluster.hardware_file="{hw_file}"'],
    )
    plan = plan_serve(cfg)
    layout = plan.layouts[0]
    load = os.getloadavg()[0]
    measured = measure_serve(cfg, plan.hardware, layout, rounds)
    planned = {"prefill_s": layout.prefill_s, "decode_s_per_token": layout.decode_s_per_token}
    return {
        "batch": batch,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "planned": planned,
        "decode_bound": layout.decode_bound,
        "decode_terms": layout.decode_terms,
        "measured": measured,
        "load_average": [load, measured["load_average"]],
        "ratio": {
            "prefill": measured["prefill_s"] / planned["prefill_s"],
            "decode": measured["decode_s_per_token"] / planned["decode_s_per_token"],
            "prefill_cpu": measured["prefill_cpu_s"] / planned["prefill_s"],
            "decode_cpu": measured["decode_cpu_s_per_token"] / planned["decode_s_per_token"],
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hardware-file", type=Path)
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto (calibration and measurement)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each row's workload; the median is kept")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "serve_cpu.json")
    args = ap.parse_args()
    hw_file = args.hardware_file or Path(tempfile.mkdtemp(prefix="serve-cpu-")) / "hw.toml"
    if not args.hardware_file:
        calibrate(hw_file, args.device)
    hardware = next(iter(tomllib.loads(hw_file.read_text())))  # the entry calibrate wrote
    rows = []
    for shape in SHAPES:
        rows.append(row(hw_file, hardware, args.rounds, *shape))
        r, (before, after) = rows[-1], rows[-1]["load_average"]
        print(
            f"batch {r['batch']:3d} prompt {r['prompt_tokens']:4d} cached {r['cached_tokens']:4d}: prefill "
            f"{r['planned']['prefill_s']:.3f} planned, {r['measured']['prefill_s']:.3f} measured "
            f"({r['ratio']['prefill']:.2f}, CPU {r['ratio']['prefill_cpu']:.2f}); decode "
            f"{1e3 * r['planned']['decode_s_per_token']:.1f} ms planned ({r['decode_bound']}), "
            f"{1e3 * r['measured']['decode_s_per_token']:.1f} measured ({r['ratio']['decode']:.2f}, "
            f"CPU {r['ratio']['decode_cpu']:.2f}); load {before:.1f}-{after:.1f}",
            flush=True,
        )
    args.out.write_text(
        json.dumps(
            {
                "date": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
                "cores": os.cpu_count(),
                "hardware": hw_file.read_text(),
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
