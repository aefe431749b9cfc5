"""float8 training of the blocks' linear layers (train.float8) with torchao's dynamic scaling.

`apply_float8` swaps each block linear that layout.linears.float8_eligible accepts (both weight dims,
tensor-parallel local, multiples of 16) for torchao's Float8Linear; the embedding, the head and
any other linear stay in train.dtype. It runs first in `parallelize`, on the meta device, as
torchao's own tensor-parallel and FSDP2 integration expects (float8 conversion, then TP, then
activation checkpointing, compile and FSDP2: the later steps wrap Float8Linear like any linear).
Tensor parallel uses the engine's plain DTensor plan: both recipes compute on DTensor shards, with
the activations' collectives in high precision. Tensorwise scaling under FSDP2 all-gathers the
weights in float8 (`layout.linears.float8_all_gather`); its scales are computed in each pre-all-gather
from the shards' amax (torchao's precompute_float8_dynamic_scale_for_fsdp, an optimisation that
folds them into one all-reduce after the optimizer step, is not used: its cached scales would go
stale when a checkpoint is restored into the weights).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from flopwise.config.schema import Config
from flopwise.errors import ConfigError
from flopwise.layout.linears import block_linears, float8_all_gather, float8_eligible
from flopwise.layout.rules import Layout

_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores


def _torchao():
    """torchao's float8 module, imported with its import-time log lines silenced (the C++ extensions
    it could not load for this torch build, which float8 training does not use, and a pytree
    deprecation warning)."""
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        import torchao.float8 as f8
    except ImportError:
        raise ConfigError(
            "train.float8 needs torchao: pip install 'flopwise[float8]' (or set train.float8=none)"
        ) from None
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
    return f8


def check_float8(cfg: Config, device: torch.device) -> None:
    """train.float8 on a device without float8 tensor cores (unless emulated), or without torchao:
    one line saying what to set."""
    if cfg.train.float8 == "none":
        return
    if not cfg.train.float8_emulate:
        if device.type != "cuda":
            found = device.type
        else:
            props = torch.cuda.get_device_properties(device)
            found = f"{props.name} (compute capability {props.major}.{props.minor})"
        if device.type != "cuda" or (props.major, props.minor) < _MIN_CAPABILITY:
            raise ConfigError(
                f"train.float8 needs a CUDA GPU of compute capability >= 8.9; found {found}; "
                "set train.float8=none (or train.float8_emulate=true to emulate)"
            )
    _torchao()


def _float8_config(recipe: str, emulate: bool, all_gather: bool):
    """torchao's Float8LinearConfig for a recipe, emulated or not, with FSDP2's float8 all-gather."""
    base = _torchao().Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(base, emulate=emulate, enable_fsdp_float8_all_gather=all_gather)


def _cast_to_autocast_dtype(module: nn.Module, args: tuple) -> tuple:
    """Float8Linear casts its input to CUDA autocast's dtype only; on other devices this does the
    same with the device's autocast dtype, so emulation computes and saves what a GPU does."""
    x = args[0]
    if torch.is_autocast_enabled(x.device.type):
        return (x.to(torch.get_autocast_dtype(x.device.type)), *args[1:])
    return args


def apply_float8(model: nn.Module, cfg: Config, lo: Layout, device: torch.device) -> None:
    """Swap the blocks' eligible linears for torchao's Float8Linear (in place, meta device)."""
    recipe = cfg.train.float8
    if recipe == "none":
        return
    f8 = _torchao()
    eligible = {name for name, shape in block_linears(cfg.model, lo.tp) if float8_eligible(shape)}
    config = _float8_config(recipe, cfg.train.float8_emulate, float8_all_gather(recipe, lo))
    f8.convert_to_float8_training(
        model.layers, config=config, module_filter_fn=lambda _, fqn: fqn.partition(".")[2] in eligible
    )
    if device.type != "cuda":
        from torchao.float8.float8_linear import Float8Linear

        for module in model.get_submodule("layers").modules():
            if isinstance(module, Float8Linear):
                module.register_forward_pre_hook(_cast_to_autocast_dtype)
