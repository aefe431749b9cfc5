"""The training loop: data -> step -> optimizer -> metrics -> eval -> checkpoint.

Data flows one way: the config is resolved, data prepared, the model built and parallelized, and
the loop gets them ready-made. Everything a restart needs (model, optimizer, loader position, RNG,
step; the LR schedule is a pure function of the step) is saved together and restored together, so
a resumed run reproduces the uninterrupted one step for step.
"""

from __future__ import annotations

import json
import math
import statistics
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from flopwise.config import Config, config_hash, to_toml, validate
from flopwise.data.loader import TokenLoader, eval_batches
from flopwise.data.shards import prepare, read_index, tokenizer_of
from flopwise.data.tokenizer import load_tokenizer
from flopwise.errors import CheckpointError, ConfigError, TrainingStopped
from flopwise.eval.generate import generate
from flopwise.eval.tasks import evaluate_task, load_task
from flopwise.flops import count_params, flops_per_token, mfu
from flopwise.model.transformer import Transformer, build_model
from flopwise.parallel import mesh
from flopwise.parallel.data import zero1_group
from flopwise.plan.layout import Layout
from flopwise.plan.planner import layout_config, resolve_layout
from flopwise.train.engine import Engine, autocast, token_loss
from flopwise.train import checkpoint
from flopwise.train.faults import Faults, nan_grad, poison
from flopwise.train.guard import Guard, Verdict
from flopwise.train.saver import Saver
from flopwise.train.watch import Watch, is_timeout
from flopwise.train.metrics import MetricsWriter, device_peak, plot_loss_curve, read_metrics
from flopwise.train.optim import build_optimizer, lr_at


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    tokens: int
    train_loss: float
    val_loss: float | None
    unigram_entropy: float
    tokens_per_s: float
    mfu: float
    peak_flops: float
    peak_source: str
    seconds: float
    checkpoint: Path | None
    plot: Path | None = None
    sample: str = ""
    losses: list[float] = field(default_factory=list)
    is_main: bool = True  # rank 0 of a torchrun job (the one that reports)
    preempted: int | None = None  # the step a SIGTERM/SIGUSR1 stopped the run at (checkpoint written)
    signal: str | None = None
    save_s: list[float] = field(default_factory=list)   # how long each checkpoint save blocked training
    async_save_s: list[float] = field(default_factory=list)  # async: call to complete, in the background


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda: no CUDA device is visible; use train.device=cpu or auto")
    return torch.device(name)


def ensure_data(cfg: Config, run_dir: Path, console: Console) -> Path:
    """A prepared data dir as given, or the raw input of data.path prepared under <run.dir>/data."""
    d = cfg.data
    given = Path(d.path)
    if not d.path.startswith("builtin:") and (given / "index.json").exists():
        return given
    out = run_dir / "data"
    recipe = {"inputs": [d.path], "tokenizer": d.tokenizer, "val_fraction": d.val_fraction, "seed": cfg.run.seed}
    recipe_file = out / "recipe.json"
    if recipe_file.exists() and json.loads(recipe_file.read_text()) == recipe and (out / "index.json").exists():
        return out
    console.print(f"[bold]preparing data[/] {d.path} -> {out} (tokenizer {d.tokenizer})")
    stats = prepare([d.path], out, tokenizer=d.tokenizer, val_fraction=d.val_fraction, seed=cfg.run.seed)
    recipe_file.write_text(json.dumps(recipe))
    console.print(f"  {stats.documents} documents, {stats.tokens:,} tokens ({stats.splits['train']:,} train / "
                  f"{stats.splits['val']:,} val), {stats.bytes / 1e6:.1f} MB in {stats.seconds:.1f} s "
                  f"({stats.tokens_per_s / 1e3:.0f}k tokens/s)")
    return out


def lm_loss(model: torch.nn.Module, batch: torch.Tensor, device: torch.device, dtype: str) -> torch.Tensor:
    """Mean next-token cross-entropy of a (b, s + 1) batch, computed in fp32 (one process)."""
    with autocast(device, dtype):
        return token_loss(model(batch[:, :-1].to(device)), batch[:, 1:].to(device))


def evaluate(engine: Engine, data_dir: Path, cfg: Config) -> float:
    """Mean loss over the first validation windows, in micro-batches (a pipeline evaluates
    micro_batch × its number of micro-batches at a time)."""
    rows = cfg.train.micro_batch * (engine.n_micro if engine.schedule is not None else 1)
    losses = [engine.eval_loss(b) for b in eval_batches(data_dir, cfg.data.seq_len, rows, cfg.train.eval_batches)]
    return sum(losses) / len(losses)


def _resume_point(cfg: Config, run_dir: Path, console: Console) -> Path | None:
    """The checkpoint to resume from: rank 0 verifies (checksums read every byte once) and tells
    the others, reporting any damaged newer checkpoint it skips."""
    r = cfg.checkpoint.resume
    if r == "none":
        return None
    if r != "auto":
        return checkpoint.resolve(r)
    found = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        report = lambda msg: console.print(f"[yellow]checkpoint[/]: {escape(msg)}", highlight=False)  # noqa: E731
        found = [checkpoint.latest(run_dir, cfg.checkpoint.verify == "sha256", report)]
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    return found[0]


def _restore(ckpt: Path, engine: Engine, optimizer: torch.optim.Optimizer, loader: TokenLoader) -> tuple[int, dict]:
    """Model, optimizer, data position and RNG from a checkpoint; (its step, its state)."""
    state = checkpoint.load(ckpt, engine.parts, optimizer)
    loader.load_state_dict(state["loader"])
    checkpoint.set_rng_state(state["rng"])
    return int(state["step"]), state


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=False)


def build(cfg: Config, par: mesh.Parallel, data_dir: Path | None) -> tuple[Engine, torch.optim.Optimizer, TokenLoader | None]:
    """This rank's parallelized model parts, optimizer and data loader."""
    model: Transformer = build_model(cfg.model, par.device, seed=cfg.run.seed)
    if cfg.model.init_from:  # continued pretraining: weights from Hugging Face (a resume overrides them)
        from flopwise.interop.hf import from_hf

        model.load_state_dict(from_hf(cfg.model.init_from[3:], par.device)[0].state_dict())
    engine = Engine(cfg, par, model)
    optimizer = build_optimizer(engine.modules, cfg.optim, zero1_group(par))
    loader = None if data_dir is None else TokenLoader(
        data_dir, "train", cfg.data.seq_len, cfg.train.global_batch, cfg.run.seed,
        dp_rank=par.rank("dp"), dp_size=par.layout.dp)
    return engine, optimizer, loader


def train(cfg: Config, console: Console | None = None) -> TrainResult:
    """Train on this process, or as one rank of a torchrun/srun job (rank 0 writes logs and metrics)."""
    t_start = time.perf_counter()
    run_dir = Path(cfg.run.dir)
    torch.manual_seed(cfg.run.seed)
    cfg = resolve_layout(cfg, cfg.model_dump(exclude_unset=True), mesh.world_size())
    par = mesh.init(cfg, resolve_device(cfg.train.device))
    device, lo = par.device, par.layout
    console = (console or Console()) if par.is_main else Console(quiet=True)
    if par.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        data_dir = ensure_data(cfg, run_dir, console)
    mesh.barrier()
    if not par.is_main:
        data_dir = ensure_data(cfg, run_dir, console)  # prepared by rank 0 by now
    meta = read_index(data_dir)
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"{meta['vocab_size']}; set model.vocab_size>={meta['vocab_size']}")
    tokenizer = tokenizer_of(data_dir)

    engine, optimizer, loader = build(cfg, par, data_dir)

    guard = Guard(cfg.guard)
    start_step, resumed_from = 0, _resume_point(cfg, run_dir, console)
    metrics_path = run_dir / "metrics.jsonl"
    if resumed_from is not None:
        start_step, state = _restore(resumed_from, engine, optimizer, loader)
        guard.load_state_dict(state.get("guard"))
        if par.is_main:
            kept = [r for r in read_metrics(metrics_path) if r["step"] <= start_step]
            metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        console.print(f"[bold]resumed[/] from {resumed_from} at step {start_step} "
                      f"(written by layout {_layout_name(state.get('layout', {}))})")
    elif par.is_main:
        metrics_path.unlink(missing_ok=True)
    if par.is_main:
        (run_dir / "config.toml").write_text(to_toml(cfg))

    seq, gb = cfg.data.seq_len, cfg.train.global_batch
    tokens_per_step = gb * seq
    fpt = flops_per_token(cfg.model, seq)
    peak, peak_source = device_peak(cfg.cluster.hardware, cfg.train.dtype, device)
    peak *= lo.world  # MFU is over every device in the job
    n_params = count_params(cfg.model)
    console.print(f"[bold]model[/] {n_params.total / 1e6:.2f}M params ({n_params.non_embedding / 1e6:.2f}M "
                  f"non-embedding), {fpt / 1e6:.1f} MFLOP/token (model FLOPs, 6N + attention); "
                  f"{device.type} {cfg.train.dtype}; MFU vs {peak / 1e9:.0f} GFLOP/s ({peak_source}"
                  f"{f' × {lo.world}' if lo.world > 1 else ''})")
    if lo.world > 1:
        console.print(f"[bold]layout[/] {_layout_name(lo.to_json())} on {lo.world} processes "
                      f"({dist.get_backend()}), {engine.n_micro} micro-batches of {cfg.train.micro_batch} per rank")
    writer = MetricsWriter(run_dir, cfg.log.tensorboard) if par.is_main else None
    single = lo.world == 1  # tasks and samples run a whole model in one process
    tasks = [load_task(t) for t in cfg.train.eval_tasks] if single else []
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    rank = dist.get_rank() if dist.is_initialized() else 0
    faults = Faults.from_env(rank)

    def snapshot() -> dict:
        return {"loader": loader.state_dict(), "rng": checkpoint.rng_state(), "guard": guard.state_dict(),
                "config": to_toml(cfg), "config_hash": config_hash(cfg),
                "layout": {**lo.to_json(), "world_size": lo.world}}

    saver = Saver(cfg, run_dir, engine.parts, optimizer, snapshot, {"tokenizer.json": data_dir / meta["tokenizer"]},
                  faults, console, lo.world)
    saver.last = resumed_from

    def write(record: dict) -> None:
        if writer is not None:
            writer.write(record)

    def rollback(step: int, reason: str) -> int:
        """Back to the last complete checkpoint, past the bad data; the step to go on from."""
        guard.rolled_back(reason, step + 1)
        saver.wait()
        ckpt = checkpoint.latest(run_dir, verify_checksums=False)
        if ckpt is None:
            console.print(f"[yellow]guard[/]: step {step + 1}: {escape(reason)}; no checkpoint to roll back to, update skipped")
            return step + 1
        back, state = _restore(ckpt, engine, optimizer, loader)
        guard.load_state_dict(state.get("guard"), counters=False)
        n = max(cfg.guard.skip_batches, step + 1 - back)
        ids = loader.skip(n)
        record = {"step": step + 1, "rolled_back_to": back, "reason": reason, "batches": n,
                  "windows": ids.tolist(), "documents": loader.documents(ids)}
        if par.is_main:
            with open(run_dir / "skipped.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        write({"step": step + 1, "event": "rollback", "rolled_back_to": back, "skipped_batches": n})
        console.print(f"[yellow]guard[/]: step {step + 1}: {escape(reason)}; rolled back to step {back} and skipped {n} "
                      f"batches ({len(record['documents'])} documents, listed in {run_dir / 'skipped.jsonl'})")
        return back

    losses: list[float] = []
    window_tokens, window_time, last_tps, last_mfu = 0, 0.0, 0.0, 0.0
    val_loss, preempted = None, None
    end_step = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
    watch = Watch(cfg.watchdog, run_dir, rank, device, report=lambda m: console.print(m, highlight=False))
    try:
        with watch, _progress(console) as bar:
            task = bar.add_task("train", total=cfg.train.steps, completed=start_step, info="")
            step = start_step
            while step < end_step:
                done = step + 1
                watch.beat(done)
                t0 = time.perf_counter()
                lr = lr_at(step, cfg.optim, cfg.train.steps)
                for g in optimizer.param_groups:
                    g["lr"] = lr
                batch = loader.next_batch()
                if faults.at("poison", done):
                    batch = poison(batch, cfg.model.vocab_size, done)
                loss_value = float(engine.forward_backward(batch))
                if faults.at("nan_grad", done):
                    nan_grad(engine.parts)
                faults.fire(done)
                grad_norm = engine.clip_grad_norm(clip)
                sync = watch.sync(nonfinite=not (math.isfinite(loss_value) and math.isfinite(grad_norm)),
                                  spike=guard.is_spike(loss_value), save_failed=saver.poll())
                if sync.save_failed:
                    saver.failed()
                verdict, reason = guard.decide(loss_value, sync.nonfinite, sync.spike)
                if verdict is Verdict.ROLLBACK:
                    optimizer.zero_grad(set_to_none=True)
                    step = rollback(step, reason)
                    bar.update(task, completed=step)
                    continue
                if verdict is Verdict.APPLY:
                    optimizer.step()
                else:
                    console.print(f"[yellow]guard[/]: step {done}: {reason} (loss {loss_value}, grad norm "
                                  f"{grad_norm}); update skipped", highlight=False)
                    write({"step": done, "event": "skipped_update", "reason": reason})
                optimizer.zero_grad(set_to_none=True)
                dt = time.perf_counter() - t0
                losses.append(loss_value)
                step = done
                window_tokens += tokens_per_step
                window_time += dt
                last = done == end_step
                if done % cfg.log.every == 0 or last:
                    last_tps = window_tokens / window_time
                    last_mfu = mfu(last_tps, fpt, peak)
                    ranks = {"rank_step_s": sync.rank_s, "slowest_rank": sync.slowest} if lo.world > 1 else {}
                    write({"step": done, "loss": loss_value, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": last_tps,
                           "mfu": last_mfu, "tokens": done * tokens_per_step, "step_time_s": dt, **ranks})
                    if not console.is_terminal:  # a log file gets lines, a terminal gets the live bar
                        console.print(f"step {done}/{cfg.train.steps} loss {loss_value:.4f} lr {lr:.2e} "
                                      f"grad_norm {grad_norm:.3f} {last_tps:,.0f} tok/s MFU {100 * last_mfu:.1f}%",
                                      highlight=False)
                    window_tokens, window_time = 0, 0.0
                if engine.can_eval and ((cfg.train.eval_every and done % cfg.train.eval_every == 0) or last):
                    val_loss = evaluate(engine, data_dir, cfg)
                    write({"step": done, "val_loss": val_loss})
                    for name, examples in tasks:
                        with autocast(device, cfg.train.dtype):
                            r = evaluate_task(engine.parts[0], tokenizer, name, examples, limit=cfg.train.eval_task_limit)
                        engine.parts[0].train()
                        write({"step": done, **r})
                if sync.stop or saver.due(done, last):
                    saver.save(done, list(watch.durations))
                val = f" val {val_loss:.3f}" if val_loss is not None else ""
                bar.update(task, completed=done, info=f"loss {loss_value:.3f}{val} | {last_tps:,.0f} tok/s | "
                                                     f"MFU {100 * last_mfu:.1f}%")
                if sync.stop:
                    preempted = done
                    break
            saver.wait()
    except RuntimeError as e:
        if not is_timeout(e):
            raise
        raise TrainingStopped(f"rank {rank}: a collective timed out at step {watch.step} after "
                              f"watchdog.collective_timeout_s={cfg.watchdog.collective_timeout_s:g} s (a rank hung "
                              f"or died; see {run_dir}/hang-rank*.txt); restart resumes from the last complete "
                              "checkpoint") from None
    last_ckpt = saver.last
    if writer is not None:
        writer.close()

    plot = None
    if par.is_main and metrics_path.exists() and read_metrics(metrics_path):
        plot = plot_loss_curve(metrics_path, run_dir / "loss.png", title=f"{cfg.run.name}: {n_params.total / 1e6:.1f}M params")
    sample = ""
    if cfg.train.sample_tokens and single:
        prompt = tokenizer.encode(cfg.train.sample_prompt).ids
        with autocast(device, cfg.train.dtype):
            ids = generate(engine.parts[0], prompt, cfg.train.sample_tokens, temperature=0.8, top_k=50, seed=cfg.run.seed)
        sample = tokenizer.decode(prompt + ids)
    final_loss = losses[-1] if losses else float("nan")
    if val_loss is None and start_step == end_step and engine.can_eval:
        val_loss = evaluate(engine, data_dir, cfg)
    return TrainResult(run_dir, end_step, end_step * tokens_per_step, final_loss, val_loss,
                       meta["unigram_entropy_nats"], last_tps, last_mfu, peak, peak_source,
                       time.perf_counter() - t_start, last_ckpt, plot, sample, losses, par.is_main, preempted,
                       watch.signal, saver.write_s, saver.async_s)


def _layout_name(layout: dict) -> str:
    """"pp2·tp2·dp2 zero3" style: the degrees above 1 (one process: "single")."""
    dims = [f"{k}{layout[k]}" for k in ("pp", "dp", "cp", "tp") if layout.get(k, 1) > 1]
    if layout.get("dp_replicate", 1) > 1:
        dims.append(f"hsdp{layout['dp_replicate']}")
    name = "·".join(dims) or "single"
    return name + (f" zero{layout['zero']}" if layout.get("zero") and layout.get("dp", 1) > 1 else "")


def summary_table(r: TrainResult) -> Table:
    t = Table(title="run summary", show_header=False)
    t.add_row("run dir", str(r.run_dir))
    t.add_row("steps / tokens", f"{r.steps:,} / {r.tokens:,}")
    t.add_row("final train loss", f"{r.train_loss:.4f}")
    if r.val_loss is not None:
        t.add_row("val loss (ppl)", f"{r.val_loss:.4f} ({math.exp(r.val_loss):.1f})")
    t.add_row("unigram entropy of the data", f"{r.unigram_entropy:.4f} nats/token")
    t.add_row("throughput", f"{r.tokens_per_s:,.0f} tokens/s")
    t.add_row("MFU (model FLOPs)", f"{100 * r.mfu:.1f}% of {r.peak_flops / 1e9:,.0f} GFLOP/s ({r.peak_source})")
    t.add_row("wall time", f"{r.seconds:.1f} s")
    t.add_row("checkpoint", str(r.checkpoint))
    if r.save_s:
        t.add_row("checkpoint saves", f"{len(r.save_s)}, median {statistics.median(r.save_s):.3f} s blocking training"
                  + (f" ({statistics.median(r.async_save_s):.3f} s to complete in the background)" if r.async_save_s else ""))
    if r.plot:
        t.add_row("loss curve", str(r.plot))
    return t


def _checkpoint_config(ckpt: Path, state: dict) -> Config:
    try:
        return validate(tomllib.loads(state["config"]))
    except (KeyError, tomllib.TOMLDecodeError):
        raise CheckpointError(f"checkpoint {ckpt}: state.json holds no valid config") from None


def load_for_inference(path: str | Path, device: str = "cpu"):
    """(model, config, tokenizer) from a checkpoint or a run dir: the consolidated inference path."""
    ckpt = checkpoint.resolve(path)
    cfg = _checkpoint_config(ckpt, checkpoint.read_state(ckpt))
    model = build_model(cfg.model, device)
    checkpoint.load(ckpt, model)
    model.eval()
    return model, cfg, load_tokenizer(ckpt / "tokenizer.json")


def export_checkpoint(path: str | Path, out: str | Path) -> Path:
    """Consolidate a checkpoint of any layout into a one-process one under <out>/checkpoints/
    (model, optimizer, loader position, RNG: training resumes from it with `run.dir=<out>`)."""
    ckpt = checkpoint.resolve(path)
    state = checkpoint.read_state(ckpt)
    cfg = layout_config(_checkpoint_config(ckpt, state), Layout(micro_batch=1))
    par = mesh.Parallel(Layout(micro_batch=1), None, torch.device("cpu"))
    engine, optimizer, _ = build(cfg, par, None)
    checkpoint.load(ckpt, engine.parts, optimizer)
    step = int(state.pop("step"))
    state.update(config=to_toml(cfg), config_hash=config_hash(cfg), layout={**par.layout.to_json(), "world_size": 1},
                 exported_from=str(ckpt))
    return checkpoint.save(out, step, engine.parts, optimizer, state, files={"tokenizer.json": ckpt / "tokenizer.json"})
