"""One rank's bytes in this engine: THE per-rank memory account. Pure Python, no torch.

`rank_memory` books what one rank of the `flopwise` engine holds (parameters, gradients,
optimizer state, saved activations, FSDP2's gathered copies, working sets and the step's
high-water mark) from the run and the rank's place in the layout. Two callers, one account:
`plan.rank.predict_rank` (what `flopwise plan --measure` and the joint tests set beside the
engine's measured bytes) and `plan.perf.estimate` (what the layout search ranks by, over the
ranks a layout has). The published stacks (megatron-*) keep their own accounts in plan.perf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flopwise.config.schema import Config, ModelConfig
from flopwise.layout.rules import Layout, compiles
from flopwise.plan.float8 import float8_all_gather
from flopwise.plan.memory import (
    autocast_weight_copy_bytes,
    buffer_bytes,
    end_activation_bytes,
    engine_precision,
    gathered_param_bytes,
    in_flight_microbatches,
    loss_working_bytes,
    memo,
    rank_activation_bytes,
    rank_model_states,
    rank_param_count,
    regathered_bytes,
    step_grads,
    step_peak_bytes,
    zero1_rank_loads,
)


@dataclass(frozen=True, kw_only=True)
class EngineRun:
    """What this engine's per-rank bytes depend on besides the layout and the rank."""

    model: ModelConfig
    seq: int  # data.seq_len
    global_batch: int  # sequences per optimizer step
    dtype: str = "bf16"  # train.dtype
    compile: bool | str = "auto"  # train.compile; with `steps`, decides plan.layout.compiles
    steps: float = math.inf  # the run's length (train.steps; the planner: its token budget's steps)
    document_mask: bool = False  # data.document_mask
    cpu: bool = False  # the engine on CPUs: its attention core computes in fp32, RMSNorm is composite ops
    float8: str = "none"  # train.float8: the recipe of the blocks' float8 linears

    @classmethod
    def of(cls, cfg: Config, cpu: bool = False) -> EngineRun:
        return cls(
            model=cfg.model,
            seq=cfg.data.seq_len,
            global_batch=cfg.train.global_batch,
            dtype=cfg.train.dtype,
            compile=cfg.train.compile,
            steps=cfg.train.steps,
            document_mask=cfg.data.document_mask,
            cpu=cpu,
            float8=cfg.train.float8,
        )


@dataclass(kw_only=True, slots=True)  # not frozen: a search builds tens of thousands
class RankMemory:
    params: float  # held at rest (fp32 master weights, this rank's share)
    grads: float  # after the backward
    optimizer: float  # AdamW moments after the step
    activations: float  # saved for backward at the rank's peak
    gathered: float  # FSDP2's all-gathered parameters when the activations peak
    other: float  # gathered copies, autocast's weight copies, the loss's or ZeRO-3's working set
    buffers: float  # computed buffers held from the build on (RoPE tables: grow with model.max_seq_len)
    step_grads: float  # gradient bytes the step allocates (DDP's bucket views: none)
    peak: float  # allocated at the step's high-water mark, above the resident model states


def rank_memory(
    run: EngineRun,
    lo: Layout,
    *,
    layers: int,
    embedding: bool,
    head: bool,
    pp_rank: int = 0,
    shard_rank: int = 0,
    dp_rank: int = 0,
    flash: bool = True,
    cache: dict | None = None,
) -> RankMemory:
    """What the rank at these mesh coordinates holds: `layers` blocks (its pipeline stages), the
    embedding and/or the head; `pp_rank` sets its micro-batches in flight, `shard_rank` its FSDP2
    shard, `dp_rank` its ZeRO-1 share. `cache`: one dict per run (a search shares it across
    layouts): the tensor walks are memoised by what they depend on."""
    m, fsdp2, n_micro = run.model, lo.fsdp2, lo.microbatches(run.global_batch)
    compiled, float8 = compiles(run.compile, run.steps, lo), run.float8 != "none"
    precision = memo(
        cache,
        ("precision", fsdp2, compiled, float8),
        lambda: engine_precision(run.dtype, fsdp2, run.cpu, compiled, float8),
    )
    states = memo(
        cache,
        (
            "states",
            layers,
            embedding,
            head,
            lo.tp,
            lo.zero,
            lo.world > 1,
            lo.dp_shard * lo.cp,
            lo.dp * lo.cp,
            shard_rank,
            dp_rank,
        ),
        lambda: rank_model_states(m, lo, layers, embedding, head, shard_rank=shard_rank, dp_rank=dp_rank, cache=cache),
    )
    in_flight = in_flight_microbatches(lo.pp_schedule, lo.pp, n_micro, lo.virtual_stages if lo.pp > 1 else 1, pp_rank)
    acts = rank_activation_bytes(
        m, lo, run.seq, run.global_batch, layers, flash, run.document_mask, precision, pp_rank, cache
    ) + in_flight * memo(
        cache,
        ("end", fsdp2, compiled, lo.cp, lo.micro_batch, lo.tp, embedding, head),
        lambda: end_activation_bytes(m, run.seq // lo.cp, lo.micro_batch, lo.tp, embedding, head, precision),
    )
    gathered = 0.0
    if fsdp2 and not lo.reshards_params:
        f8_gather = float8_all_gather(run.float8, lo)
        gathered = memo(
            cache,
            ("gathered", layers, embedding, head, lo.tp, lo.zero >= 2, lo.dp_shard * lo.cp, f8_gather),
            lambda: gathered_param_bytes(m, lo, layers, embedding, head, run.dtype, cache, f8_gather),
        )
    other = gathered
    if run.dtype == "bf16" and not fsdp2:  # autocast's bf16 weights; compiled blocks keep theirs in `acts`
        kept = 0 if compiled else layers
        other += memo(
            cache,
            ("copies", kept, head, lo.tp, float8),
            lambda: autocast_weight_copy_bytes(m, kept, head, lo.tp, float8),
        )
    # the loss's working set and ZeRO-3's re-gathered blocks come one after the other in backward
    work = memo(
        cache,
        ("work", fsdp2, compiled, lo.cp, lo.micro_batch, lo.tp, lo.reshards_params, head),
        lambda: max(
            loss_working_bytes(m, run.seq // lo.cp, lo.micro_batch, lo.tp, precision) if head else 0.0,
            regathered_bytes(rank_param_count(m, lo, 1, False, False, cache), lo, precision.compute),
        ),
    )
    grads, held = step_grads(lo, n_micro, states.grads)
    return RankMemory(
        params=states.params,
        grads=states.grads,
        optimizer=states.optimizer,
        activations=acts,
        gathered=gathered,
        other=other + work,
        buffers=buffer_bytes(m, layers, lo.tp),
        step_grads=grads,
        peak=step_peak_bytes(grads, held, acts, other + work),
    )


def busiest_dp_rank(
    m: ModelConfig, lo: Layout, layers: int, embedding: bool, head: bool, cache: dict | None = None
) -> int:
    """The data-parallel rank (of dp·cp) whose optimizer state is largest: under ZeRO-1 torch's
    ZeroRedundancyOptimizer gives whole tensors, unevenly; every other share is even or the first
    rank's largest (FSDP2's torch.chunk)."""
    if lo.zero != 1 or lo.dp * lo.cp == 1:
        return 0
    loads = zero1_rank_loads(m, lo, layers, embedding, head, cache)
    return loads.index(max(loads))
