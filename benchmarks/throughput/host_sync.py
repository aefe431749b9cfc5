"""Host syncs per step and steps/s of the training loop at the reference CPU shape.

    python benchmarks/throughput/host_sync.py [--steps 40] [--rounds 3] \\
        [--out benchmarks/throughput/results/host_sync.json]
    PYTHONPATH=OTHER_CHECKOUT/src python benchmarks/throughput/host_sync.py ...   # the same for another version

Reference shape (train_cpu.py's): Llama, 6 layers, d 384, 6 heads, SwiGLU 1024, vocab 4096, seq 256,
batch 8, fp32, log.every 10, no eval or checkpoint inside the timed span. Syncs are counted by
flopwise.measure.bytes.HostSyncCounter over two run lengths, so fixed start-up costs cancel:
syncs/step = (count(2n) - count(n)) / n. steps/s is wall time of the longer run's loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from flopwise.config.schema import load_config
from flopwise.measure.bytes import HostSyncCounter
from flopwise.train.launch import train

SHAPE = [
    "model.n_layers=6",
    "model.d_model=384",
    "model.n_heads=6",
    "model.n_kv_heads=6",
    "model.ffn_dim=1024",
    "model.vocab_size=4096",
    "model.max_seq_len=256",
    "data.seq_len=256",
    "train.global_batch=8",
    "train.micro_batch=8",
    'train.dtype="fp32"',
    "log.every=10",
    "train.eval_every=0",
    "train.sample_tokens=0",
    "checkpoint.interval=0",
    'checkpoint.resume="none"',
    "optim.warmup_steps=5",
]


def run(steps: int, data: str, run_dir: Path) -> tuple[int, float]:
    cfg = load_config(None, [*SHAPE, f"train.steps={steps}", f'data.path="{data}"', f'run.dir="{run_dir}"'])
    with HostSyncCounter() as c:
        r = train(cfg)
    return c.count, r.tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", default="runs/host_sync/data", help="a prepared data dir (prepared here if missing)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if not (Path(a.data) / "index.json").exists():
        from flopwise.data.prepare import prepare_data

        prepare_data(["builtin:shakespeare"], Path(a.data), tokenizer="bpe:4096", val_fraction=0.05, seed=0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="host_sync-") as tmp:  # fresh runs (resume=none refuses old ones)
        for k in range(a.rounds):
            short, _ = run(a.steps, a.data, Path(tmp) / f"short{k}")
            long, tps = run(2 * a.steps, a.data, Path(tmp) / f"long{k}")
            rows.append(
                {"syncs_per_step": (long - short) / a.steps, "tokens_per_s": tps, "steps_per_s": tps / (8 * 256)}
            )
    result = {
        "steps": a.steps,
        "rounds": rows,
        "median_steps_per_s": statistics.median(r["steps_per_s"] for r in rows),
        "syncs_per_step": rows[-1]["syncs_per_step"],
        "time": time.strftime("%Y-%m-%d %H:%M"),
    }
    print(json.dumps(result, indent=1))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
