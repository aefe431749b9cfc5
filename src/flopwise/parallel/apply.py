"""`parallelize`: the one step that applies everything that is not the model itself.

Order (as in torchtitan): tensor/sequence parallel -> activation checkpointing -> compile ->
FSDP. On one process only activation checkpointing and compilation apply; the distributed engine
adds the mesh-dependent steps here.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from flopwise.config import Config
from flopwise.model.transformer import Transformer


def apply_recompute(model: Transformer, mode: str) -> None:
    """full: recompute each block in backward. selective: recompute only the attention core
    (QKᵀ, softmax, ·V), whose activations grow with s² while its FLOPs are a small share."""
    if mode == "none":
        return
    for key, block in model.layers.items():
        if mode == "full":
            model.layers[key] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        else:
            block.attention.core = checkpoint_wrapper(block.attention.core, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def apply_compile(model: Transformer) -> None:
    """Compile block by block: keeps parameter names, and composes with FSDP2's per-block hooks."""
    for block in model.layers.values():
        block.compile()


def parallelize(model: Transformer, cfg: Config) -> nn.Module:
    apply_recompute(model, cfg.parallel.recompute)
    if cfg.train.compile:
        apply_compile(model)
    return model
