"""Build a run: everything the training loop needs, ready-made, in the order that lets a model
bigger than one device start.

    config -> layout -> process group and mesh -> pre-flight (does every rank fit?) -> data
      -> meta-device model -> pipeline stages (still meta) -> parallelize (TP, CP, recompute,
         compile, FSDP; still meta) -> allocate and initialise this rank's shards only
      -> or load this rank's slices (Hugging Face safetensors, a DCP checkpoint)
      -> optimizer -> loader -> state to resume

No step allocates a full-size parameter on a rank that owns only a shard of it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from rich.markup import escape
from torch import nn

from flopwise.checkpoints import checkpoint
from flopwise.config.schema import Config
from flopwise.data.loader import TokenLoader
from flopwise.data.mixture import Source, SourceDraw, check_tokenizers, draws, mixture_fingerprint
from flopwise.data.prepare import prepare_data
from flopwise.data.shards import DATA_MANIFEST, SHARDS_FORMAT, read_index, skipped_note, tokenizer_of, tokenizer_path
from flopwise.data.tokenizer import GuardedTokenizer, load_tokenizer, special_ids, tokenizer_difference
from flopwise.errors import CheckpointError, ConfigError, DataError
from flopwise.files.ownership import add_to_manifest, folder_lock, hold_reading, real_path, why_not_ours
from flopwise.files.rundir import claim
from flopwise.flops import count_params
from flopwise.model.transformer import build_model
from flopwise.parallel import mesh
from flopwise.parallel.apply import parallelize
from flopwise.parallel.data import zero1_group
from flopwise.parallel.float8 import check_float8
from flopwise.parallel.pipeline import split_stages
from flopwise.plan.planner import resolve_layout
from flopwise.train.engine import Engine
from flopwise.train.guard import Guard
from flopwise.train.metrics import check_tensorboard
from flopwise.train.optim import build_optimizer
from flopwise.train.preflight import oom_names, record_history, resolve_recompute, run_preflight, slow_bf16_note
from flopwise.train.run import Finished, Run, check_data, check_same_job, flat, last_step, resume, resume_state

logger = logging.getLogger(__name__)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda: no CUDA device is visible; use train.device=cpu or auto")
    return torch.device(name)


# What `flopwise train` writes at the top of its run folder (rundir.claim records them there)
TRAIN_WRITES = ("config.toml", "metrics.jsonl", "loss.png", "skipped.jsonl", "tensorboard", "checkpoints")


def _is_prepared(path: str) -> bool:
    """A data source given as a prepared folder (read where it is), not a raw input to prepare."""
    return not path.startswith("builtin:") and (Path(path) / "index.json").exists()


def _data_dir_name(cfg: Config, label: str) -> str:
    """Where in the run folder a raw source is prepared: data/, or data-NAME/ in a mixture."""
    return "data" if len(cfg.data.mixture) == 1 else f"data-{label}"


def claim_run_dir(cfg: Config, run_dir: Path, world: int) -> None:
    """Claim every name this run writes in its folder before writing any (refused if a user's file
    holds one of them)."""
    data = [_data_dir_name(cfg, s.label) for s in cfg.data.mixture if not _is_prepared(s.path)]
    per_rank = [*(f"hang-rank{r}.txt" for r in range(world)), *(n for r in range(world) for n in oom_names(world, r))]
    claim(run_dir, [*TRAIN_WRITES, *data, *per_rank])


# A prepared folder's recipe.json keys and the setting each comes from, for a refusal to prepare it again
_RECIPE_KEYS = {
    "inputs": "data.path",
    "tokenizer": "data.tokenizer",
    "val_fraction": "data.val_fraction",
    "seed": "run.seed",
    "format": "the shard format",
}


def _recipe_changes(out: Path, recipe: dict) -> list[str] | None:
    """The settings that differ from the recipe `out` was prepared with ([] when it is the same);
    None where `out` holds no flopwise-prepared data (nothing there to keep)."""
    recipe_file = out / "recipe.json"
    if not (out / "index.json").is_file() or why_not_ours(out, DATA_MANIFEST) is not None or not recipe_file.is_file():
        return None
    try:
        before = json.loads(recipe_file.read_text(encoding="utf-8"))
    except ValueError:  # recorded in the manifest, so flopwise's, yet unreadable: prepare again
        return ["recipe.json (unreadable)"]
    if not isinstance(before, dict):
        return ["recipe.json (not an object)"]
    return [
        f"{_RECIPE_KEYS[k]} {before.get(k)!r} there, {recipe[k]!r} here"
        for k in _RECIPE_KEYS
        if before.get(k) != recipe[k]
    ]


def _prepared(path: str, out: Path, tokenizer: str, cfg: Config, setting: str, resumes: Path | None = None) -> Path:
    """A prepared data dir as given, or the raw input `path` prepared under `out` (kept while its
    recipe is unchanged); `setting` names the option that chose `out`'s folder, for a refusal.
    `resumes`: the checkpoint this run resumes from, trained on `out`'s data: a recipe changed
    since is refused before anything is written (preparing again would replace that data)."""
    if _is_prepared(path):
        return Path(path)
    recipe = {
        "inputs": [path],
        "tokenizer": tokenizer,
        "val_fraction": cfg.data.val_fraction,
        "seed": cfg.run.seed,
        "format": SHARDS_FORMAT,
    }  # a folder of an older format is prepared again
    changes = _recipe_changes(out, recipe)
    if changes == []:
        return out
    if changes is not None and resumes is not None:
        raise CheckpointError(
            f"checkpoint {resumes} was trained on the data in {out}, which this command would prepare again "
            f"({'; '.join(changes)}): nothing was written; "
            "give the same data settings to resume, or start fresh in another run.dir"
        )
    _refuse_before_preparing(cfg, tokenizer)
    logger.info(f"[bold]preparing data[/] {path} -> {out} (tokenizer {tokenizer})")
    stats = prepare_data(
        [path], out, tokenizer=tokenizer, val_fraction=cfg.data.val_fraction, seed=cfg.run.seed, setting=setting
    )
    add_to_manifest(
        out, DATA_MANIFEST, "recipe.json", json.dumps(recipe).encode()
    )  # the folder stays provably flopwise's
    logger.info(
        f"  {stats.documents} documents, {stats.tokens:,} tokens ({stats.splits['train']:,} train / "
        f"{stats.splits['val']:,} val), {stats.bytes / 1e6:.1f} MB in {stats.seconds:.1f} s "
        f"({stats.tokens_per_s / 1e3:.0f}k tokens/s)"
    )
    if stats.report.get("skipped"):
        logger.info(
            f"  [yellow]skipped[/]: {escape(skipped_note(stats.report['skipped']))} (report.json: skipped)",
            extra={"highlighter": None},
        )
    return out


def _refuse_before_preparing(cfg: Config, tokenizer: str) -> None:
    """What the prepared data would be refused for, said from the tokenizer before it is prepared:
    a vocabulary larger than model.vocab_size, or (a tokenizer file) not model.init_from's."""
    if tokenizer.startswith("bpe:") or not Path(tokenizer).exists():  # prepare_data says what is wrong with it
        n = tokenizer.removeprefix("bpe:")
        if n.isdigit() and int(n) > cfg.model.vocab_size:
            raise ConfigError(
                f"data.tokenizer={tokenizer} would train a {n}-token vocabulary for model.vocab_size="
                f"{cfg.model.vocab_size} embedding rows; set data.tokenizer=bpe:{cfg.model.vocab_size} or raise "
                "model.vocab_size"
            )
        return
    tok = load_tokenizer(tokenizer)
    _check_vocab(cfg, tok.get_vocab_size())
    _check_init_tokenizer(cfg, tok, f"data.tokenizer={tokenizer}")


def _check_vocab(cfg: Config, vocab: int) -> None:
    if vocab > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab}; set "
            f"model.vocab_size>={vocab}"
        )


def ensure_data(cfg: Config, run_dir: Path, setting: str = "run.dir", resumes: Path | None = None) -> list[Source]:
    """The mixture's sources as prepared data dirs. Raw inputs are prepared under <run.dir>/data
    (one source) or <run.dir>/data-NAME, claimed in the run folder first (rundir.claim: so `data
    mix` or a sweep leaves a folder that `train` accepts as flopwise's); the first fixes the
    tokenizer (bpe:VOCAB is trained on it) and every later raw source is tokenized with it.
    `setting`: the option that chose `run_dir` (run.dir; a sweep's --out), named in a refusal;
    `resumes`: the checkpoint the run resumes from (its data is never prepared again, `_prepared`)."""
    mixture = cfg.data.mixture
    tokenizer = cfg.data.tokenizer
    if raw := [_data_dir_name(cfg, s.label) for s in mixture if not _is_prepared(s.path)]:
        claim(run_dir, raw, setting)
    sources: list[Source] = []
    for s in mixture:
        out = run_dir / _data_dir_name(cfg, s.label)
        d = _prepared(s.path, out, tokenizer, cfg, setting, resumes)
        if not sources:  # a plain name inside the folder, checked before anything reads or copies it
            tokenizer = str(tokenizer_path(d).resolve())
        sources.append(Source(s.label, d, s.weight))
    check_tokenizers(sources)
    return sources


def planned_draws(cfg: Config, tokens: float | None = None) -> tuple[float, list[SourceDraw]]:
    """The planned training tokens (default: train.steps × global_batch × seq_len) and what they
    draw from each source; one writer at a time in run.dir, where raw sources are prepared."""
    planned = tokens if tokens is not None else cfg.train.steps * cfg.train.global_batch * cfg.data.seq_len
    with folder_lock(cfg.run.dir, "run.dir") as run_dir:
        return planned, draws(ensure_data(cfg, run_dir), planned)


def _check_init_tokenizer(cfg: Config, data_tok: GuardedTokenizer, what: str) -> GuardedTokenizer | None:
    """model.init_from=hf:PATH pins the model's tokenizer: data tokenized with another one (its own
    bpe:VOCAB, another model's) is refused in one line, before step 1, by vocabulary and special
    tokens (its ids would mean other tokens to the embeddings: the first loss would be about
    ln(vocab)). The model's tokenizer, or None where the folder has no tokenizer.json to compare."""
    hf = Path(cfg.model.init_from[3:]) if cfg.model.init_from else None
    if hf is None or not (hf / "tokenizer.json").is_file():
        return None
    model_tok = load_tokenizer(hf / "tokenizer.json")
    if diff := tokenizer_difference(data_tok, model_tok):
        raise DataError(
            f"{what} is another tokenizer than "
            f"model.init_from={cfg.model.init_from} "
            f"({diff}): its token ids mean other tokens to the model; prepare the data with "
            f"`flopwise data prepare INPUTS --tokenizer {hf} --out DIR`, or give data.path raw text "
            "(data.tokenizer unset: the model's)"
        )
    return model_tok


def _loaded_line(cfg: Config, tok: GuardedTokenizer | None) -> str:
    """What model.init_from brought in: source, parameters, tokenizer, and the schedule it goes on at."""
    source, o = cfg.model.init_from or "", cfg.optim
    hf = Path(source[3:])
    params = count_params(cfg.model).total
    if tok is None:
        tokens = "no tokenizer.json there (the data's is not checked against it)"
    else:
        ids = special_ids(tok, hf)
        tokens = (
            f"tokenizer {hf / 'tokenizer.json'} ({tok.get_vocab_size():,} tokens; "
            f"bos {tok.id_to_token(ids['bos'])!r}={ids['bos']}, "
            f"eos {tok.id_to_token(ids['eos'])!r}={ids['eos']})"
        )
    return (
        f"[bold]loaded[/] {escape(source)}: {cfg.model.arch}, {params:,} parameters, "
        f"context {cfg.model.max_seq_len}; {escape(tokens)}; training at lr {o.lr:g} "
        f"(warm-up {o.warmup_steps} steps, {o.schedule} to {o.min_lr:g}), seq_len {cfg.data.seq_len}"
    )


def _build_parts(cfg: Config, par: mesh.Parallel) -> list[tuple[int, nn.Module]]:
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
    engine = Engine(cfg, par, _build_parts(cfg, par), eos_id)
    return engine, build_optimizer(engine.modules, cfg.optim, zero1_group(par))


def _resume_point(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint to resume from: rank 0 verifies (checksums read every byte once) and tells
    the others, reporting any damaged newer checkpoint it skips."""
    r = cfg.checkpoint.resume
    if r == "none":
        return None
    if r != "auto":
        return checkpoint.resolve(r)
    found: list[Path | str | None] = [None]  # the checkpoint, or why there is none to resume from
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            found = [checkpoint.resume_point(run_dir, cfg.checkpoint.verify == "sha256", _report_checkpoint)]
        except CheckpointError as e:
            found = [str(e)]
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    if isinstance(found[0], str):  # every rank stops, in one line
        raise CheckpointError(found[0])
    return found[0]


def _report_checkpoint(msg: str) -> None:
    logger.warning(f"[yellow]checkpoint[/]: {escape(msg)}", extra={"highlighter": None})


@contextlib.contextmanager
def subnormals_flushed():
    """CPU arithmetic with subnormal floats flushed to zero while a run trains, as GPUs do: x86
    cores take a microcode assist per subnormal, and once AdamW's moments of tiny gradients go
    subnormal a step slows 40x (demo-tiny at vocab 4096: 0.67 s vs 0.016 s). The setting is the
    process's (the processor's state), so it is restored after: a library caller keeps its own."""
    before = torch.tensor(1e-40).item() == 0.0  # what the current setting does to a subnormal
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(before)


def build_run(cfg: Config, lock: Callable[[], object] = lambda: None) -> Run | Finished:
    """Resolve the layout, join the job, check that every rank fits its device (train.preflight:
    before the run folder or the data exist), prepare data, build this rank's shards, and restore
    the newest checkpoint (checkpoint.resume); a checkpoint at the run's end already is Finished,
    decided from its state.json before a model is built. `lock`: takes the run folder's lock (rank
    0, before its first write; the caller holds it to the command's end)."""
    run_dir = real_path(cfg.run.dir)
    torch.manual_seed(cfg.run.seed)
    world = mesh.world_size()  # torchrun's LOCAL_WORLD_SIZE: the ranks of each node, for layout=auto
    cfg = resolve_layout(cfg, cfg.model_dump(exclude_unset=True), world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    par = mesh.init(cfg, _resolve_device(cfg.train.device))
    check_same_job(flat(cfg.model_dump(mode="json")))
    check_float8(cfg, par.device)  # before anything is written
    if par.is_main and (note := slow_bf16_note(cfg, par.device)):
        logger.warning(note, extra={"highlighter": None})
    check_tensorboard(cfg.log.tensorboard)
    cfg = resolve_recompute(cfg, par)
    if (fits := run_preflight(cfg, par)) is not None:
        logger.info(fits, extra={"highlighter": None})
    record_history(cfg, par.device)
    if par.is_main:
        lock()
    # every refusal a checkpoint can give comes before the first write (the data prepared again included)
    resume_from = _resume_point(cfg, run_dir)
    if resume_from is not None:
        state = resume_state(resume_from, cfg)
    if par.is_main:
        claim_run_dir(cfg, run_dir, par.layout.world)
        sources = ensure_data(cfg, run_dir, resumes=resume_from)
        for s in sources:  # held with the run folder: no `data prepare` replaces them while it trains
            hold_reading(run_dir, s.data_dir, "data.path")
    mesh.barrier()
    if not par.is_main:
        sources = ensure_data(cfg, run_dir)  # prepared by rank 0 by now
    index = read_index(sources[0].data_dir)
    model_tok = _check_init_tokenizer(
        cfg, tokenizer_of(sources[0].data_dir), f"the tokenizer of data {sources[0].data_dir}"
    )
    _check_vocab(cfg, index["vocab_size"])
    data_fp = mixture_fingerprint(sources)
    check_same_job({"data fingerprint": data_fp})
    if resume_from is not None:  # decided from its state.json: a finished run builds and loads nothing
        check_data(resume_from, state, data_fp)
        if state["step"] >= last_step(cfg):
            return Finished(cfg, resume_from, state, index, par.is_main)
    engine, optimizer = build_engine(cfg, par, index["eos_id"])
    loader = TokenLoader(
        sources,
        "train",
        cfg.data.seq_len,
        cfg.train.global_batch,
        cfg.run.seed,
        dp_rank=par.rank("dp"),
        dp_size=par.layout.dp,
    )
    run = Run(
        cfg,
        par,
        engine,
        optimizer,
        loader,
        sources,
        index,
        tokenizer_of(sources[0].data_dir),
        Guard(cfg.guard),
        data_fp,
    )
    if cfg.model.init_from:
        logger.info(_loaded_line(cfg, model_tok), extra={"highlighter": None})
    run.resumed_from = resume_from
    if resume_from is not None:
        resume(run, resume_from)
    return run
