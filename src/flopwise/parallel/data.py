"""Data parallelism by ZeRO stage, each from torch.distributed's own components.

  zero 0  DDP: parameters, gradients, optimizer state replicated; gradients all-reduced. With
          tensor parallel, FSDP2's replicate (torch.distributed._composable.replicate_with_fsdp)
          instead: DDP does not take DTensor parameters, FSDP2's machinery does.
  zero 1  DDP + ZeroRedundancyOptimizer: optimizer state sharded over the data-parallel ranks.
  zero 2  FSDP2 fully_shard(reshard_after_forward=False): gradients reduce-scattered into shards,
          optimizer state sharded; parameters gathered once per forward and kept through backward.
  zero 3  FSDP2 fully_shard(reshard_after_forward=True): parameters resharded after each block's
          forward and gathered again in backward (3Ψ of traffic instead of 2Ψ).
HSDP (parallel.dp_replicate > 1) shards inside groups of dp_shard ranks and replicates across them.
Context-parallel ranks hold the same weights and see different tokens, so they join the data-parallel
reduction (mesh dim "dp_cp" / "shard").
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from flopwise.model.transformer import Transformer
from flopwise.parallel.mesh import Parallel


def apply_fsdp(model: Transformer, par: Parallel, dtype: str) -> nn.Module:
    """Shard block by block, then the root (embedding, norm, head); on a meta-device model, before
    anything is allocated. Under pipelining the stage keeps its gathered parameters across
    micro-batches (resharding per micro-batch would re-gather)."""
    lo = par.layout
    assert par.mesh is not None  # a sharded layout runs on several processes
    mesh = par.mesh["dp_replicate", "shard"] if lo.dp_replicate > 1 else par.mesh["shard"]
    kw = {"mesh": mesh, "reshard_after_forward": lo.reshards_params, **_mixed_precision(dtype)}
    for block in model.layers.values():
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _mixed_precision(dtype: str) -> dict:
    """bf16 compute with fp32 gradient reduction and master weights (FSDP2's policy), or nothing."""
    if dtype != "bf16":
        return {}
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


def apply_replicate(model: Transformer, par: Parallel, dtype: str) -> nn.Module:
    """ZeRO-0 for tensor-parallel (DTensor) parameters: FSDP2's replicate over the dp·cp ranks,
    block by block then the root, on the meta-device model. Gradients are all-reduced once per
    step (the engine turns the sync off for all but the last micro-batch), as DDP does."""
    assert par.mesh is not None  # a replicated layout runs on several processes
    kw = {"mesh": par.mesh["dp_cp"], **_mixed_precision(dtype)}
    for block in model.layers.values():
        replicate(block, **kw)
    replicate(model, **kw)
    return model


# torch 2.13 renamed DDP's per-forward buffer sync (broadcast_buffers, now deprecated with a warning)
_NO_BUFFER_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


def apply_ddp(model: nn.Module, par: Parallel) -> nn.Module:
    # no buffer sync in forward: the buffers (rope tables, ALiBi slopes) are computed, identical everywhere.
    # gradient_as_bucket_view: the gradients are views of DDP's all-reduce buckets, not a second fp32
    # copy of them (the planner books one Ψ of gradients, held all step)
    return DistributedDataParallel(
        model,
        process_group=par.group("dp_cp"),
        **_NO_BUFFER_SYNC,
        gradient_as_bucket_view=True,
        device_ids=[par.device.index] if par.device.type == "cuda" else None,
    )


def uses_ddp(par: Parallel) -> bool:
    """ZeRO 0/1 with more than one rank holding the same weights: gradients all-reduced by DDP
    (by FSDP2's replicate under tensor parallel: `uses_replicate`)."""
    return par.distributed and par.layout.zero < 2 and par.size("dp_cp") > 1 and par.size("tp") == 1


def uses_replicate(par: Parallel) -> bool:
    return par.distributed and par.layout.zero == 0 and par.size("dp_cp") > 1 and par.size("tp") > 1


def zero1_group(par: Parallel):
    """The process group ZeRO-1 shards optimizer state over, or None when it does not apply."""
    return par.group("dp_cp") if par.layout.zero == 1 and par.size("dp_cp") > 1 else None


def local_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state (ZeRO-1's per-rank inner optimizer)."""
    return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
