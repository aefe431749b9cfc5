"""A checkpoint read and rewritten tensor by tensor: consolidation of any layout into a one-process
checkpoint with peak memory about one tensor, never the whole model (a 405B checkpoint exports on
a host with a few GB free).

DCP's own machinery does the work: `read_tensors` loads the named tensors through the safe reader
(its metadata read and checked once), and the export is a `dcp.save` of a meta-device state dict
whose planner fetches each tensor from the source only when the writer reaches it. The
consolidated `.distcp` file holds the same bytes a save from one process holding the whole model
would write.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from functools import cache
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from flopwise.checkpoints import checkpoint
from flopwise.config.schema import config_hash, to_toml, validate
from flopwise.data.tokenizer import SIDE_FILES
from flopwise.errors import CheckpointError, ConfigError
from flopwise.files import rundir
from flopwise.files.outputs import check_folder, check_space
from flopwise.files.ownership import folder_lock, real_path
from flopwise.layout.rules import Layout
from flopwise.plan.planner import layout_config


@cache
def _libc():
    name = ctypes.util.find_library("c")
    lib = ctypes.CDLL(name) if name else None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


def _release_freed_memory() -> None:
    """Hand memory freed by the previous tensor back to the OS (glibc). Why: glibc's dynamic mmap
    threshold rises to the size of the largest block freed so far, after which multi-MB tensors
    come from the heap and their freed space stays resident; a streamed export would then grow
    by every such tensor it touched (measured: +490 MB on a 670 MB checkpoint)."""
    if (lib := _libc()) is not None:
        lib.malloc_trim(0)


class CheckpointTensors(checkpoint.SafeReader):
    """A checkpoint's tensors by flattened key ("model.layers.0.attention.wq.weight",
    "optim.<name>.exp_avg"), read on demand."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self.dir = Path(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata

    @property
    def specs(self) -> dict[str, TensorStorageMetadata]:
        md = self.read_metadata()
        for key, spec in md.state_dict_metadata.items():
            if not isinstance(spec, TensorStorageMetadata):
                raise CheckpointError(
                    f"checkpoint {self.dir}: entry {key!r} is not a tensor (flopwise writes only tensors)"
                )
        return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        _release_freed_memory()
        specs = self.specs
        missing = [k for k in keys if k not in specs]
        if missing:
            raise CheckpointError(f"checkpoint {self.dir}: no tensor {missing[0]!r}")
        out = {k: torch.empty(specs[k].size, dtype=specs[k].properties.dtype) for k in keys}
        try:
            with checkpoint.without_process_group():
                dcp.load(out, storage_reader=self)
        except Exception as e:  # DCP wraps every rank's failure in its own exception type
            raise CheckpointError(f"checkpoint {self.dir}: cannot read {keys[0]!r} ({checkpoint.reason(e)})") from None
        return out


class _FetchingPlanner(DefaultSavePlanner):
    """Writes a meta-device state dict, fetching each tensor from the source when it is written.

    Why the previous tensor's storage is freed by hand: torch 2.13's FileSystemWriter keeps every
    tensor it has written to a file referenced until the file is closed (`tensor_dict` in
    `_write_files_from_queue`, used only by its safetensors format), so one file per rank would
    hold the whole model. The writer asks for tensor i + 1 only after tensor i's bytes are in the
    stream, so releasing i's storage then is safe."""

    def __init__(self, source: CheckpointTensors):
        super().__init__()
        self.source = source
        self.previous: torch.Tensor | None = None

    def resolve_data(self, write_item):
        if self.previous is not None:
            self.previous.untyped_storage().resize_(0)
        self.previous = self.source.read([write_item.index.fqn])[write_item.index.fqn]
        return self.previous


def _meta_state(source: CheckpointTensors) -> dict:
    """The nested state dict the source was saved from ({"model": {...}, "optim": {...}}), on meta."""
    nested: dict = {}
    paths = source.read_metadata().planner_data or {}
    for key, spec in source.specs.items():
        path = paths.get(key, (key,))
        node = nested
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = torch.empty(spec.size, dtype=spec.properties.dtype, device="meta")
    return nested


def export_checkpoint(path: str | Path, out: str | Path, force: bool = False) -> Path:
    """Consolidate a checkpoint of any layout into a one-process one under <out>/checkpoints/
    (model, optimizer, loader position, RNG: training resumes from it with `run.dir=<out>`),
    one tensor in memory at a time. Added beside the checkpoints already in <out>, none of which
    is deleted; one of the same step is refused unless `force` (then replaced)."""
    ckpt = checkpoint.resolve(path)
    state = checkpoint.read_state(ckpt)
    cfg = layout_config(checkpoint_config(ckpt, state), Layout(micro_batch=1))
    source = CheckpointTensors(ckpt)
    try:
        step = int(state.pop("step"))
    except (KeyError, TypeError, ValueError, OverflowError):
        raise CheckpointError(
            f"checkpoint {ckpt}: state.json holds no valid step (damaged); use another checkpoint"
        ) from None
    out = real_path(out)
    rundir.check_claim(out, ["checkpoints"], "--out")  # a refusal names this command's option
    check_folder(out, "--out")
    with folder_lock(out, "--out"):
        return _export(ckpt, source, state, cfg, step, out, force)


def _export(ckpt: Path, source: CheckpointTensors, state: dict, cfg, step: int, out: Path, force: bool) -> Path:
    # tokenizer.json is absent from a model imported without one (convert from-hf)
    files = {name: ckpt / name for name in ("tokenizer.json", *SIDE_FILES) if (ckpt / name).is_file()}
    # the tensors as stored (model and optimizer), the files copied, and slack for DCP's metadata
    needed = sum(math.prod(s.size) * s.properties.dtype.itemsize for s in source.specs.values())
    needed += sum(p.stat().st_size for p in files.values()) + (1 << 20)
    check_space("--out", out, needed)
    checkpoint.claim_step(out, step, force)
    state.update(
        config=to_toml(cfg),
        config_hash=config_hash(cfg),
        layout={**Layout(micro_batch=1).to_json(), "world_size": 1},
        exported_from=str(ckpt),
    )
    tmp = checkpoint.scratch_dir(out, step)
    try:
        with checkpoint.without_process_group():
            dcp.save(_meta_state(source), storage_writer=FileSystemWriter(str(tmp)), planner=_FetchingPlanner(source))
    except (Exception, CheckpointException) as e:  # DCP's write error is a BaseException
        try:
            check_space("--out", out, needed, e)  # torch says "unexpected pos 704 vs 598" of a full disk
        finally:
            checkpoint.abandon(tmp)
        raise CheckpointError(f"export of {ckpt} failed ({checkpoint.reason(e)})") from None
    try:
        return checkpoint.finish(out, step, tmp, state, files=files, keep=None, replace=force)
    except OSError as e:
        try:
            check_space("--out", out, needed, e)
        except ConfigError:
            checkpoint.abandon(tmp)
            raise
        raise


def resume_advice(out: str | Path, dest: Path) -> str:
    """The overrides that resume training from `dest` in run folder `out`: run.dir alone when it is
    the newest checkpoint there, else also its path (run.dir alone would take the newer one)."""
    newest = checkpoint.latest(out, verify_checksums=False, own=True)
    if newest is None or newest == dest:
        return f"run.dir={out}"
    return f"run.dir={out} checkpoint.resume={dest} ({newest.name} is newer there)"


def checkpoint_config(ckpt: Path, state: dict):
    """The config a checkpoint was written with (from its state.json). Its model.init_from is
    dropped: every model field is written out, so the checkpoint never needs that folder again."""
    import tomllib

    try:
        if not isinstance(state.get("config"), str):
            raise TypeError
        tree = tomllib.loads(state["config"])
        if isinstance(tree.get("model"), dict):
            tree["model"].pop("init_from", None)
        return validate(tree)
    except (TypeError, tomllib.TOMLDecodeError):
        raise CheckpointError(f"checkpoint {ckpt}: state.json holds no valid config") from None
