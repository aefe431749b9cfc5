"""Checkpoints in torch.distributed.checkpoint (DCP) format, written atomically.

  <run.dir>/checkpoints/step-NNNNNNNN/
    .metadata, __*_*.distcp   model + optimizer state (DCP: sharded, reshardable on load)
    state.json                step, loader position, RNG states, config (TOML), data fingerprint
    tokenizer.json            so the checkpoint is self-contained for eval/generate/export
    manifest.json             written last: format, step, config hash, layout, every file's size and sha256

Everything is written into `step-N.tmp/`, fsynced, and renamed when complete; a folder whose
manifest does not match its files (missing, truncated, corrupted, or naming paths outside the
folder) is never taken as a checkpoint, and the newest one that does match is used instead.

Nothing user-supplied is unpickled. DCP's own reader `pickle.load`s `.metadata`, so `SafeReader`
replaces that one call with an unpickler that only builds DCP's metadata classes (a planted
pickle that names anything else is refused), after a walk of its opcodes (no bytearrays or
buffers, no length past the end), and checks every field of what it built (a damaged stream can
drop or retype any); tensors load with `weights_only=True`. DCP would
load a "bytes" entry with `torch.load(weights_only=False)`: flopwise writes none, so metadata
that declares one is refused, and every file the metadata reads must be in the manifest.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import io
import json
import logging
import math
import os
import pickle
import pickletools
import re
import secrets
import shutil
import warnings
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import TypeGuard

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from flopwise.data.tokenizer import SIDE_FILES
from flopwise.errors import CheckpointError
from flopwise.files import rundir
from flopwise.files.ownership import folder_id, written_for
from flopwise.model.init import canonical_name
from flopwise.parallel.data import local_optimizer
from flopwise.parallel.mesh import is_rank0

_MANIFEST = "manifest.json"
STATE = "state.json"
_DCP_METADATA = ".metadata"
CHECKPOINT_FORMAT = 3  # 2: no run binding; 1: no format/config hash/layout (both still readable)
_STEP_NAME = re.compile(r"step-([0-9]{8})")  # the only names discovery and retention look at
_PARTIAL = ".flopwise-partial"  # in a folder a checkpoint is written in: that folder's identity
_WRITTEN = {_PARTIAL, _DCP_METADATA, STATE, _MANIFEST, "tokenizer.json", *SIDE_FILES}  # and DCP's tensor files
_DCP_FILE = re.compile(r"__[0-9]+_[0-9]+\.distcp")
log = logging.getLogger(__name__)
_named: set[str] = set()  # what discovery and retention named as not theirs (once per process)


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def _no_link(root: Path) -> Path:
    """A run's checkpoints folder, refused in one line if it is a symlink: retention and writes never
    act on what a link points to (a user's folders there may look like checkpoint temporaries)."""
    if root.is_symlink():
        raise CheckpointError(
            f"{root} is a symbolic link; flopwise never writes or deletes through one: "
            "move it away (or make it a real folder)"
        )
    return root


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> dict:
    state: dict[str, str | list[str]] = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    def tensor(b64: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensor(s) for s in state["cuda"]])


Modules = nn.Module | list[nn.Module]


def _modules(model: Modules) -> list[nn.Module]:
    return model if isinstance(model, list) else [model]


def _named_params(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    return {canonical_name(n): p for m in modules for n, p in m.named_parameters()}


def _ties(modules: list[nn.Module]) -> dict[str, str]:
    """{alias: name} of parameters registered under a second name (a tied head: output.weight is
    tok_embeddings.weight). Why: torch's state dict lists a shared parameter under every name, so a
    tied model's checkpoint held its embedding twice (a 135M import: 652 MB where 538 MB hold it)."""
    first: dict[int, str] = {}
    ties = {}
    for m in modules:
        for raw, p in m.named_parameters(remove_duplicate=False):
            name = canonical_name(raw)
            if first.setdefault(id(p), name) != name:
                ties[name] = first[id(p)]
    return ties


def _model_state(modules: list[nn.Module]) -> dict:
    """The model's state dict with each shared parameter under its first name only (`_ties`)."""
    ties = _ties(modules)
    return {k: v for m in modules for k, v in get_model_state_dict(m).items() if k not in ties}


def _optim_state(modules: list[nn.Module], optimizer: torch.optim.Optimizer) -> dict:
    """{parameter name: {exp_avg, exp_avg_sq, step}} of the parameters this rank's optimizer steps.

    Keyed by parameter name and holding tensors laid out like their parameters (DTensor shards
    under FSDP/TP, whole tensors under DDP/ZeRO-1), so DCP reshards it across any layout. Why not
    DCP's get_state_dict: it does not take ZeroRedundancyOptimizer (ZeRO-1). Hyperparameters are
    not saved: they come from the config, and the learning rate is a function of the step."""
    opt = local_optimizer(optimizer)
    owned = {id(p) for g in opt.param_groups for p in g["params"]}
    if not opt.state:  # before the first step: materialise the state as torch does, a zero-grad step at lr 0
        params = [p for g in opt.param_groups for p in g["params"]]
        lrs = [g["lr"] for g in opt.param_groups]
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in opt.param_groups:
            g["lr"] = 0.0
        opt.step()
        for g, lr in zip(opt.param_groups, lrs, strict=True):
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
    return {name: dict(opt.state[p]) for name, p in _named_params(modules).items() if id(p) in owned}


def _run_on_main(fn: Callable[[], None]) -> str | None:
    """Run a rank-0-only file operation; every rank gets its error (or None), so all ranks agree
    on whether the checkpoint was written instead of rank 0 failing alone and the rest hanging."""
    reason = None
    if is_rank0():
        try:
            fn()
        except OSError as e:
            reason = f"{e.strerror or e} ({e.filename})" if e.filename else str(e)
    if dist.is_initialized():
        box = [reason]
        dist.broadcast_object_list(box, src=0)
        reason = box[0]
    return reason


def _fresh(tmp: Path) -> None:
    """An empty folder at `tmp` (step-N.tmp) to write a checkpoint in, marked as flopwise's
    (`_PARTIAL`). One there already is cleared only if it is a partial write flopwise made."""
    if tmp.parent.is_symlink():  # an OSError: every rank is told (_run_on_main), and the save fails in one line
        raise OSError(errno.ELOOP, "a symbolic link: flopwise never writes through one", str(tmp.parent))
    if tmp.exists() or tmp.is_symlink():
        if _is_partial(tmp):
            _remove_partial(tmp, [])
        if tmp.exists() or tmp.is_symlink():
            raise OSError(errno.EEXIST, "not a partial checkpoint flopwise made: move it away", str(tmp))
    tmp.mkdir(parents=True)
    _mark_partial(tmp)


def _mark_partial(tmp: Path) -> None:
    (tmp / _PARTIAL).write_text(json.dumps({"folder": folder_id(tmp)}))


def _is_partial(tmp: Path) -> bool:
    """`tmp` is a folder flopwise made to write a checkpoint in: its marker names this very folder
    (a copy of one, or a user's step-N.tmp, is not)."""
    try:
        return not tmp.is_symlink() and written_for(json.loads((tmp / _PARTIAL).read_text()), tmp)
    except (OSError, ValueError, AttributeError):
        return False


def _remove_partial(tmp: Path, failed: list[str]) -> None:
    """Remove what flopwise writes in a partial checkpoint (tensors, state, side files, manifest,
    the marker) and the folder if nothing else is left in it."""
    for f in tmp.iterdir():
        if f.name in _WRITTEN or _DCP_FILE.fullmatch(f.name):
            try:
                f.unlink()
            except OSError as e:
                failed.append(f"{f} ({e.strerror})")
    _rmdir_or_name(tmp)


def _content(model: Modules, optimizer: torch.optim.Optimizer | None) -> dict:
    modules = _modules(model)
    content = {"model": _model_state(modules)}
    if optimizer is not None:
        content["optim"] = _optim_state(modules, optimizer)
    return content


def begin(
    run_dir: str | Path,
    step: int,
    model: Modules,
    optimizer: torch.optim.Optimizer | None,
    writer: Callable[[Path], FileSystemWriter] = FileSystemWriter,
    asynchronous: bool = False,
    async_group=None,
    tmp: Path | None = None,
):
    """Start writing checkpoint `step` into step-N.tmp (or `tmp`, an empty folder from
    `scratch_dir`, single process): the DCP tensors of every rank. Returns (tmp, future): the
    future is None for a synchronous write (done on return) or DCP's async future (tensors staged
    to host memory on return, written by a background thread)."""
    if tmp is None:
        final = step_dir(run_dir, step)
        tmp = final.with_name(final.name + ".tmp")
        if err := _run_on_main(lambda: _fresh(tmp)):
            raise not_written(run_dir, step, err)
    content = _content(model, optimizer)
    try:
        with without_process_group():
            if asynchronous:
                from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

                return tmp, dcp.async_save(
                    content,
                    storage_writer=writer(tmp),
                    process_group=async_group,
                    async_checkpointer_type=AsyncCheckpointerType.THREAD,
                )
            dcp.save(content, storage_writer=writer(tmp))
    except (CheckpointException, OSError, RuntimeError) as e:
        abandon(tmp)
        if isinstance(e, CheckpointException) and any(isinstance(x, KeyboardInterrupt) for x, _ in e.failures.values()):
            # a second Ctrl-C during the write (DCP wraps it like a failed write): stop now, as asked,
            # not "checkpoint not written ... free space" (seen under pytest -n 2, 2026-12-06)
            raise KeyboardInterrupt from None
        raise not_written(run_dir, step, reason(e)) from None
    return tmp, None


def finish(
    run_dir: str | Path,
    step: int,
    tmp: Path,
    state: dict,
    files: Mapping[str, Path | bytes] | None = None,
    keep: int | None = 2,
    collective: bool = True,
    replace: bool = True,
) -> Path:
    """Complete a checkpoint whose tensors are written: state.json, extra files, then the manifest
    (last, so it vouches for everything), fsync, atomic rename, retention. `collective=False`:
    called by rank 0 alone (finalizing an async save, whose tensors every rank has written).
    `keep=None`: no retention (a command adding one checkpoint to a run it does not own: export,
    import); retention never deletes the checkpoint just written. `replace=False`: a step-N already
    there is refused, not replaced."""
    final = step_dir(run_dir, step)

    def complete() -> None:
        (tmp / STATE).write_text(json.dumps({**state, "step": step}))
        for name, src in (files or {}).items():
            if isinstance(src, bytes):
                (tmp / name).write_bytes(src)
            else:
                shutil.copyfile(src, tmp / name)
        (tmp / _PARTIAL).unlink(missing_ok=True)
        entries = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir())}
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "run": folder_id(Path(run_dir)),  # binds it to this run folder: a copy elsewhere is not this run's
            "step": step,
            "config_hash": state.get("config_hash"),
            "layout": state.get("layout"),
            "files": entries,
        }
        (tmp / _MANIFEST).write_text(json.dumps(manifest))
        for p in [*tmp.iterdir(), tmp]:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if final.exists() or final.is_symlink():
            if not replace:
                raise FileExistsError(errno.EEXIST, "already exists, not replaced", str(final))
            if final.is_symlink() or _problem(final, run_dir, False, own=True):
                raise FileExistsError(errno.EEXIST, "not this run's checkpoint: move it away", str(final))
            old = final.with_name(f"{final.name}.{secrets.token_hex(4)}.replaced")  # swapped out: never a gap
            os.replace(final, old)
            os.replace(tmp, final)
            _remove_listed(old, [])
        else:
            os.replace(tmp, final)
        if keep is not None:
            prune(run_dir, keep, protect=final)

    if collective:
        err = _run_on_main(complete)
    else:
        try:
            complete()
            err = None
        except OSError as e:
            err = str(e)
    if err:
        abandon(tmp)
        raise not_written(run_dir, step, err)
    return final


def claim_step(run_dir: str | Path, step: int, force: bool = False) -> Path:
    """For a command that adds one checkpoint to a run folder it may not own (export, import):
    step-N's folder, refused in one line when one is already there unless `force` (which replaces
    it, if flopwise wrote it: a folder without a manifest is someone else's and never replaced).
    The run's other checkpoints are never touched (no retention). The run folder's `checkpoints`
    is claimed first (rundir.claim): refused if it is a user's, recorded as flopwise's when new,
    so that `flopwise train run.dir=<run_dir>` resumes from what was written."""
    rundir.claim(run_dir, ["checkpoints"])
    final = step_dir(run_dir, step)
    if final.exists() or final.is_symlink():
        if final.is_symlink() or not (final / _MANIFEST).is_file():
            raise CheckpointError(
                f"{final} is already there and is not a flopwise checkpoint (no {_MANIFEST}); "
                "nothing was written: move it away or choose another output folder"
            )
        if not force:
            raise CheckpointError(
                f"{final} already exists; nothing was written (--force replaces it, or choose another output folder)"
            )
    return final


def scratch_dir(run_dir: str | Path, step: int) -> Path:
    """A new, empty folder beside step-N to write it in (single process: export, import), named
    uniquely so that no folder or file already there is reused or deleted; a leftover of an
    interrupted write is a step-*.tmp, which retention clears."""
    root = _no_link(Path(run_dir) / "checkpoints")
    try:
        root.mkdir(parents=True, exist_ok=True)
        while True:  # not tempfile.mkdtemp: its mode 0700 would leave the checkpoint unreadable to a group
            tmp = root / f"step-{step:08d}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
            try:
                tmp.mkdir()
            except FileExistsError:
                continue
            _mark_partial(tmp)
            return tmp
    except OSError as e:
        raise CheckpointError(
            f"cannot write a checkpoint under {root} ({e.strerror or e}); nothing was written"
        ) from None


@contextlib.contextmanager
def without_process_group():
    """DCP warns "torch.distributed is disabled ... assuming the intent is to load in a single
    process" on every save and load without a process group, which is how the one-process tools
    (export, convert, eval) use it on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def abandon(tmp: Path) -> None:
    """Remove a failed write's partial folder (rank 0)."""
    if is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)


def not_written(run_dir: str | Path, step: int, reason: str) -> CheckpointError:
    prev = latest(run_dir, verify_checksums=False, own=True)
    kept = f"the latest complete checkpoint is still {prev.name}" if prev else "there is no earlier checkpoint"
    return CheckpointError(
        f"checkpoint step-{step:08d} not written ({reason}); {kept}. Free space or fix "
        "permissions under checkpoints/, or set checkpoint.on_error=continue"
    )


def save(
    run_dir: str | Path,
    step: int,
    model: Modules,
    optimizer: torch.optim.Optimizer | None,
    state: dict,
    files: Mapping[str, Path | bytes] | None = None,
    keep: int | None = 2,
    writer: Callable[[Path], FileSystemWriter] = FileSystemWriter,
    replace: bool = True,
    tmp: Path | None = None,
) -> Path:
    """Write checkpoint `step` atomically and keep the newest `keep` complete ones (None: delete
    none; optimizer=None: weights only, e.g. a model imported from Hugging Face). `model` may be a
    list of pipeline stage modules; every rank calls this with its own shards. A failed write
    raises CheckpointError on every rank and leaves the previous checkpoints as they were."""
    tmp, _ = begin(run_dir, step, model, optimizer, writer, tmp=tmp)
    return finish(run_dir, step, tmp, state, files, keep, replace=replace)


def _bare(name: object) -> bool:
    """A plain file name inside the folder: no directories, no `..`, no absolute path."""
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name and "\\" not in name


def verify(path: Path, checksums: bool = True) -> str | None:
    """Why `path` is not a usable checkpoint (None when it is): the manifest must parse, name only
    plain files, match every file's size (and sha256), and DCP's metadata must only point at
    files of this folder."""
    try:
        manifest = json.loads((path / _MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict) or not isinstance(manifest.get("step"), int):
            return "manifest malformed"
    except FileNotFoundError:
        return "no manifest (write interrupted)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"manifest unreadable ({type(e).__name__})"
    for name, meta in files.items():
        if not _bare(name):
            return f"manifest names {name!r}, outside the checkpoint folder"
        f = path / name
        try:
            size = f.stat().st_size
            if not isinstance(meta, dict) or size != meta.get("bytes"):
                return f"{name} is {size} bytes, manifest says {meta.get('bytes') if isinstance(meta, dict) else '?'}"
            if checksums and _sha256(f) != meta.get("sha256"):
                return f"{name} fails its sha256 checksum"
        except FileNotFoundError:
            return f"{name} missing"
        except OSError as e:
            return f"{name} unreadable ({e.strerror or type(e).__name__})"
    if _DCP_METADATA in files:
        try:
            md = read_dcp_metadata(path)
        except CheckpointError as e:
            return str(e).split(": ", 1)[-1]
        unlisted = sorted({info.relative_path for info in (md.storage_data or {}).values()} - set(files))
        if unlisted:
            return f"{_DCP_METADATA} reads {unlisted[0]!r}, which the manifest does not list"
    return None


def is_complete(path: Path) -> bool:
    """Cheap completeness (sizes, not checksums): for listing and retention."""
    return verify(path, checksums=False) is None


def _candidates(run_dir: str | Path) -> list[Path]:
    """The folders under checkpoints/ named as flopwise names a step (step-NNNNNNNN), oldest first:
    all that discovery and retention look at (a user's step-6-before-lr-change/ is not one)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _STEP_NAME.fullmatch(p.name) and p.is_dir() and not p.is_symlink())


def _not_this_runs(path: Path, run_dir: str | Path) -> str | None:
    """Why a checkpoint that verifies is not this run's own (None when it is): its manifest must be
    of its folder's step and bound to `run_dir` (written there, not copied in nor handed)."""
    m = json.loads((path / _MANIFEST).read_text(encoding="utf-8"))
    if f"step-{m['step']:08d}" != path.name:
        return f"its manifest is of step {m['step']}"
    if not written_for({"folder": m.get("run")}, Path(run_dir)):
        return "written for another run folder, or before checkpoints named their run (checkpoint.resume=PATH reads it)"
    return None


def _problem(path: Path, run_dir: str | Path, checksums: bool, own: bool) -> str | None:
    return verify(path, checksums) or (_not_this_runs(path, run_dir) if own else None)


def list_complete(run_dir: str | Path, own: bool = False) -> list[Path]:
    """The step folders that verify (sizes only); `own`: and are this run's own."""
    return [p for p in _candidates(run_dir) if _problem(p, run_dir, False, own) is None]


def _scan(run_dir: str | Path, checksums: bool, own: bool) -> tuple[Path | None, list[tuple[str, str]]]:
    """The newest step folder that verifies (and is this run's, `own`), and the newer ones skipped, why."""
    skipped: list[tuple[str, str]] = []
    for p in reversed(_candidates(run_dir)):
        reason = _problem(p, run_dir, checksums, own)
        if reason is None:
            return p, skipped
        skipped.append((p.name, reason))
    return None, skipped


def latest(
    run_dir: str | Path, verify_checksums: bool = True, report: Callable[[str], None] | None = None, own: bool = False
) -> Path | None:
    """The newest checkpoint that verifies (`own`: and is this run's); each damaged newer one is
    reported in one line and skipped."""
    found, skipped = _scan(run_dir, verify_checksums, own)
    if report is not None and found is not None:
        for name, why in skipped:
            report(f"skipping damaged checkpoint {name} ({why}); using {found.name}")
    return found


def resume_point(run_dir: str | Path, checksums: bool, report: Callable[[str], None]) -> Path | None:
    """What checkpoint.resume=auto resumes from: the newest of this run's checkpoints that verifies
    (None when it has none). Step folders there of which none verifies stop the run in one line
    naming each and why: starting over beside them would replace them and the run's metrics."""
    found, skipped = _scan(run_dir, checksums, own=True)
    _name_others(Path(run_dir) / "checkpoints")
    if found is not None:
        for name, why in skipped:
            report(f"skipping damaged checkpoint {name} ({why}); using {found.name}")
        return found
    if skipped:
        raise CheckpointError(
            f"checkpoint.resume=auto: no checkpoint in {Path(run_dir) / 'checkpoints'} verifies "
            f"({'; '.join(f'{n}: {w}' for n, w in skipped)}); nothing was written. Restore or move them away, "
            "resume one by path (checkpoint.resume=PATH), or start over in a new run.dir with checkpoint.resume=none"
        )
    return None


def _rmdir_or_name(folder: Path) -> None:
    """Remove `folder` if flopwise's files were all it held, else name it once (what is left is someone's)."""
    with contextlib.suppress(OSError):
        folder.rmdir()
    if folder.exists():
        left = sorted(p.name for p in folder.iterdir())
        held = ", ".join(left[:3]) + (" ..." if len(left) > 3 else "")
        _name_once(folder, f"left in place: it holds {held}, which flopwise did not write")


def _name_once(path: Path, what: str) -> None:
    if str(path) not in _named:
        _named.add(str(path))
        log.warning(f"checkpoints: {path} {what}")


def _name_others(root: Path) -> None:
    """Name, once, each entry under checkpoints/ that is neither a step folder nor a partial write
    of flopwise's: discovery and retention leave it alone."""
    if root.is_dir() and not root.is_symlink():
        for p in sorted(root.iterdir()):
            if not _STEP_NAME.fullmatch(p.name) and not _is_partial(p):
                _name_once(p, "is not a flopwise checkpoint: left alone (never resumed nor deleted)")


def _remove_listed(ckpt: Path, failed: list[str]) -> None:
    """Delete a checkpoint's files its manifest lists, then the manifest, then the folder if that
    was all it held (a user's my-eval.json beside them keeps the folder)."""
    names = json.loads((ckpt / _MANIFEST).read_text(encoding="utf-8"))["files"]
    for name in [*names, _MANIFEST]:
        try:
            (ckpt / name).unlink(missing_ok=True)
        except OSError as e:
            failed.append(f"{ckpt / name} ({e.strerror})")
    _rmdir_or_name(ckpt)


def prune(run_dir: str | Path, keep: int, protect: Path | None = None) -> None:
    """Delete all but the newest `keep` of this run's checkpoints (never the newest one, nor
    `protect`, the one just written): only the files their manifests list. Partial writes flopwise
    made are cleared (no write is in flight when this runs); anything else is left and named once."""
    failed: list[str] = []
    root = _no_link(Path(run_dir) / "checkpoints")
    ours = list_complete(run_dir, own=True)
    for old in [p for p in ours[: -max(1, keep)] if protect is None or p != Path(protect)]:
        _remove_listed(old, failed)
    for p in sorted(root.glob("step-*.tmp")):
        if _is_partial(p):
            _remove_partial(p, failed)
    _name_others(root)
    if failed:  # the new checkpoint is complete; say what could not be cleared, and go on
        warnings.warn(
            f"checkpoint retention could not delete {failed[0]}"
            + (f" and {len(failed) - 1} more" if len(failed) > 1 else "")
            + "; free the space by hand",
            stacklevel=2,
        )


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP's `.metadata` holds: its dataclasses, torch.Size, dtypes, layouts."""

    # Not BytesStorageMetadata: DCP loads such an entry with torch.load(weights_only=False), i.e.
    # unpickles bytes from the folder. flopwise writes tensors only, so a bytes entry is an attack.
    DCP = {
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    } | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self.DCP or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def _short(value: object) -> str:
    """A damaged field's value for a one-line message (its type when it cannot be shown)."""
    try:
        text = " ".join(repr(value).split())
    except Exception:  # noqa: BLE001 - a dataclass missing a field cannot repr itself
        text = type(value).__name__
    return text if len(text) <= 100 else text[:97] + "..."


def _is_size(value: object, rank: int | None = None) -> TypeGuard[tuple[int, ...]]:
    """A torch.Size-like tuple of non-negative ints (of `rank` entries when given); bools are not sizes."""
    return (
        isinstance(value, tuple)
        and all(type(n) is int and n >= 0 for n in value)
        and (rank is None or len(value) == rank)
    )


@cache
def _loadable_dtypes() -> frozenset:
    """The dtypes a tensor entry may declare: ordinary floating point, complex, integer and bool
    ones (not quantized, bit-packed or sub-byte dtypes, which no model state holds)."""
    names = (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "complex64",
        "complex128",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
    )
    return frozenset(d for n in names if isinstance(d := getattr(torch, n, None), torch.dtype))


def _tiling_problem(entry: TensorStorageMetadata) -> str | None:
    """Why a tensor entry is not what DCP wrote (None when it is): properties with a loadable
    dtype; a size; chunks, each a box of the tensor's rank inside it, their volumes summing to its
    size. Every field is read with getattr: an entry rebuilt from a damaged stream can lack any.
    DCP would otherwise load a tensor that no chunk covers by leaving the model's values as they
    were, without a word."""
    props = getattr(entry, "properties", None)
    dtype = getattr(props, "dtype", None)
    if not isinstance(props, TensorProperties) or not isinstance(dtype, torch.dtype) or dtype not in _loadable_dtypes():
        return f"has properties {_short(props)}"
    if not (
        isinstance(getattr(props, "layout", None), torch.layout)
        and all(isinstance(getattr(props, f, None), bool) for f in ("requires_grad", "pin_memory"))
    ):
        return f"has properties {_short(props)}"
    size = getattr(entry, "size", None)
    if not _is_size(size):
        return f"has size {_short(size)}"
    chunks = getattr(entry, "chunks", None)
    if not isinstance(chunks, list):
        return f"has chunks {_short(chunks)}"
    total = 0
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not (
            isinstance(chunk, ChunkStorageMetadata)
            and _is_size(offsets, len(size))
            and _is_size(sizes, len(size))
            and all(o + n <= d for o, n, d in zip(offsets, sizes, size, strict=True))
        ):
            return f"has a chunk outside its size {list(size)}"
        total += math.prod(sizes)
    if total != math.prod(size):
        return f"has chunks covering {total} of its {math.prod(size)} elements"
    return None


def _storage_problem(key: object, info: object) -> str | None:
    """Why a storage record is not what DCP wrote (None when it is): keyed by a MetadataIndex, it
    points at a plain file of the folder, at a non-negative offset and length, with no stream
    transforms (flopwise writes none)."""
    damaged = "(damaged); use another checkpoint"
    if not (
        isinstance(key, MetadataIndex)
        and isinstance(getattr(key, "fqn", None), str)
        and (getattr(key, "offset", None) is None or _is_size(getattr(key, "offset", None)))
    ):
        return f"has a storage key {_short(key)} {damaged}"
    if not isinstance(info, _StorageInfo):
        return f"has a storage record {_short(info)} for {_short(key.fqn)} {damaged}"
    if getattr(info, "transform_descriptors", None):  # DCP's stream transforms
        return f"asks for stream transforms {_short(info.transform_descriptors)}, which flopwise never writes; refused"
    if not _bare(getattr(info, "relative_path", None)):
        return f"points at {_short(getattr(info, 'relative_path', None))}, outside the checkpoint folder"
    for field in ("offset", "length"):
        value = getattr(info, field, None)
        if type(value) is not int or value < 0:
            return f"has a storage {field} {_short(value)} for {_short(key.fqn)} {damaged}"
    return None


def _metadata_problem(metadata: object) -> str | None:
    """Why an unpickled `.metadata` is not DCP metadata flopwise could have written (None when it
    is). Only what the restricted unpickler admits can be here, but a damaged stream can build it
    with any field missing, retyped or holding another admitted class: every field DCP or flopwise
    reads is checked, so a reader never meets an AttributeError or TypeError later."""
    if not isinstance(metadata, Metadata):
        return "is not DCP metadata"
    for field, required in (("state_dict_metadata", True), ("storage_data", False), ("planner_data", False)):
        value = getattr(metadata, field, ...)  # a damaged stream can drop or retype them
        if not (isinstance(value, dict) or (value is None and not required)):
            return f"has no valid {field} (damaged); use another checkpoint"
    if not isinstance(getattr(metadata, "storage_meta", None), StorageMeta | None):
        return f"has storage_meta {_short(metadata.storage_meta)} (damaged); use another checkpoint"
    if not isinstance(getattr(metadata, "version", None), str | None):
        return f"has version {_short(metadata.version)} (damaged); use another checkpoint"
    storage = metadata.storage_data or {}
    for key, info in storage.items():
        if why := _storage_problem(key, info):
            return why
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            return f"has an entry named {_short(key)} (damaged); use another checkpoint"
        if not isinstance(entry, TensorStorageMetadata):
            return (
                f"stores {_short(key)} as {type(entry).__name__}, which flopwise never writes (it would be "
                "unpickled); refused"
            )
        if why := _tiling_problem(entry):
            return f"entry {_short(key)} {why} (damaged); use another checkpoint"
        for chunk in entry.chunks:  # each chunk stored somewhere, in at least its raw bytes
            info = storage.get(MetadataIndex(key, chunk.offsets))
            need = math.prod(chunk.sizes) * entry.properties.dtype.itemsize
            if info is None:
                return (
                    f"entry {_short(key)} has a chunk at {list(chunk.offsets)} that is stored nowhere (damaged); "
                    "use another checkpoint"
                )
            if info.length < need:
                return (
                    f"entry {_short(key)} has a chunk of {need} bytes stored in {info.length} (damaged); "
                    "use another checkpoint"
                )
    for key, path in (metadata.planner_data or {}).items():
        if not (
            isinstance(key, str)
            and isinstance(path, tuple | list)
            and path
            and all(isinstance(p, str | int) and not isinstance(p, bool) for p in path)
        ):
            return f"has planner data {_short(key)}: {_short(path)} (damaged); use another checkpoint"
    return None


# Opcodes no DCP metadata holds, refused before the unpickler runs. BYTEARRAY8 above all: its
# 8-byte length is allocated up front, and when that allocation fails CPython (3.11) frees the
# half-built bytearray with its export count unset: "SystemError: deallocated bytearray object has
# exported buffers" (one bit flipped MEMOIZE, 0x94, into BYTEARRAY8, 0x96, in the fuzzer's mutants).
_REFUSED_OPCODES = frozenset({"BYTEARRAY8", "NEXT_BUFFER", "READONLY_BUFFER", "PERSID", "BINPERSID"})


def _scan_pickle(raw: bytes) -> None:
    """Walk the stream's opcodes without building anything (pickletools reads each argument with
    a bounded read, so a declared length past the end is an error, never an allocation): raise
    ValueError for a malformed stream or an opcode DCP metadata never holds. After this, every
    length the unpickler meets is at most the bytes that remain."""
    for op, _arg, pos in pickletools.genops(raw):
        if op.name in _REFUSED_OPCODES:
            raise ValueError(f"opcode {op.name} at byte {pos}, which DCP metadata never holds")


# SHA-256 digests of `.metadata` contents this process has scanned and checked and found sound. One
# resume or eval reads the file four or five times (verify, latest, resolve, DCP's load), and the
# opcode walk and the field checks are pure Python: 2.4 s of a 16 MB file (200 tensors x 512 shards,
# measured on 2 CPU cores), 13 ms of a tiny model's. Keyed by content, never by path: bytes that
# differ in any way are checked again; refused bytes are never kept.
_SOUND_METADATA: set[bytes] = set()


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's metadata of a checkpoint folder, unpickled safely and checked to name only its own
    files, every field of the type DCP writes. The file is read into bytes and its opcodes are
    checked before the restricted unpickler builds anything from them (once per content:
    _SOUND_METADATA); whatever either raises (SystemError included) is a refusal in one line."""
    try:
        raw = (path / _DCP_METADATA).read_bytes()
        digest = hashlib.sha256(raw).digest()
        sound = digest in _SOUND_METADATA
        if not sound:
            _scan_pickle(raw)
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
        why = None if sound else _metadata_problem(metadata)
    except Exception as e:  # untrusted bytes: any way the unpickler fails means refused
        raise CheckpointError(
            f"checkpoint {path}: {_DCP_METADATA} refused ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        ) from None
    if why:
        raise CheckpointError(f"checkpoint {path}: {_DCP_METADATA} {why}")
    _SOUND_METADATA.add(digest)
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with its `pickle.load` of `.metadata` replaced by `read_dcp_metadata`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: not written by flopwise
            raise CheckpointError(f"checkpoint {self.path}: per-rank metadata is not supported")
        metadata = read_dcp_metadata(Path(self.path))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


def resolve(path: str | Path, report: Callable[[str], None] | None = None) -> Path:
    """A checkpoint folder, or a run folder (-> its newest complete checkpoint). `report` hears,
    for a run folder whose newest checkpoint is damaged, why and which older one is used."""
    p = Path(path)
    if (p / _MANIFEST).exists():
        if reason := verify(p):
            raise CheckpointError(f"checkpoint {p}: damaged ({reason})")
        return p
    found = latest(p, report=report)
    if found is None:
        raise CheckpointError(f"{p}: no complete checkpoint here (expected a run dir or a step-N folder)")
    return found


def read_state(path: Path) -> dict:
    try:
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read {STATE} ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: {STATE} is not a JSON object (damaged); use another checkpoint")
    return state


def reason(e: BaseException) -> str:  # DCP's CheckpointException is a BaseException
    """The informative line of a (possibly multi-rank, traceback-laden) DCP error."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error:" in ln or "Missing key" in ln or "size mismatch" in ln]
    return (errors[-1] if errors else lines[0] if lines else type(e).__name__)[:200]


def load(path: Path, model: Modules, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load model (and optimizer) state into the given, already built and parallelized objects,
    whatever layout wrote it."""
    modules = _modules(model)
    read_dcp_metadata(path)  # refused metadata says why, not "does not fit"
    with without_process_group():
        try:
            sd = {"model": _model_state(modules)}
            if optimizer is not None:
                sd["optim"] = _optim_state(modules, optimizer)
            dcp.load(sd, storage_reader=SafeReader(str(path)))  # a checkpoint of earlier releases: its alias unread
            ties = _ties(modules)  # an alias takes its parameter's tensor: the loaded values, still one object
            for m in modules:
                set_model_state_dict(
                    m,
                    {k: sd["model"][ties.get(k, k)] for k in get_model_state_dict(m)},
                    options=StateDictOptions(strict=True),
                )
        except (CheckpointException, RuntimeError, ValueError, KeyError, SystemError) as e:
            raise CheckpointError(f"checkpoint {path}: does not fit this model/layout ({reason(e)})") from None
    return read_state(path)
