"""What checkpointing costs a training run on this CPU, sync vs async, and how long a kill costs.

    python benchmarks/throughput/checkpoint_cpu.py     -> benchmarks/throughput/results/checkpoint_cpu.json + a table

1. Save cost, one process: the same run (a 11.9M-parameter Llama, fp32, checkpoint every 5 steps)
   without checkpoints, with sync saves and with async saves, side by side: how long each save
   blocked the loop (sync: the whole write; async: staging to host memory plus any wait for the
   previous write), how long an async write took to complete, and the cost per save from the run
   times, (median training time - median without saves) / saves over 3 runs each, which also
   catches the background writer competing with training for the 2 cores.
2. Recovery after a kill: 2 ranks under `torchrun --max-restarts 1`, rank 1 SIGKILLed at step 8 of
   12 (checkpoints every 3 steps) vs the same job uninterrupted; the difference is detection +
   restart + reload + the 2 redone steps.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from conftest import tiny_overrides  # noqa: E402
from flopwise.checkpoints import checkpoint  # noqa: E402
from flopwise.config.schema import load_config  # noqa: E402
from flopwise.data.prepare import prepare_data  # noqa: E402
from flopwise.train.launch import train  # noqa: E402

MODEL = {
    "model.preset": '"demo-tiny"',
    "model.n_layers": 12,
    "model.d_model": 512,
    "model.n_heads": 8,
    "model.tie_embeddings": "false",
    "data.seq_len": 64,
    "train.global_batch": 8,
    "train.micro_batch": 8,
    "train.eval_every": 0,
    "log.every": 1000,
}
STEPS, EVERY, REPEATS = 30, 5, 3


def data(tmp: Path) -> Path:
    out = tmp / "shakespeare"
    prepare_data(["builtin:shakespeare"], out, tokenizer="bpe:512", val_fraction=0.1, seed=0)
    return out


def one_process(tmp: Path, d: Path, mode: str, repeat: int = 0) -> dict:
    kw = {
        **MODEL,
        "train.steps": STEPS,
        "checkpoint.interval": EVERY if mode != "none" else 0,
        "checkpoint.async": "true" if mode == "async" else "false",
        "checkpoint.keep": 1,
        "checkpoint.resume": '"none"',
    }
    run_dir = tmp / mode / str(repeat)  # a fresh run each repeat (resume=none refuses a folder with checkpoints)
    r = train(load_config(None, tiny_overrides(run_dir, d, **kw)))
    size = sum(p.stat().st_size for p in checkpoint.latest(run_dir).iterdir())
    return {
        "train_s": r.seconds,
        "checkpoint_mb": size / 1e6,
        "save_blocking_s": r.save_s,
        "async_complete_s": r.async_save_s,
    }


def median_run(tmp: Path, d: Path, mode: str) -> dict:
    """REPEATS runs of one mode: the median training time, every save's times."""
    runs = [one_process(tmp, d, mode, i) for i in range(REPEATS)]
    return {
        "train_s": statistics.median(r["train_s"] for r in runs),
        "train_s_all": [r["train_s"] for r in runs],
        "checkpoint_mb": runs[0]["checkpoint_mb"],
        "save_blocking_s": [x for r in runs for x in r["save_blocking_s"]],
        "async_complete_s": [x for r in runs for x in r["async_complete_s"]],
    }


def torchrun(tmp: Path, d: Path, name: str, faults: str) -> float:
    kw = {
        **MODEL,
        "train.steps": 12,
        "checkpoint.interval": 3,
        "train.micro_batch": 4,
        "model.n_layers": 2,
        "model.d_model": 128,
        "model.n_heads": 4,
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLOPWISE_FAULTS": faults}
    t0 = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--master-port",
            "29801",
            "-m",
            "flopwise",
            "train",
            *tiny_overrides(tmp / name, d, **kw),
        ],
        check=True,
        capture_output=True,
        env=env,
    )
    return time.perf_counter() - t0


def main() -> None:
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        d = data(tmp)
        runs = {mode: median_run(tmp, d, mode) for mode in ("none", "sync", "async")}
        saves = STEPS // EVERY
        for mode in ("sync", "async"):
            runs[mode]["cost_per_save_s"] = (runs[mode]["train_s"] - runs["none"]["train_s"]) / saves
        base, killed = torchrun(tmp, d, "reference", ""), torchrun(tmp, d, "killed", "kill:step=8:rank=1")
    result = {
        "steps": STEPS,
        "every": EVERY,
        "saves": saves,
        "runs": runs,
        "kill": {"uninterrupted_s": base, "killed_and_restarted_s": killed, "recovery_s": killed - base},
    }
    out = Path(__file__).parent / "results" / "checkpoint_cpu.json"
    out.write_text(json.dumps(result, indent=1))
    table = Table(
        title=f"checkpoint cost, {STEPS} steps, a save every {EVERY} ({runs['sync']['checkpoint_mb']:.0f} MB each)"
    )
    for col in ("mode", "train s", "cost per save s", "median blocking s", "median async complete s"):
        table.add_column(col)
    med = lambda xs: f"{statistics.median(xs):.3f}" if xs else "–"  # noqa: E731
    for mode, r in runs.items():
        table.add_row(
            mode,
            f"{r['train_s']:.2f}",
            f"{r.get('cost_per_save_s', 0):.3f}",
            med(r["save_blocking_s"]),
            med(r["async_complete_s"]),
        )
    Console().print(table)
    k = result["kill"]
    print(
        f"kill + restart: {k['killed_and_restarted_s']:.1f} s vs {k['uninterrupted_s']:.1f} s uninterrupted "
        f"-> recovery {k['recovery_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
