"""Build a run: everything the training loop needs, ready-made, in the order that lets a model
bigger than one device start.

    config -> layout -> process group and mesh -> data
      -> meta-device model -> pipeline stages (still meta) -> parallelize (TP, CP, recompute,
         compile, FSDP; still meta) -> allocate and initialise this rank's shards only
      -> or load this rank's slices (Hugging Face safetensors, a DCP checkpoint)
      -> optimizer -> loader -> state to resume

No step allocates a full-size parameter on a rank that owns only a shard of it.
"""

from __future__ import annotations

import binascii
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.markup import escape
from torch import nn

from flopwise.config import Config
from flopwise.data.loader import TokenLoader
from flopwise.data.mixture import Source, check_tokenizers, fingerprint
from flopwise.data.pipeline import prepare
from flopwise.data.shards import DATA_MANIFEST, FORMAT, read_index, tokenizer_of, tokenizer_path
from flopwise.data.tokenizer import GuardedTokenizer
from flopwise.errors import CheckpointError, ConfigError
from flopwise.manifest import add_to_manifest, why_not_ours
from flopwise.model.transformer import build_model
from flopwise.parallel import mesh
from flopwise.parallel.apply import parallelize
from flopwise.parallel.data import zero1_group
from flopwise.parallel.pipeline import split_stages
from flopwise.plan.layout import Layout
from flopwise.plan.planner import resolve_layout
from flopwise.train import checkpoint
from flopwise.train.engine import Engine
from flopwise.train.export import checkpoint_config
from flopwise.train.guard import Guard
from flopwise.train.optim import build_optimizer
from flopwise.train.rundir import claim


@dataclass
class Run:
    """One rank's share of a run, built and (if a checkpoint was found) restored."""

    cfg: Config
    par: mesh.Parallel
    engine: Engine
    optimizer: torch.optim.Optimizer
    loader: TokenLoader
    sources: list[Source]
    index: dict  # the first source's index.json (its tokenizer is every source's)
    tokenizer: GuardedTokenizer
    guard: Guard
    data_fingerprint: str = ""
    start_step: int = 0
    resumed_from: Path | None = None
    resumed_layout: dict | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda: no CUDA device is visible; use train.device=cpu or auto")
    return torch.device(name)


# What `flopwise train` writes at the top of its run folder (rundir.claim records them there)
TRAIN_WRITES = ("config.toml", "metrics.jsonl", "loss.png", "skipped.jsonl", "tensorboard", "checkpoints")


def is_prepared(path: str) -> bool:
    """A data source given as a prepared folder (read where it is), not a raw input to prepare."""
    return not path.startswith("builtin:") and (Path(path) / "index.json").exists()


def data_dir_name(cfg: Config, label: str) -> str:
    """Where in the run folder a raw source is prepared: data/, or data-NAME/ in a mixture."""
    return "data" if len(cfg.data.mixture) == 1 else f"data-{label}"


def claim_run_dir(cfg: Config, run_dir: Path, world: int) -> None:
    """Claim every name this run writes in its folder before writing any (refused if a user's file
    holds one of them)."""
    data = [data_dir_name(cfg, s.label) for s in cfg.data.mixture if not is_prepared(s.path)]
    claim(run_dir, [*TRAIN_WRITES, *data, *(f"hang-rank{r}.txt" for r in range(world))])


def _prepared(path: str, out: Path, tokenizer: str, cfg: Config, console: Console) -> Path:
    """A prepared data dir as given, or the raw input `path` prepared under `out` (kept while its
    recipe is unchanged)."""
    if is_prepared(path):
        return Path(path)
    recipe = {"inputs": [path], "tokenizer": tokenizer, "val_fraction": cfg.data.val_fraction, "seed": cfg.run.seed,
              "format": FORMAT}  # a folder of an older format is prepared again
    recipe_file = out / "recipe.json"
    if (out / "index.json").is_file() and why_not_ours(out, DATA_MANIFEST) is None and recipe_file.is_file():
        try:
            if json.loads(recipe_file.read_text(encoding="utf-8")) == recipe:
                return out
        except ValueError:  # recorded in the manifest, so flopwise's, yet unreadable: prepare again
            pass
    console.print(f"[bold]preparing data[/] {path} -> {out} (tokenizer {tokenizer})")
    stats = prepare([path], out, tokenizer=tokenizer, val_fraction=cfg.data.val_fraction, seed=cfg.run.seed)
    add_to_manifest(out, DATA_MANIFEST, "recipe.json", json.dumps(recipe).encode())  # the folder stays provably flopwise's
    console.print(f"  {stats.documents} documents, {stats.tokens:,} tokens ({stats.splits['train']:,} train / "
                  f"{stats.splits['val']:,} val), {stats.bytes / 1e6:.1f} MB in {stats.seconds:.1f} s "
                  f"({stats.tokens_per_s / 1e3:.0f}k tokens/s)")
    return out


def ensure_data(cfg: Config, run_dir: Path, console: Console) -> list[Source]:
    """The mixture's sources as prepared data dirs. Raw inputs are prepared under <run.dir>/data
    (one source) or <run.dir>/data-NAME; the first fixes the tokenizer (bpe:VOCAB is trained on it)
    and every later raw source is tokenized with it."""
    mixture = cfg.data.mixture
    tokenizer = cfg.data.tokenizer
    sources = []
    for s in mixture:
        out = run_dir / data_dir_name(cfg, s.label)
        d = _prepared(s.path, out, tokenizer, cfg, console)
        if not sources:  # a plain name inside the folder, checked before anything reads or copies it
            tokenizer = str(tokenizer_path(d).resolve())
        sources.append(Source(s.label, d, s.weight))
    check_tokenizers(sources)
    return sources


def build_parts(cfg: Config, par: mesh.Parallel) -> list[tuple[int, nn.Module]]:
    """(stage id, parallelized module) for each pipeline stage this rank runs ((0, model) without
    pipelining): split and sharded on the meta device, then only this rank's shards allocated,
    initialised, and (model.init_from=hf:PATH) overwritten with their slices of the HF weights."""
    stages = split_stages(cfg, par) if par.layout.pp > 1 else [(0, build_model(cfg.model, "meta"))]
    parts = [(sid, parallelize(m, cfg, par)) for sid, m in stages]
    if cfg.model.init_from:  # continued pretraining (a resume then overrides these weights)
        from flopwise.interop.hf import load_hf_weights

        load_hf_weights([m for _, m in parts], cfg.model.init_from[3:])
    return parts


def build_engine(cfg: Config, par: mesh.Parallel, eos_id: int | None = None) -> tuple[Engine, torch.optim.Optimizer]:
    """This rank's parallelized model parts and their optimizer (`eos_id`: where documents end,
    for data.document_mask)."""
    engine = Engine(cfg, par, build_parts(cfg, par), eos_id)
    return engine, build_optimizer(engine.modules, cfg.optim, zero1_group(par))


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


# What a resumed run must share with the checkpoint: the model, the order and shape of its data.
# Anything else (layout, steps, LR schedule tail, dtype, logging, ...) may change and is reported.
FIXED_ON_RESUME = ("model.", "data.seq_len", "train.global_batch", "run.seed")
NOT_COMPARED = ("model.preset", "model.init_from", "run.dir", "checkpoint.resume", "data.path")


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def check_resumable(ckpt: Path, state: dict, cfg: Config, data_fp: str) -> list[str]:
    """Refuse (one line naming the keys) a checkpoint of another model, data order or data; the
    keys that changed but may, to report."""
    saved = _flat(checkpoint_config(ckpt, state).model_dump(mode="json"))
    now = _flat(cfg.model_dump(mode="json"))
    changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k) and not k.startswith(NOT_COMPARED))
    fixed = [k for k in changed if k.startswith(FIXED_ON_RESUME)]
    if fixed:
        diff = ", ".join(f"{k}={saved.get(k)!r} there, {now.get(k)!r} here" for k in fixed[:4])
        raise CheckpointError(f"checkpoint {ckpt} is of another run ({diff}); resume with the same values, or start "
                              "fresh with checkpoint.resume=none or another run.dir")
    if state.get("data_fingerprint") not in (None, data_fp):
        raise CheckpointError(f"checkpoint {ckpt} was trained on other data (data fingerprint differs from "
                              "index.json here); point data.path at its data, or checkpoint.resume=none")
    return changed


def restore(run: Run, ckpt: Path, counters: bool = True) -> dict:
    """Model, optimizer, data position, RNG and guard window from a checkpoint into `run`; its
    state (counters=False: a rollback, whose guard keeps counting)."""
    state = checkpoint.load(ckpt, run.engine.parts, run.optimizer)
    parts = {"loader": lambda: run.loader.load_state_dict(_loader_state(state["loader"])),
             "rng": lambda: checkpoint.set_rng_state(state["rng"]),
             "guard": lambda: run.guard.load_state_dict(state.get("guard"), counters=counters),
             "step": lambda: state.update(step=_count(state["step"])),
             "layout": lambda: Layout.from_json(state.get("layout") or {}).name()}
    for field, apply in parts.items():
        try:  # state.json is plain data from the folder: any wrong type or value in it is a damaged checkpoint
            apply()
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RuntimeError, binascii.Error) as e:
            raise CheckpointError(f"checkpoint {ckpt}: state.json field {field!r} is malformed ({type(e).__name__}: "
                                  f"{' '.join(str(e).split())[:100]}); use another checkpoint") from None
    return state


def _loader_state(value: object) -> dict:
    """The loader's saved position, its counters checked: a negative epoch or cursor (a damaged
    state.json) would raise in numpy or loop for ever at the first batch, not here."""
    if not isinstance(value, dict) or not isinstance(value.get("sources", []), list):
        raise TypeError("not an object with a list of sources")
    _count(value.get("batches"))
    for source in value.get("sources", []):
        if not isinstance(source, dict):
            raise TypeError(f"source entry {source!r} is not an object")
        for key in ("epoch", "cursor", "taken", "n_windows"):
            _count(source.get(key))
    return value


def _count(value: object) -> int:
    """A non-negative integer counter from state.json (not a bool, float or string)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def resume(run: Run, ckpt: Path, console: Console) -> None:
    """Check that `ckpt` belongs to this run (model, data) and restore it into `run`."""
    changed = check_resumable(ckpt, checkpoint.read_state(ckpt), run.cfg, run.data_fingerprint)
    if changed:
        console.print(f"[bold]resume[/]: changed since the checkpoint: {escape(', '.join(changed))}", highlight=False)
    state = restore(run, ckpt)
    run.start_step, run.resumed_layout = state["step"], state.get("layout", {})


def build_run(cfg: Config, console: Console) -> Run:
    """Resolve the layout, join the job, prepare data, build this rank's shards, and restore the
    newest checkpoint (checkpoint.resume)."""
    run_dir = Path(cfg.run.dir)
    torch.manual_seed(cfg.run.seed)
    cfg = resolve_layout(cfg, cfg.model_dump(exclude_unset=True), mesh.world_size())
    par = mesh.init(cfg, resolve_device(cfg.train.device))
    if par.is_main:
        claim_run_dir(cfg, run_dir, par.layout.world)
        sources = ensure_data(cfg, run_dir, console)
    mesh.barrier()
    if not par.is_main:
        sources = ensure_data(cfg, run_dir, console)  # prepared by rank 0 by now
    index = read_index(sources[0].data_dir)
    if index["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"{index['vocab_size']}; set model.vocab_size>={index['vocab_size']}")
    engine, optimizer = build_engine(cfg, par, index["eos_id"])
    loader = TokenLoader(sources, "train", cfg.data.seq_len, cfg.train.global_batch, cfg.run.seed,
                         dp_rank=par.rank("dp"), dp_size=par.layout.dp)
    run = Run(cfg, par, engine, optimizer, loader, sources, index, tokenizer_of(sources[0].data_dir),
              Guard(cfg.guard), fingerprint(sources))
    run.resumed_from = _resume_point(cfg, run_dir, console)
    if run.resumed_from is not None:
        resume(run, run.resumed_from, console)
    return run
