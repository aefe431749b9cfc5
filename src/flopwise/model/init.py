"""Layout-invariant initialisation: a weight's values depend only on (seed, parameter name, element
position), never on how the weight is split across ranks.

A 2-D weight is tiled into blocks of about `BLOCK` elements (whole rows for narrow weights, row
pieces for wide ones); each block is drawn from its own generator, seeded from a hash of (seed,
name) plus the block's index. A rank that holds
any box of the weight (a pipeline stage holds whole weights, FSDP a range of rows, tensor parallel
a range of rows or columns, both together a box) draws only the blocks that cover its box, so its
shard is bit-identical to the same slice of the one-process model, and no rank ever allocates a
full-size weight. One process runs the very same code over the whole box.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

_BLOCK = 16384
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter's name in the plain model: without the prefixes that activation checkpointing,
    compilation and DDP add (the name checkpoints, initialisation and HF loading key on)."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name.removeprefix("module.")


def _base_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def global_box(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape) of the part of the full weight this rank holds (all of it for a plain tensor)."""
    if isinstance(p, DTensor):
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return tuple(offset), tuple(shape)
    return (0,) * p.dim(), tuple(p.shape)


def normal_box(
    seed: int, name: str, full_shape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...]
) -> torch.Tensor:
    """Standard-normal fp32 values of the box [offset, offset + shape) of weight `name`."""
    rows, cols = full_shape[0], math.prod(full_shape[1:])
    r0, nr = offset[0], shape[0]
    c0, nc = (offset[1], shape[1]) if len(full_shape) == 2 else (0, cols)
    if len(full_shape) > 2 and math.prod(shape[1:]) != cols:
        raise ValueError(f"{name}: only the first two dims of a weight may be sharded")
    bc = min(cols, _BLOCK)
    br = max(1, _BLOCK // bc)
    col_blocks = -(-cols // bc)
    out = torch.empty(nr, nc)
    base, gen = _base_seed(seed, name), torch.Generator(device="cpu")
    for i in range(r0 // br, -(-(r0 + nr) // br) if nr and nc else 0):
        for j in range(c0 // bc, -(-(c0 + nc) // bc)):
            rs, cs = i * br, j * bc
            re, ce = min(rows, rs + br), min(cols, cs + bc)
            gen.manual_seed((base + i * col_blocks + j) % 2**63)
            block = torch.randn((re - rs) * (ce - cs), generator=gen).view(re - rs, ce - cs)
            a, b = max(r0, rs), min(r0 + nr, re)
            c, d = max(c0, cs), min(c0 + nc, ce)
            out[a - r0 : b - r0, c - c0 : d - c0] = block[a - rs : b - rs, c - cs : d - cs]
    return out.view(shape)


@torch.no_grad()
def fill_normal(p: torch.Tensor, name: str, seed: int, std: float) -> None:
    """p (or this rank's shard of it) <- N(0, std²) values of the layout-invariant draw."""
    local = p.to_local() if isinstance(p, DTensor) else p
    if local.numel() == 0:
        return
    offset, shape = global_box(p)
    local.copy_(normal_box(seed, name, tuple(p.shape), offset, shape).mul_(std).to(local.dtype))


@torch.no_grad()
def fill_constant(p: torch.Tensor, value: float) -> None:
    (p.to_local() if isinstance(p, DTensor) else p).fill_(value)
