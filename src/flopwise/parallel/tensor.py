"""Megatron tensor parallelism (and sequence parallelism) as a DTensor plan.

Column-parallel wq/wk/wv/w1/w3, row-parallel wo/w2: one all-reduce in forward and one in backward
per attention and per MLP (Shoeybi et al. 2019). With sequence parallel the all-reduces become
reduce-scatter + all-gather pairs and the norms and dropouts run on 1/tp of the sequence
(Korthikanti et al. 2022). The head is column-parallel over the vocabulary and the loss is computed
on the vocab shards with `loss_parallel` (no full logits are ever gathered).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from flopwise.model.transformer import Transformer


class _ReplicateParallel(ParallelStyle):
    """Parameters replicated as DTensors, inputs and outputs local: a norm outside sequence parallel.
    (So every parameter is a DTensor on the tp mesh and FSDP/clipping see one kind of tensor.)"""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(_, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False) for x in inputs)

        return distribute_module(module, mesh, input_fn=to_dtensor, output_fn=lambda _, out, mesh: out.to_local())


def apply_tp(model: Transformer, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()
    norm = SequenceParallel() if sp else _ReplicateParallel()
    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        if model.embed_norm is not None:
            plan["embed_norm"] = norm
        if model.pos_embeddings is not None:
            plan["pos_embeddings"] = _ReplicateParallel()
    if model.output is not None:
        plan["norm"] = norm
        plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, plan)
    for block in model.layers.values():
        a = block.get_submodule("attention")
        bplan: dict[str, ParallelStyle] = {
            "attention_norm": norm,
            "ffn_norm": norm,
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if block.get_submodule("feed_forward").w3 is not None:
            bplan["feed_forward.w3"] = ColwiseParallel()
        # Enter attention and the MLP as one DTensor: the input gradients of wq/wk/wv (and w1/w3) then
        # sum as partials and cost one all-reduce (reduce-scatter under SP), Megatron's "f" operator,
        # instead of one per projection.
        bplan["attention"] = PrepareModuleInput(
            input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
        )
        bplan["feed_forward"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        if a.q_norm is not None:  # per-head norms see local heads: shard them on the head dim
            bplan["attention.q_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
            bplan["attention.k_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        parallelize_module(block, mesh, bplan)
    _shard_head_buffers(model, mesh)


def _shard_head_buffers(model: Transformer, mesh: DeviceMesh) -> None:
    """Each rank attends with its own heads' ALiBi slopes: the buffer becomes a DTensor sharded by
    head (locally cut, no communication), whose layout the model's reset_buffers keeps when it
    fills the buffer after materialising."""
    slopes = getattr(model, "alibi", None)
    if slopes is not None and not isinstance(slopes, DTensor):
        model.register_buffer(
            "alibi", distribute_tensor(slopes, mesh, [Shard(0)], src_data_rank=None), persistent=False
        )


def keep_embedding_grad_sharded(model: Transformer) -> None:
    """DTensor's embedding backward returns the vocab-parallel table's gradient replicated (the
    whole vocab × d on every tp rank); slice it back to the parameter's shard as it arrives.
    Registered on the materialised parameter (a hook on the meta one would not survive to_empty);
    FSDP2 (and its replicate, ZeRO-0 under tp) reduces that gradient into the parameter's layout
    itself, so this is for tensor parallel without data parallel."""
    weight = model.tok_embeddings.weight if model.tok_embeddings is not None else None
    if isinstance(weight, DTensor):
        weight.register_post_accumulate_grad_hook(_to_param_placement)


def _to_param_placement(p: DTensor) -> None:
    if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)
