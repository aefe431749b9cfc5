"""IsoFLOP ladders: K budgets × M model sizes around each budget's predicted optimum, one training
config per run, run here one after another (resumable) or emitted as launch commands, collected
into the table `flopwise scale fit` reads.

Every run trains for D = C/(6N) tokens with a cosine schedule whose length equals its own step
count, decaying to 10% of the peak LR (Hoffmann et al. 2022 App. B: a cosine cycle longer than
the run overstates the loss), so each point is a properly finished run of its size. N counts
non-embedding parameters and C = 6·N·D, as Kaplan et al. do: at ladder sizes of 10^5-10^6 the
embedding rows would otherwise be most of N and bend the fit.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from flopwise.config import Config, to_toml, validate
from flopwise.errors import ConfigError
from flopwise.flops import scaling_flops, scaling_tokens
from flopwise.plan.fit import load_law
from flopwise.plan.scaling import choose_shape, get_law


@dataclass
class LadderRun:
    name: str
    budget: float
    params: int  # non-embedding: at these sizes the embeddings would dominate N (Kaplan §2.1)
    tokens: int
    steps: int
    config: Config


def plan_ladder(base: Config, budgets: list[float], sizes: int, spread: float, law_name: str = "chinchilla-3",
                out: str | Path = "runs/ladder") -> list[LadderRun]:
    """Configs for every (budget, size): sizes spaced geometrically over [N_opt/√spread, N_opt·√spread]
    (sizes that round to the same shape are kept once)."""
    if sizes < 1 or spread < 1:
        raise ConfigError("--sizes must be >= 1 and --spread >= 1")
    fitted = load_law(law_name.split(":", 1)[1]) if law_name.startswith("fitted:") else None
    law = get_law(law_name, fitted)
    out = Path(out)
    tokens_per_step = base.train.global_batch * base.data.seq_len
    runs = []
    for budget in budgets:
        n_opt, _ = law.frontier(budget)
        for k in range(sizes):
            frac = 0.5 if sizes == 1 else k / (sizes - 1)
            target = n_opt * spread ** (frac - 0.5)
            shape = choose_shape(target, base.model.vocab_size, count_embeddings=False)
            n = shape.non_embedding_params
            if any(r.budget == budget and r.params == n for r in runs):
                continue  # tiny targets can round to the same shape
            steps = max(1, round(scaling_tokens(budget, n) / tokens_per_step))
            name = f"C{budget:.0e}-N{n / 1e6:.3f}M".replace("+", "")
            tree = json.loads(base.model_dump_json(exclude_none=True))
            tree["run"].update(name=name, dir=str(out / name))
            tree["data"]["path"] = str(_data_dir(base, out))
            tree["model"] = {"arch": "llama", "n_layers": shape.n_layers, "d_model": shape.d_model,
                             "n_heads": shape.n_heads, "head_dim": shape.head_dim, "ffn_dim": shape.ffn_dim,
                             "vocab_size": base.model.vocab_size, "max_seq_len": base.model.max_seq_len}
            tree["train"].update(steps=steps, eval_every=0, sample_tokens=0, stop_after=None)
            tree["train"].pop("stop_after", None)
            tree["optim"].update(schedule="cosine", min_lr=0.1 * base.optim.lr,
                                 warmup_steps=min(base.optim.warmup_steps, max(1, steps // 10)))
            tree["checkpoint"].update(interval=0, keep=1, resume="auto")
            runs.append(LadderRun(name, budget, n, steps * tokens_per_step, steps, validate(tree)))
    return runs


def _data_dir(base: Config, out: Path) -> Path:
    """The ladder shares one prepared copy of the data: the given dir, or <out>/data."""
    given = Path(base.data.path)
    return given if (given / "index.json").exists() else out / "data"


def is_finished(run: LadderRun) -> bool:
    from flopwise.train.metrics import read_metrics

    rows = read_metrics(Path(run.config.run.dir) / "metrics.jsonl")
    return any(r.get("step") == run.steps and "val_loss" in r for r in rows)


def final_val_loss(run: LadderRun) -> float:
    from flopwise.train.metrics import read_metrics

    rows = read_metrics(Path(run.config.run.dir) / "metrics.jsonl")
    return [r["val_loss"] for r in rows if "val_loss" in r][-1]


def write_configs(runs: list[LadderRun], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in runs:
        p = out / "configs" / f"{r.name}.toml"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(to_toml(r.config))
        paths.append(p)
    return paths


def collect(runs: list[LadderRun], out: Path) -> Path:
    table = out / "runs.csv"
    with open(table, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["name", "budget", "params", "tokens", "flops", "loss"])
        for r in runs:
            if is_finished(r):
                w.writerow([r.name, f"{r.budget:.6g}", r.params, r.tokens, scaling_flops(r.params, r.tokens),
                            f"{final_val_loss(r):.6f}"])
    return table


def run_ladder(base: Config, runs: list[LadderRun], out: Path, console: Console) -> Path:
    """Train every unfinished run in order (a killed sweep resumes where it stopped), then collect."""
    from flopwise.build import ensure_data
    from flopwise.train.trainer import train

    ensure_data(base, out, console)
    write_configs(runs, out)
    for i, r in enumerate(runs, 1):
        if is_finished(r):
            console.print(f"[{i}/{len(runs)}] {r.name}: done, skipped")
            continue
        console.print(f"[{i}/{len(runs)}] {r.name}: {r.params:,} params, {r.tokens:,} tokens, {r.steps} steps")
        result = train(r.config, Console(file=open(Path(r.config.run.dir).parent / ".train.log", "a")))
        console.print(f"    val loss {result.val_loss:.4f}, {result.tokens_per_s:,.0f} tok/s, {result.seconds:.0f} s")
    return collect(runs, out)


def launch_commands(paths: list[Path], nproc: int = 1) -> list[str]:
    return [f"torchrun --standalone --nproc-per-node {nproc} -m flopwise train {p}" for p in paths]


def budgets_from(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--budgets {text!r}: expected comma-separated FLOP counts, e.g. 3e12,1e13,3e13") from None
    if not values or any(v <= 0 or not math.isfinite(v) for v in values):
        raise ConfigError(f"--budgets {text!r}: budgets must be positive numbers")
    return values
