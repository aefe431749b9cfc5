"""One rank's bytes, and a layout's worst rank: THE memory account. Pure Python, no torch.

The formulas (model states by ZeRO stage and by tensor, activations per layer, working sets) are
plan.memory's; this module puts them together. `rank_memory` books what one rank of the `flopwise`
engine holds (parameters, gradients, optimizer state, saved activations, FSDP2's gathered copies,
working sets and the step's high-water mark) from the run and the rank's place in the layout. Two
callers, one account: `plan.rank.predict_rank` (what `flopwise plan --measure` and the joint tests
set beside the engine's measured bytes) and `layout_memory`, the worst of a layout's distinct ranks
(what plan.step.estimate books and the layout search ranks by; the pre-flight's `engine_memory` of
one stage). The published stacks (megatron-*) keep ZeRO's Ψ formulas and Korthikanti's activations
(`published_memory`), validated against published runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flopwise.config.schema import Config, ModelConfig
from flopwise.layout.linears import float8_all_gather
from flopwise.layout.rules import Layout, compiles, loss_chunk_tokens, stage_ids
from flopwise.plan.comm import pp_boundary_elements
from flopwise.plan.memory import (
    KORTHIKANTI,
    SavedPrecision,
    autocast_weight_copy_bytes,
    buffer_bytes,
    embedding_grad_bytes,
    end_activation_bytes,
    engine_precision,
    gathered_param_bytes,
    loss_working_bytes,
    memo,
    model_state_bytes,
    rank_activation_bytes,
    rank_model_states,
    rank_param_count,
    reduce_working_bytes,
    regathered_bytes,
    step_grads,
    step_peak_bytes,
    zero1_rank_loads,
)
from flopwise.plan.shape import RankLoad, Shape
from flopwise.plan.stack import Stack

Loads = list[tuple[RankLoad, int]]  # each distinct pipeline rank's load with the first rank that has it
FIT_MARGIN = 0.10  # share of device memory left free for fragmentation and allocator slack
RUNTIME_RESERVE = 1.0 * 2**30  # CUDA context, NCCL and cuBLAS workspaces per device


@dataclass(frozen=True, kw_only=True)
class EngineRun:
    """What this engine's per-rank bytes depend on besides the layout and the rank."""

    model: ModelConfig
    seq: int  # data.seq_len
    global_batch: int  # sequences per optimizer step
    dtype: str = "bf16"  # train.dtype
    compile: bool | str = "auto"  # train.compile; with `steps`, decides layout.rules.compiles
    steps: float = math.inf  # the run's length (train.steps; the planner: its token budget's steps)
    document_mask: bool = False  # data.document_mask
    cpu: bool = False  # the engine on CPUs: its attention core computes in fp32, RMSNorm is composite ops
    float8: str = "none"  # train.float8: the recipe of the blocks' float8 linears
    loss_chunk_tokens: int | str = "auto"  # train.loss_chunk_tokens (layout.rules.loss_chunk_tokens)
    fake: bool = False  # a rehearsal's fake process group (on CPUs): its collectives copy nothing

    @classmethod
    def of(cls, cfg: Config, cpu: bool = False, fake: bool = False) -> EngineRun:
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
            loss_chunk_tokens=cfg.train.loss_chunk_tokens,
            fake=fake,
        )

    def loss_chunk(self, lo: Layout) -> int:
        """Tokens per chunk of the engine's head and loss under `lo` (0: unchunked)."""
        return loss_chunk_tokens(
            self.loss_chunk_tokens, lo.micro_batch * self.seq // lo.cp, self.model.vocab_size, lo.tp
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
    received: float  # the pipeline's receive buffers, allocated in the first step and kept
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
    stages: tuple[int, ...] = (),
) -> RankMemory:
    """What the rank at these mesh coordinates holds: `layers` blocks (its pipeline stages), the
    embedding and/or the head; `pp_rank` sets its micro-batches in flight, `shard_rank` its FSDP2
    shard, `dp_rank` its ZeRO-1 share. `cache`: one dict per run (a search shares it across
    layouts): the tensor walks are memoised by what they depend on. `stages`: the layers of each
    of its stages (recompute_every counts per stage; by default one stage)."""
    m, fsdp2 = run.model, lo.fsdp2
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
    where = (layers, embedding, head, pp_rank, stages, lo.pp_schedule, lo.pp, lo.n_stages, lo.cp, lo.micro_batch)
    how = (lo.tp, lo.sequence_parallel, lo.recompute, lo.recompute_every, lo.microbatches(run.global_batch), fsdp2)
    acts, held, received = memo(
        cache,
        ("saved", *where, *how, flash, precision, compiled),
        lambda: _saved_activations(
            run, lo, layers, embedding, head, pp_rank, flash, precision, cache, stages, compiled
        ),
    )
    gathered = _gathered_params(run, lo, layers, embedding, head, cache)
    other = gathered + _autocast_copies(run, lo, layers, head, compiled, cache)
    work = _working_set(run, lo, head, precision, cache)
    grads, grads_held = step_grads(lo, lo.microbatches(run.global_batch), states.grads)
    if fsdp2 and lo.pp > 1:  # the held bytes carry the unsharded gradients; the shards come at the end
        grads_held = False
    return RankMemory(
        params=states.params,
        grads=states.grads,
        optimizer=states.optimizer,
        activations=acts,
        gathered=gathered,
        other=other + work,
        buffers=buffer_bytes(m, layers, lo.tp, len(stages) or 1),
        received=received,
        step_grads=grads,
        peak=max(
            step_peak_bytes(grads, grads_held, held, other + work),
            _reduce_peak(run, lo, layers, precision, grads, grads_held, other, held, cache),
        ),
    )


def _reduce_peak(
    run: EngineRun,
    lo: Layout,
    layers: int,
    precision: SavedPrecision,
    grads: float,
    grads_held: bool,
    other: float,
    held: float,
    cache: dict | None,
) -> float:
    """The step's bytes at ZeRO-2's first reduce (FSDP2 keeps the blocks gathered): the backward of
    the last block has freed its activations and its gathered copy, and its reduce's working set
    (`plan.memory.reduce_working_bytes`) comes beside everything else. None but under FSDP2's
    ZeRO-2 on more than one shard without a pipeline (ZeRO-3's re-gathered blocks book theirs in
    the working set)."""
    if not lo.fsdp2 or lo.reshards_params or lo.dp_shard * lo.cp == 1 or lo.pp > 1 or not layers:
        return 0.0  # a pipeline stage reduces after its last micro-batch's backward, its forwards freed
    block = rank_param_count(run.model, lo, 1, False, False, cache)
    work = reduce_working_bytes(block, lo, precision.compute, gloo=run.cpu and not run.fake)
    kept = held * (layers - 1) / layers + (grads if grads_held else 0.0)
    return other - precision.compute * block + kept + work


def _saved_activations(
    run: EngineRun,
    lo: Layout,
    layers: int,
    embedding: bool,
    head: bool,
    pp_rank: int,
    flash: bool,
    precision: SavedPrecision,
    cache: dict | None,
    stages: tuple[int, ...],
    compiled: bool,
) -> tuple[float, float, float]:
    """(saved, held, received): the blocks' saved activations at the rank's peak with what each
    stage's forward keeps outside its blocks (the embedding's end on the rank's first stage, the
    head's on its last); under a pipeline schedule what it holds with them at its high-water mark
    (the sends the schedule holds, what each stage's backward holds at its end: `plan.memory.
    held_forwards_bytes`; a received input is its receive buffer, resident), and those buffers."""
    m, chunk, n = run.model, run.loss_chunk(lo), len(stages) or 1

    def end(emb: bool, hd: bool) -> float:
        return memo(
            cache,
            ("end", lo.fsdp2, precision.compiled, lo.cp, lo.micro_batch, lo.tp, emb, hd, chunk),
            lambda: end_activation_bytes(m, run.seq // lo.cp, lo.micro_batch, lo.tp, emb, hd, precision, chunk),
        )

    ends = tuple(end(embedding and c == 0, head and c == n - 1) for c in range(n))
    rank = (m, lo, run.seq, run.global_batch, layers, flash, run.document_mask, precision, pp_rank, cache, stages)
    saved = rank_activation_bytes(*rank, ends)
    if lo.pp == 1:
        return saved, saved, 0.0
    send, in_flight = _send_bytes(run, lo, precision)
    spent = _backward_ends(run, lo, stages or (layers,), embedding, head, precision, compiled, cache)
    boundary = _boundary_bytes(run, lo, precision)
    ends = tuple(e - (boundary if g > 0 else 0.0) for e, g in zip(ends, stage_ids(pp_rank, lo), strict=True))
    grads = _unsharded_grads(run, lo, stages or (layers,), embedding, head, cache)
    held = in_flight + rank_activation_bytes(*rank, ends, send, spent, grads)
    return saved, held, _recv_bytes(run, lo, pp_rank, precision)


def _unsharded_grads(
    run: EngineRun, lo: Layout, stages: tuple[int, ...], embedding: bool, head: bool, cache: dict | None
) -> tuple[float, ...]:
    """Under FSDP2, the gradients each of a pipeline rank's stages accumulates from its first
    backward to the step's end: torch's stages turn FSDP2's gradient sync off until their last
    micro-batch (PipelineStage.backward_maybe_with_nosync, perform_reduce_grad), so FSDP2 keeps
    them unsharded, in its fp32 reduce dtype (measured: `plan measure` of an interleaved pp 2 ×
    dp 2 ZeRO-2 run, FSDP::post_backward_reshard's fp32 copies live at both ranks' high-water marks)."""
    if not lo.fsdp2:
        return ()
    n = len(stages)
    return tuple(
        4.0 * rank_param_count(run.model, lo, k, embedding and c == 0, head and c == n - 1, cache)
        for c, k in enumerate(stages)
    )


def _backward_ends(
    run: EngineRun,
    lo: Layout,
    stages: tuple[int, ...],
    embedding: bool,
    head: bool,
    precision: SavedPrecision,
    compiled: bool,
    cache: dict | None,
) -> tuple[float, ...]:
    """What the backward through each of a pipeline rank's stages holds when it ends: the
    embedding's dense gradient on the first stage; under eager autocast (fp32 weights, no FSDP2)
    the compute-dtype gradient of every weight the stage cast, waiting for the casts' backward,
    which autograd runs last (autocast caches one cast per step, made before the stage's other
    nodes). Measured on `plan measure` of an interleaved pp 2 run (aten::embedding_dense_backward,
    MmBackward0's outputs live at the first rank's high-water mark)."""
    n, casts, float8 = len(stages), run.dtype == "bf16" and not lo.fsdp2 and not compiled, run.float8 != "none"
    out = []
    for c, k in enumerate(stages):
        hd = head and c == n - 1
        grads = 0.0
        if casts:  # the same bytes as the casts themselves (`_autocast_copies`' key)
            grads = memo(
                cache,
                ("copies", k, hd, lo.tp, float8),
                lambda k=k, hd=hd: autocast_weight_copy_bytes(run.model, k, hd, lo.tp, float8),
            )
        emb = embedding_grad_bytes(run.model, lo.tp, precision) if embedding and c == 0 else 0.0
        out.append(grads + emb)
    return tuple(out)


def _boundary_bytes(run: EngineRun, lo: Layout, precision: SavedPrecision) -> float:
    """One stage-boundary tensor of this engine (activations forward, their gradients back): the
    micro-batch's residual stream, its sequence shard under sequence parallel, in its dtype
    (plan.rank books the same elements)."""
    seq, d = run.seq // lo.cp, run.model.d_model
    return precision.residual * pp_boundary_elements(seq, lo.micro_batch, d, lo.tp, lo.sequence_parallel)


def _send_bytes(run: EngineRun, lo: Layout, precision: SavedPrecision) -> tuple[float, float]:
    """(held until the step ends, in flight) bytes of the stage-boundary tensors this engine sends.
    torch's interleaved and GPipe schedules wait on their sends late and each send's Work keeps
    its tensor; `parallel.pipeline.releasing_sends` drops a send's Work once `is_completed`, which
    NCCL reports when the transfer ends (then one each way is in flight), gloo and the rehearsal's
    fake backend only after the wait: on a CPU every send is held (measured: `plan measure` and
    `plan rehearse` of an interleaved pp 2 run)."""
    if lo.pp == 1 or lo.pp_schedule not in ("interleaved-1f1b", "gpipe"):
        return 0.0, 0.0
    one = _boundary_bytes(run, lo, precision)
    return (one, 0.0) if run.cpu else (0.0, 2 * one)


def _recv_bytes(run: EngineRun, lo: Layout, pp_rank: int, precision: SavedPrecision) -> float:
    """The receive buffers torch's PipelineStage allocates in its first step and keeps: one
    stage-boundary tensor per micro-batch for each of the rank's stages that receives activations
    (all but the first) and one for each that receives gradients (all but the last)
    (stage.py: `_setup_forward_recv_info`, `_setup_backward_recv_info`)."""
    last = lo.n_stages - 1
    ends = sum((g > 0) + (g < last) for g in stage_ids(pp_rank, lo))
    return ends * lo.microbatches(run.global_batch) * _boundary_bytes(run, lo, precision)


def _gathered_params(run: EngineRun, lo: Layout, layers: int, embedding: bool, head: bool, cache: dict | None) -> float:
    """FSDP2's all-gathered parameters held when the activations peak (none when it reshards them)."""
    if not lo.fsdp2 or lo.reshards_params:
        return 0.0
    f8_gather = float8_all_gather(run.float8, lo)
    return memo(
        cache,
        ("gathered", layers, embedding, head, lo.tp, lo.zero >= 2, lo.dp_shard * lo.cp, f8_gather),
        lambda: gathered_param_bytes(run.model, lo, layers, embedding, head, run.dtype, cache, f8_gather),
    )


def _autocast_copies(run: EngineRun, lo: Layout, layers: int, head: bool, compiled: bool, cache: dict | None) -> float:
    """Autocast's bf16 weight copies (none under FSDP2's bf16 parameters); compiled blocks keep
    theirs among their saved activations, so only the head's count here."""
    if run.dtype != "bf16" or lo.fsdp2:
        return 0.0
    kept, float8 = 0 if compiled else layers, run.float8 != "none"
    return memo(
        cache,
        ("copies", kept, head, lo.tp, float8),
        lambda: autocast_weight_copy_bytes(run.model, kept, head, lo.tp, float8),
    )


def _working_set(run: EngineRun, lo: Layout, head: bool, precision: SavedPrecision, cache: dict | None) -> float:
    """The loss's working set and ZeRO-3's re-gathered blocks: they come one after the other in
    backward, so the larger counts."""
    m, chunk, staged = run.model, run.loss_chunk(lo), lo.pp > 1
    return memo(
        cache,
        ("work", lo.fsdp2, precision.compiled, lo.cp, lo.micro_batch, lo.tp, lo.reshards_params, head, chunk, staged),
        lambda: max(
            loss_working_bytes(m, run.seq // lo.cp, lo.micro_batch, lo.tp, precision, chunk, staged) if head else 0.0,
            regathered_bytes(rank_param_count(m, lo, 1, False, False, cache), lo, precision.compute),
        ),
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


def layout_memory(
    sh: Shape,
    lo: Layout,
    seq: int,
    global_batch: int,
    stack: Stack,
    loads: list[tuple[RankLoad, int]],
    cache: dict | None,
    *,
    compile: bool | str,
    steps: float,
    dtype: str,
    float8: str,
    cpu: bool,
    loss_chunk: int | str = "auto",
) -> tuple[dict[str, float], float]:
    """The worst rank's bytes by the stack's account (this engine's, or a published stack's), and
    the optimizer elements the busiest rank steps. `loads`: each distinct pipeline rank's load with
    the first rank that has it (plan.shape.first_ranks)."""
    if not stack.engine_activations:
        return _published_memory(sh, lo, seq, global_batch, stack, loads, cache)
    run = memo(
        cache,
        ("run", seq, global_batch, compile, steps, dtype, float8, loss_chunk),
        lambda: EngineRun(
            model=sh.config,
            seq=seq,
            global_batch=global_batch,
            dtype=dtype,
            compile=compile,
            steps=steps,
            document_mask=sh.document_mask,
            float8=float8,
            cpu=cpu,
            loss_chunk_tokens=loss_chunk,
        ),
    )
    return engine_memory(run, lo, stack, loads, cache)


def engine_memory(
    run: EngineRun, lo: Layout, stack: Stack, loads: list[tuple[RankLoad, int]], cache: dict | None
) -> tuple[dict[str, float], float]:
    """The worst rank's bytes by this engine's own account (`rank_memory`, what the
    joint tests and `plan --measure` set beside the engine's measured bytes), and the optimizer
    elements the busiest rank steps. Each distinct pipeline rank is booked at its largest data-
    parallel share: FSDP2's first shard (torch.chunk gives it the most), ZeRO-1's busiest rank."""
    worst: dict[str, float] = {}
    opt_elements = 0.0
    for load, pp_rank in loads:
        dp_rank = busiest_dp_rank(run.model, lo, load.layers, load.embedding, load.head, cache)
        r = rank_memory(
            run,
            lo,
            layers=load.layers,
            embedding=load.embedding,
            head=load.head,
            pp_rank=pp_rank,
            shard_rank=0,
            dp_rank=dp_rank,
            flash=stack.flash_attention,
            cache=cache,
            stages=load.stages,
        )
        opt_elements = max(opt_elements, r.optimizer / stack.optimizer_state_bytes)
        resident = r.buffers + r.received + RUNTIME_RESERVE
        mem = {
            "params": r.params,
            "grads": r.grads,
            "optimizer": r.optimizer,
            "activations": r.activations,
            "other": r.other + resident,
            "step_peak": r.peak,
            "total": r.params + r.optimizer + r.grads - r.step_grads + r.peak + resident,
        }
        if not worst or mem["total"] > worst["total"]:
            worst = mem
    return worst, opt_elements


def _published_memory(
    sh: Shape, lo: Layout, seq: int, global_batch: int, stack: Stack, loads: Loads, cache: dict | None
) -> tuple[dict[str, float], float]:
    """The worst pipeline rank's bytes by a published stack's account, and the optimizer elements a
    rank steps: ZeRO's Ψ formulas with the stack's bytes per parameter (Megatron's distributed
    optimizer shards flat buffers, so Ψ/N), Korthikanti's activations with the first stage's
    micro-batches in flight, 16-bit logits kept and the loss's fp32 softmax beside ZeRO-3's
    re-gathered layers; gradients held through the step."""
    shard = lo.dp_shard
    zero3_live = regathered_bytes(sh.layer_params / lo.tp, lo)
    loss_work = lo.micro_batch * seq / lo.cp * sh.vocab / lo.tp * (2 + 4) + zero3_live
    worst: dict[str, float] = {}
    opt_elements = 0.0
    for load, _ in loads:
        st = model_state_bytes(
            load.params,
            lo.zero,
            shard,
            stack.optimizer_state_bytes,
            stack.param_bytes,
            stack.grad_bytes,
            params_sharded=lo.reshards_params,
        )
        opt_elements = max(opt_elements, load.params / (shard if lo.zero >= 1 else 1))
        activations = rank_activation_bytes(
            sh.config,
            lo,
            seq,
            global_batch,
            load.layers,
            stack.flash_attention,
            sh.document_mask,
            KORTHIKANTI,
            cache=cache,
            stages=load.stages,
        )
        work = loss_work if load.head else zero3_live
        peak = step_peak_bytes(st.grads, True, activations, work)
        mem = {
            "params": st.params,
            "grads": st.grads,
            "optimizer": st.optimizer,
            "activations": activations,
            "other": work + RUNTIME_RESERVE,
            "step_peak": peak,
            "total": st.params + st.optimizer + peak + RUNTIME_RESERVE,
        }
        if not worst or mem["total"] > worst["total"]:
            worst = mem
    return worst, opt_elements
