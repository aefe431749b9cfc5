"""Whole-checkpoint conversions between flopwise run folders and Hugging Face folders."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from flopwise.checkpoints import checkpoint
from flopwise.checkpoints.export import CheckpointTensors, checkpoint_config
from flopwise.config.schema import Config, ModelConfig, to_toml, validate
from flopwise.data.tokenizer import EOS, GuardedTokenizer, load_tokenizer, side_files, special_ids
from flopwise.errors import CheckpointError
from flopwise.files import rundir
from flopwise.files.outputs import check_folder, check_space
from flopwise.files.ownership import (
    LOCK,
    ManifestKind,
    file_record,
    files_under,
    folder_lock,
    real_path,
    remove_all_but,
    why_not_ours,
    write_manifest,
)
from flopwise.interop.hf import from_hf, write_hf

# What proves an HF folder is one flopwise exported (so a later export may replace it): every file in
# it, with size and sha256 (a name HF tools do not use, so the folder stays a plain HF folder)
_HF_MANIFEST = ManifestKind("flopwise-manifest.json", "flopwise-hf-manifest/1")


def import_hf(hf_dir: str | Path, out: str | Path, force: bool = False) -> Path:
    """HF folder -> <out>/checkpoints/step-00000000 (weights, config, tokenizer.json if present),
    added beside the checkpoints already in <out>, none of which is deleted; a step-00000000
    already there is refused unless `force` (then replaced)."""
    hf_dir = Path(hf_dir)
    out = real_path(out)
    rundir.check_claim(out, ["checkpoints"], "OUT")  # before the lock creates the folder
    with folder_lock(out, "OUT"):
        return _import_hf(hf_dir, out, force)


def _import_hf(hf_dir: Path, out: Path, force: bool) -> Path:
    # every refusal before anything is written: the output folder's (which write nothing while they
    # refuse: an existing `checkpoints` is flopwise's claimed one or refused), then the HF folder's
    rundir.check_claim(out, ["checkpoints"], "OUT")
    check_folder(out, "OUT")
    if (out / "checkpoints").exists():
        checkpoint.claim_step(out, 0, force)
    model, m = from_hf(hf_dir)
    checkpoint.claim_step(out, 0, force)
    tree = {
        "run": {"name": hf_dir.name, "dir": str(out)},
        "model": m.model_dump(exclude_none=True),
        "data": {"seq_len": min(m.max_seq_len, 2048), "tokenizer": str(hf_dir / "tokenizer.json")},
    }
    cfg = validate(tree)
    tok = hf_dir / "tokenizer.json"
    files = {"tokenizer.json": tok, **side_files(hf_dir)} if tok.is_file() else {}
    return checkpoint.save(
        out,
        0,
        model,
        None,
        {"config": to_toml(cfg), "source": str(hf_dir)},
        files=files,
        keep=None,
        replace=force,
        tmp=checkpoint.scratch_dir(out, 0),
    )


def _check_export(
    src: Path, m: ModelConfig, shapes: dict[str, tuple[int, ...]], tok, ids: dict[str, int | None]
) -> None:
    """Refuse (one line, nothing written) a checkpoint whose tensors do not fit its config (a
    missing, extra or reshaped tensor) or whose tokenizer does not fit its model (more tokens
    than embedding rows, a special token past them): its export would load wrong or not at all."""
    from flopwise.model.transformer import build_model

    want = {k: tuple(v.shape) for k, v in build_model(m, "meta").state_dict().items()}
    for name in sorted(want.keys() | shapes.keys()):
        tied_once = m.tie_embeddings and name == "output.weight" and name not in shapes
        if want.get(name) != shapes.get(name) and not tied_once:
            raise CheckpointError(
                f"convert to-hf: checkpoint {src}: tensor {name} is "
                f"{list(shapes[name]) if name in shapes else 'missing'}, its config implies "
                f"{list(want[name]) if name in want else 'none'}; nothing was written"
            )
    if tok.get_vocab_size() > m.vocab_size:
        raise CheckpointError(
            f"convert to-hf: checkpoint {src}: its tokenizer has {tok.get_vocab_size():,} tokens, "
            f"the model {m.vocab_size:,} embedding rows; nothing was written"
        )
    for key, i in ids.items():
        if i is not None and not 0 <= i < m.vocab_size:
            raise CheckpointError(
                f"convert to-hf: checkpoint {src}: {key} token id {i} is past the model's "
                f"{m.vocab_size:,} embedding rows; nothing was written"
            )


def export_hf(ckpt: str | Path, out_dir: str | Path, max_shard_bytes: int = 5 * 2**30) -> Path:
    """flopwise checkpoint (any layout) -> HF folder that `AutoModelForCausalLM.from_pretrained`
    loads as is, streamed: one safetensors shard in memory at a time (or the largest tensor)."""
    out_dir = real_path(out_dir)
    with folder_lock(out_dir, "OUT_DIR"):
        return _export_hf(ckpt, out_dir, max_shard_bytes)


def _export_hf(ckpt: str | Path, out_dir: Path, max_shard_bytes: int) -> Path:
    if reason := why_not_ours(out_dir, _HF_MANIFEST):
        raise CheckpointError(
            f"convert to-hf: {out_dir} {reason}; flopwise writes a Hugging Face folder only into a "
            "new or empty one, or one it exported before: choose another folder"
        )
    check_folder(out_dir, "OUT_DIR")
    src = checkpoint.resolve(ckpt)
    cfg = checkpoint_config(src, checkpoint.read_state(src))
    tok = load_tokenizer(src / "tokenizer.json")
    tensors = CheckpointTensors(src)
    shapes = {k.removeprefix("model."): tuple(v.size) for k, v in tensors.specs.items() if k.startswith("model.")}
    ids = special_ids(tok, src)
    _check_export(src, cfg.model, shapes, tok, ids)  # before anything is written
    # fp32 tensors and the tokenizer's files, less what an earlier export there frees
    needed = 4 * sum(math.prod(s) for s in shapes.values()) + sum(p.stat().st_size for p in _side(src)) + (1 << 20)
    check_space("OUT_DIR", out_dir, needed - sum(p.stat().st_size for p in files_under(out_dir)))
    try:
        return _write_export(src, cfg, shapes, tensors, tok, ids, out_dir, max_shard_bytes)
    except BaseException as e:  # cut short (a full disk, a signal): nothing half-written is left to block a rerun
        try:
            if isinstance(e, Exception):  # SafetensorError and torch's write errors are plain Exceptions
                check_space("OUT_DIR", out_dir, needed, e)
        finally:
            remove_all_but(out_dir, set())  # the folder was new, empty or an export of flopwise's
        raise


def _side(src: Path) -> list[Path]:
    return [src / "tokenizer.json", *side_files(src).values()]


def _write_export(
    src: Path,
    cfg: Config,
    shapes: dict[str, tuple[int, ...]],
    tensors: CheckpointTensors,
    tok: GuardedTokenizer,
    ids: dict[str, int | None],
    out_dir: Path,
    max_shard_bytes: int,
) -> Path:
    def fetch(names: list[str]) -> dict:
        got = tensors.read([f"model.{n}" for n in names])
        return {n: got[f"model.{n}"] for n in names}

    out = write_hf(
        cfg.model, shapes, fetch, out_dir, eos_id=ids["eos"], bos_id=ids["bos"], max_shard_bytes=max_shard_bytes
    )
    shutil.copyfile(src / "tokenizer.json", out / "tokenizer.json")
    kept = side_files(src)  # the model's own special tokens, chat template, generation settings, as they were
    for name, path in kept.items():
        shutil.copyfile(path, out / name)
    if "tokenizer_config.json" not in kept:  # a tokenizer flopwise trained: its end-of-text token does both
        (out / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "eos_token": tok.id_to_token(ids["eos"]) or EOS,
                    "bos_token": tok.id_to_token(ids["bos"]) or EOS,
                    "model_max_length": cfg.model.max_seq_len,
                    "clean_up_tokenization_spaces": False,
                },
                indent=1,
            )
        )
    if "generation_config.json" not in kept:
        (out / "generation_config.json").write_text(
            json.dumps({"eos_token_id": ids["eos"], "bos_token_id": ids["bos"]}, indent=1)
        )
    written = [p for p in files_under(out) if p.relative_to(out).as_posix() not in (_HF_MANIFEST.name, LOCK)]
    write_manifest(out, _HF_MANIFEST, {p.relative_to(out).as_posix(): file_record(p) for p in written}, complete=True)
    return out
