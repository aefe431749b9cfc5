"""`parallelize`: the one step that applies everything that is not the model itself.

Order (as in torchtitan): float8 linears (torchao) -> tensor/sequence parallel -> activation
checkpointing -> compile -> FSDP2, all on the meta device; then each rank allocates and initialises
only what it holds (flopwise.model.init: the values do not depend on the layout); DDP, which needs
real tensors and keeps whole replicas anyway, wraps last. Pipeline splitting happens before, in
flopwise.parallel.pipeline; each stage module goes through this same function. Context parallel
changes no module: the engine's one ContextParallel shards each batch and hands the model the span
it computes (flopwise.parallel.context).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from flopwise.config.schema import Config
from flopwise.layout.rules import Layout, compiles
from flopwise.model.transformer import Transformer, materialise
from flopwise.parallel.data import apply_ddp, apply_fsdp, apply_replicate, uses_ddp, uses_replicate
from flopwise.parallel.float8 import apply_float8
from flopwise.parallel.mesh import Parallel
from flopwise.parallel.tensor import apply_tp, keep_embedding_grad_sharded

# The ops whose outputs per-operator recompute keeps (everything else in a block is recomputed in
# backward): the matmuls and the attention kernels, costly to redo, and the collectives that end
# a tensor-parallel block's row-parallel linears, costly to resend.
_OP_SAVED = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
}


def _op_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Save `_OP_SAVED`'s outputs, except a row-parallel matmul's (its input sharded along the
    contracted dim): that partial sum is tp times the size of the collective's output that is
    kept instead, so the matmul is rerun."""
    if func not in _OP_SAVED or _partial_matmul(func, args):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _partial_matmul(func, args) -> bool:
    x = args[1] if func is torch.ops.aten.addmm.default else args[0]
    return isinstance(x, DTensor) and any(p.is_shard(x.ndim - 1) for p in x.placements)


def _op_contexts():
    return create_selective_checkpoint_contexts(_op_policy)


def apply_recompute(model: Transformer, mode: str, every: int = 1) -> None:
    """full: recompute whole blocks in backward. op: per operator, each block keeps its matmul and
    attention outputs and recomputes the cheap rest (norms, RoPE, activations, casts), which under
    tensor parallel also re-gathers instead of keeping the gathered inputs. selective: only the
    attention core (QKᵀ, softmax, ·V), whose activations grow with s² while its FLOPs are a small
    share. full and op apply to every `every`-th block of this stage (its first, then every Nth):
    `plan.memory.checkpointed_layers` books the same count."""
    if mode == "none":
        return
    if mode == "auto":
        raise ValueError("parallel.recompute=auto is resolved before the build (train.preflight.resolve_recompute)")
    for i, (key, block) in enumerate(model.layers.items()):
        if mode == "selective":
            attn = block.get_submodule("attention")
            attn.core = checkpoint_wrapper(attn.get_submodule("core"), checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        elif i % every == 0:
            ctx = {"context_fn": _op_contexts} if mode == "op" else {}
            model.layers[key] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **ctx)


def config_compiles(cfg: Config, lo: Layout) -> bool:
    """Whether this run compiles (layout.rules.compiles: the planner books the same)."""
    return compiles(cfg.train.compile, cfg.train.steps, lo)


def apply_compile(model: Transformer) -> None:
    """Compile block by block: keeps parameter names, and composes with FSDP2's per-block hooks.
    Dynamo's DDP optimizer, which cuts a compiled graph at DDP's bucket boundaries so all-reduces
    can start mid-graph, is turned off: a block is already smaller than a bucket, and the cut
    graphs keep tensors the partitioner would recompute (measured: 18% more saved activations
    under DDP, which the planner does not book)."""
    torch._dynamo.config.optimize_ddp = False
    for block in model.layers.values():
        block.compile()


def parallelize(model: Transformer, cfg: Config, par: Parallel) -> nn.Module:
    """A meta-device model (or pipeline stage) -> this rank's parallelized, initialised module."""
    apply_float8(model, cfg, par.layout, par.device)
    if par.mesh is not None and par.size("tp") > 1:
        apply_tp(model, par.mesh["tp"], cfg.parallel.sequence_parallel)
    apply_recompute(model, par.layout.recompute, par.layout.recompute_every)
    if config_compiles(cfg, par.layout):
        apply_compile(model)
    fsdp = par.distributed and par.layout.zero >= 2
    if fsdp:
        apply_fsdp(model, par, cfg.train.dtype)
    elif uses_replicate(par):
        apply_replicate(model, par, cfg.train.dtype)
    materialise(model, par.device, cfg.run.seed)
    if par.size("tp") > 1 and not fsdp and not uses_replicate(par):
        keep_embedding_grad_sharded(model)
    return apply_ddp(model, par) if uses_ddp(par) else model
