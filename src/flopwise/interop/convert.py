"""Whole-checkpoint conversions between flopwise run folders and Hugging Face folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from flopwise.checkpoints import checkpoint, rundir
from flopwise.checkpoints.export import CheckpointTensors, checkpoint_config
from flopwise.config import to_toml, validate
from flopwise.data.tokenizer import EOS, eos_id, load_tokenizer
from flopwise.errors import CheckpointError
from flopwise.interop.hf import from_hf, write_hf
from flopwise.manifest import ManifestKind, file_record, files_under, why_not_ours, write_manifest
from flopwise.outputs import check_folder

# What proves an HF folder is one flopwise exported (so a later export may replace it): every file in
# it, with size and sha256 (a name HF tools do not use, so the folder stays a plain HF folder)
HF_MANIFEST = ManifestKind("flopwise-manifest.json", "flopwise-hf-manifest/1")


def import_hf(hf_dir: str | Path, out: str | Path, force: bool = False) -> Path:
    """HF folder -> <out>/checkpoints/step-00000000 (weights, config, tokenizer.json if present),
    added beside the checkpoints already in <out>, none of which is deleted; a step-00000000
    already there is refused unless `force` (then replaced)."""
    hf_dir = Path(hf_dir)
    out = Path(out)
    # every refusal before anything is written: the output folder's (which write nothing while they
    # refuse: an existing `checkpoints` is flopwise's claimed one or refused), then the HF folder's
    rundir.check_claim(out, ["checkpoints"], "OUT")
    check_folder(out, "OUT")
    if (out / "checkpoints").exists():
        checkpoint.claim_step(out, 0, force)
    model, m = from_hf(hf_dir)
    checkpoint.claim_step(out, 0, force)
    tree = {"run": {"name": hf_dir.name, "dir": str(out)}, "model": m.model_dump(exclude_none=True),
            "data": {"seq_len": min(m.max_seq_len, 2048), "tokenizer": str(hf_dir / "tokenizer.json")}}
    cfg = validate(tree)
    tok = hf_dir / "tokenizer.json"
    files = {"tokenizer.json": tok} if tok.is_file() else {}
    return checkpoint.save(out, 0, model, None, {"config": to_toml(cfg), "source": str(hf_dir)}, files=files,
                           keep=None, replace=force, tmp=checkpoint.scratch_dir(out, 0))


def export_hf(ckpt: str | Path, out_dir: str | Path, max_shard_bytes: int = 5 * 2**30) -> Path:
    """flopwise checkpoint (any layout) -> HF folder that `AutoModelForCausalLM.from_pretrained`
    loads as is, streamed: one safetensors shard in memory at a time (or the largest tensor)."""
    out_dir = Path(out_dir)
    if reason := why_not_ours(out_dir, HF_MANIFEST):
        raise CheckpointError(f"convert to-hf: {out_dir} {reason}; flopwise writes a Hugging Face folder only into a "
                              "new or empty one, or one it exported before: choose another folder")
    check_folder(out_dir, "OUT_DIR")
    src = checkpoint.resolve(ckpt)
    cfg = checkpoint_config(src, checkpoint.read_state(src))
    tok = load_tokenizer(src / "tokenizer.json")
    tensors = CheckpointTensors(src)
    shapes = {k.removeprefix("model."): tuple(v.size) for k, v in tensors.specs.items() if k.startswith("model.")}

    def fetch(names: list[str]) -> dict:
        got = tensors.read([f"model.{n}" for n in names])
        return {n: got[f"model.{n}"] for n in names}

    eos = eos_id(tok)
    out = write_hf(cfg.model, shapes, fetch, out_dir, eos_id=eos, max_shard_bytes=max_shard_bytes)
    shutil.copyfile(src / "tokenizer.json", out / "tokenizer.json")
    eos_token = tok.id_to_token(eos) or EOS
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "bos_token": eos_token,
        "model_max_length": cfg.model.max_seq_len, "clean_up_tokenization_spaces": False}, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "bos_token_id": eos}, indent=1))
    written = [p for p in files_under(out) if p.name not in (HF_MANIFEST.name, HF_MANIFEST.name + ".tmp")]
    write_manifest(out, HF_MANIFEST, {p.relative_to(out).as_posix(): file_record(p) for p in written}, complete=True)
    return out
