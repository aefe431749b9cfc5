"""One rank of this engine as the planner predicts it: the layers it runs, the bytes of its
parameters, gradients, optimizer state and saved activations, the elements each kind of
collective moves in one optimizer step and the bytes FSDP2 copies around them. Pure Python:
`flopwise plan measure` sets these beside the engine's own counts (flopwise.measure.step), and the
joint tests assert them equal.
"""

from __future__ import annotations

from dataclasses import dataclass

from flopwise.config.schema import Config
from flopwise.layout.rules import Layout, stage_ids, stage_sizes
from flopwise.plan.comm import dp_collectives, pp_boundary_elements, tp_allreduce_elements
from flopwise.plan.memory import rank_param_count
from flopwise.plan.rank_memory import EngineRun, rank_memory
from flopwise.plan.stack import STACKS
from flopwise.plan.step import fsdp_copies


@dataclass(frozen=True, kw_only=True)
class RankPrediction:
    layers: list[int]
    params: float
    grads: float
    optimizer: float
    activations: float  # saved for backward, at the rank's peak (as this engine keeps them)
    gathered: float  # FSDP2's all-gathered parameters when the activations peak
    peak: float  # allocated at the step's high-water mark, above the resident model states
    buffers: float  # computed buffers (RoPE tables, one per pipeline stage module)
    received: float  # the pipeline's receive buffers: allocated in the first step, then resident
    collectives: dict[str, float]  # kind -> elements per step
    fsdp_copies: float  # bytes FSDP2's copy kernels move per step (plan.comm.fsdp_copy_bytes)


def rank_layers(cfg: Config, lo: Layout, pp_rank: int) -> tuple[list[int], bool, bool]:
    """The layer indices of pipeline rank `pp_rank`'s stages, and whether it holds the embedding
    and the head (this engine's stage split, parallel.pp_layers or balanced)."""
    sizes = stage_sizes(cfg.model, lo, pp_layers=cfg.parallel.pp_layers)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    ids = stage_ids(pp_rank, lo)
    layers = sorted(i for s in ids for i in range(starts[s], starts[s] + sizes[s]))
    return layers, 0 in ids, lo.n_stages - 1 in ids


def rank_stages(cfg: Config, lo: Layout, pp_rank: int) -> tuple[int, ...]:
    """Layers of each stage pipeline rank `pp_rank` runs (this engine's split)."""
    sizes = stage_sizes(cfg.model, lo, pp_layers=cfg.parallel.pp_layers)
    return tuple(sizes[s] for s in stage_ids(pp_rank, lo))


def predict_rank(
    cfg: Config, lo: Layout, pp_rank: int, shard_rank: int, dp_rank: int, cpu: bool = False, fake: bool = False
) -> RankPrediction:
    """What the rank at these mesh coordinates holds (exact for model states; plan.rank_memory, the
    account the layout search ranks by) and sends per step (`cpu`: the engine runs on CPUs, where
    its attention core computes in fp32, over gloo or, `fake`, a rehearsal's fake process group)."""
    layers, emb, head = rank_layers(cfg, lo, pp_rank)
    mem = rank_memory(
        EngineRun.of(cfg, cpu, fake),
        lo,
        layers=len(layers),
        embedding=emb,
        head=head,
        pp_rank=pp_rank,
        shard_rank=shard_rank,
        dp_rank=dp_rank,
        flash=STACKS["flopwise"].flash_attention,
        stages=rank_stages(cfg, lo, pp_rank),
    )
    psi = rank_param_count(cfg.model, lo, len(layers), emb, head)
    n_micro = lo.microbatches(cfg.train.global_batch)
    copies = fsdp_copies(cfg.model, lo, psi, len(layers), n_micro, cfg.train.float8, cfg.train.dtype)
    return RankPrediction(
        layers=layers,
        params=mem.params,
        grads=mem.grads,
        optimizer=mem.optimizer,
        activations=mem.activations,
        gathered=mem.gathered,
        peak=mem.peak,
        buffers=mem.buffers,
        received=mem.received,
        collectives=_step_collectives(cfg, lo, pp_rank, psi, len(layers)),
        fsdp_copies=n_micro * copies["micro"] + copies["step"],
    )


def _step_collectives(cfg: Config, lo: Layout, pp_rank: int, psi: int, n_layers: int) -> dict[str, float]:
    """Elements of each kind of collective one rank runs in a step (`psi`: its parameters before
    ZeRO sharding): the data-parallel volumes of plan.comm for this engine's stack (torch's ZeRO-1
    broadcasts the stepped parameters), Megatron's tensor-parallel all-reduces of b·s·h (4 per
    layer, plus the vocab-parallel embedding's output and the head's input gradient, as
    plan.step times them), and each pipeline boundary's activations and gradients."""
    stack, n_micro = STACKS["flopwise"], lo.microbatches(cfg.train.global_batch)
    seq, mb, d = cfg.data.seq_len // lo.cp, lo.micro_batch, cfg.model.d_model
    out: dict[str, float] = {}

    def add(kind: str, elements: float) -> None:
        out[kind] = out.get(kind, 0) + elements

    if lo.dp * lo.cp > 1:
        for c in dp_collectives(
            psi,
            lo.zero,
            zero1_broadcast=stack.zero1_broadcast,
            gather_per_micro=stack.fsdp2,
            pipelined=lo.pp > 1,
            hsdp=lo.dp_replicate > 1,
        ):
            kind = "broadcast" if lo.zero == 1 and stack.zero1_broadcast and c.kind == "all_gather" else c.kind
            add(kind, c.elements * (n_micro if c.when == "micro" else 1))
    if lo.tp > 1:
        add("all_reduce", n_micro * (tp_allreduce_elements(seq, mb, d, n_layers) + 2 * seq * mb * d))
    if lo.pp > 1:
        owner = {s: r for r in range(lo.pp) for s in stage_ids(r, lo)}
        boundary = n_micro * pp_boundary_elements(seq, mb, d, lo.tp, lo.sequence_parallel)  # SP: a sequence shard
        for s in stage_ids(pp_rank, lo):
            for neighbour in (s - 1, s + 1):
                if 0 <= neighbour < lo.n_stages and owner[neighbour] != pp_rank:
                    add("send", boundary)  # activations forward or gradients backward
                    add("recv", boundary)
    return out
