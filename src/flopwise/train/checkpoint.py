"""Checkpoints in torch.distributed.checkpoint (DCP) format, written atomically.

  <run.dir>/checkpoints/step-NNNNNNNN/
    .metadata, __*_*.distcp   model + optimizer state (DCP: sharded, reshardable on load)
    state.json                step, loader position, RNG states, config (TOML), data fingerprint
    tokenizer.json            so the checkpoint is self-contained for eval/generate/export
    manifest.json             written last: every file with its size and sha256

Everything is written into `step-N.tmp/` and renamed when complete; a folder without a valid
manifest is never taken as a checkpoint. Nothing here unpickles: DCP tensors, JSON for the rest.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from flopwise.errors import CheckpointError
from flopwise.parallel.data import local_optimizer

MANIFEST = "manifest.json"
STATE = "state.json"


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> dict:
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
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


def _fqn(name: str) -> str:
    """A parameter's name in the unwrapped model (as get_model_state_dict spells it)."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name.removeprefix("module.")


def _named_params(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    return {_fqn(n): p for m in modules for n, p in m.named_parameters()}


def _model_state(modules: list[nn.Module]) -> dict:
    return {k: v for m in modules for k, v in get_model_state_dict(m).items()}


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
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
    return {name: dict(opt.state[p]) for name, p in _named_params(modules).items() if id(p) in owned}


def save(run_dir: str | Path, step: int, model: Modules, optimizer: torch.optim.Optimizer | None,
         state: dict, files: dict[str, Path] | None = None, keep: int = 2) -> Path:
    """Write checkpoint `step` atomically and keep the newest `keep` complete ones (optimizer=None:
    weights only, e.g. a model imported from Hugging Face). `model` may be a list of pipeline
    stage modules; every rank calls this with its own shards."""
    final = step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    modules = _modules(model)
    content = {"model": _model_state(modules)}
    if optimizer is not None:
        content["optim"] = _optim_state(modules, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming single process" when no process group exists
        dcp.save(content, checkpoint_id=str(tmp))
    if _is_main():
        (tmp / STATE).write_text(json.dumps({**state, "step": step}))
        for name, src in (files or {}).items():
            shutil.copyfile(src, tmp / name)
        entries = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir())}
        manifest = tmp / MANIFEST
        manifest.write_text(json.dumps({"step": step, "files": entries}))
        for p in tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        prune(run_dir, keep)
    _barrier()
    return final


def is_complete(path: Path) -> bool:
    """A checkpoint is complete when its manifest lists exactly the files present, with their sizes."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        return all((path / name).is_file() and (path / name).stat().st_size == meta["bytes"]
                   and Path(name).name == name for name, meta in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def list_complete(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and not p.name.endswith(".tmp")]
    return sorted((p for p in found if is_complete(p)), key=lambda p: p.name)


def latest(run_dir: str | Path) -> Path | None:
    done = list_complete(run_dir)
    return done[-1] if done else None


def prune(run_dir: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints (never the newest one)."""
    for old in list_complete(run_dir)[:-max(1, keep)]:
        shutil.rmtree(old, ignore_errors=True)


def resolve(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder (-> its newest complete checkpoint)."""
    p = Path(path)
    if (p / MANIFEST).exists():
        if not is_complete(p):
            raise CheckpointError(f"checkpoint {p}: incomplete or damaged (manifest does not match the files)")
        return p
    found = latest(p)
    if found is None:
        raise CheckpointError(f"{p}: no complete checkpoint here (expected a run dir or a step-N folder)")
    return found


def read_state(path: Path) -> dict:
    try:
        return json.loads((path / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read {STATE} ({e})") from None


def _reason(e: Exception) -> str:
    """The informative line of a (possibly multi-rank, traceback-laden) DCP error."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error:" in ln or "Missing key" in ln or "size mismatch" in ln]
    return (errors[-1] if errors else lines[0] if lines else type(e).__name__)[:200]


def load(path: Path, model: Modules, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load model (and optimizer) state into the given, already built and parallelized objects,
    whatever layout wrote it."""
    modules = _modules(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            sd = {"model": _model_state(modules)}
            if optimizer is not None:
                sd["optim"] = _optim_state(modules, optimizer)
            dcp.load(sd, checkpoint_id=str(path))
            for m in modules:
                set_model_state_dict(m, {k: sd["model"][k] for k in get_model_state_dict(m)},
                                     options=StateDictOptions(strict=True))
        except (CheckpointException, RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {path}: does not fit this model/layout ({_reason(e)})") from None
    return read_state(path)
