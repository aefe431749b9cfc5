"""Memory per device: model states by ZeRO stage and activations by parallel layout. Pure Python.

Model states (Rajbhandari et al. 2020, §3.1 and Table 1): mixed-precision Adam keeps 2Ψ bytes of
16-bit parameters, 2Ψ of 16-bit gradients and KΨ of optimizer state (K = 12: fp32 master copy,
momentum, variance). Stage 1 shards the optimizer state over the N_d data-parallel ranks, stage 2
the gradients too, stage 3 the parameters too.

Activations (Korthikanti et al. 2022, §4 and Table 2), generalised from GPT's 4h GeLU MLP and
multi-head attention to any ffn width, SwiGLU, grouped-query attention, flash attention and
dropout-free models. With the paper's assumptions (MHA, ffn = 4h, dropout, no flash) it is exactly
their s·b·h·(34 + 5·a·s/h) and its tensor/sequence-parallel and recompute variants (tested). The
same function books what this engine keeps (`engine_precision`: fp32, bf16 autocast over an fp32
residual stream, or bf16 under FSDP2; eager or compiled), measured with parallel.accounting.SavedBytes.
The tensor lists and their measurements: docs/activation-memory.md.

This engine's per-tensor model states (`rank_model_states`: its stage split, tensor-parallel slices,
ZeRO-1's whole-tensor partition, FSDP2's dim-0 chunks) and the other pieces of one rank's bytes are
put together in plan.rank_memory.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from flopwise.config.schema import ModelConfig
from flopwise.flops import count_params, param_shapes
from flopwise.layout.linears import LINEAR_KEYS, float8_shapes, float8_weight_elements, tp_local_shape

_OPTIMIZER_BYTES_PER_PARAM = 12  # K of mixed-precision Adam


@dataclass(frozen=True, kw_only=True)
class ModelStates:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def memo(cache: dict | None, key: tuple, compute):
    """cache[key], computed on first use (no cache: computed every time). One cache serves one
    model (a search, a prediction), so keys name only what varies for it."""
    if cache is None:
        return compute()
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def model_state_bytes(
    psi: float,
    zero: int,
    shard: int,
    k: float = _OPTIMIZER_BYTES_PER_PARAM,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    params_sharded: bool | None = None,
) -> ModelStates:
    """Bytes of parameters, gradients and optimizer state on one device holding `psi` parameters
    (its tensor/pipeline share), sharded `shard` ways by ZeRO stage `zero` (params_sharded: whether
    the parameters stay sharded through the step; by default from zero >= 3)."""
    sharded = zero >= 3 if params_sharded is None else params_sharded
    return ModelStates(
        params=param_bytes * psi / (shard if sharded else 1),
        grads=grad_bytes * psi / (shard if zero >= 2 else 1),
        optimizer=k * psi / (shard if zero >= 1 else 1),
    )


@dataclass(frozen=True, kw_only=True)
class SavedPrecision:
    """How a stack keeps activations for backward: bytes per element of the compute dtype (linear
    inputs and outputs, Q/K/V, attention and MLP tensors) and of the residual stream (norm inputs),
    and whether to book what PyTorch's kernels in this engine keep (`engine`; `compiled`: what
    AOTAutograd's partitioner keeps of a torch.compile'd block and loss) or Korthikanti et al.'s
    tensor list (Megatron's fused kernels)."""

    compute: int = 2
    residual: int = 2
    engine: bool = False
    attention: int = 0  # bytes of the attention core's saved Q, K, V and output; 0: the compute dtype's
    compiled: bool = False
    cpu: bool = False  # on a CPU RMSNorm is composite ops (it keeps x·rstd in fp32 too; CUDA's fused
    # kernel keeps its input and rstd), and a compiled checkpoint saves the CPU generator's state
    float8: bool = False  # the blocks' float8 linears (train.float8) keep their weights, not a bf16 cast


KORTHIKANTI = SavedPrecision()


def engine_precision(
    dtype: str, fsdp: bool, cpu: bool = False, compiled: bool = False, float8: bool = False
) -> SavedPrecision:
    """This engine's activations: fp32 throughout; or bf16 autocast over an fp32 residual stream
    (fp32 master weights); or, under FSDP2 with bf16 param_dtype, bf16 throughout (FSDP2 casts
    each block's inputs to bf16, so the residual stream is bf16). On a CPU the attention core runs
    in fp32 whatever the dtype (model.layers.CoreAttention). `compiled`: the blocks (and the loss)
    are torch.compile'd (layout.rules.compiles). `float8`: the blocks' linears run in float8
    (train.float8, torchao): eager, they keep exactly what autocast's linears keep (torchao saves
    the high-precision input, cast to the autocast dtype, and the weight itself; measured with
    SavedBytes); they make no bf16 weight copy."""
    if dtype == "fp32":
        return SavedPrecision(compute=4, residual=4, engine=True, compiled=compiled, cpu=cpu, float8=float8)
    return SavedPrecision(
        compute=2,
        residual=2 if fsdp else 4,
        engine=True,
        attention=4 if cpu else 0,
        compiled=compiled,
        cpu=cpu,
        float8=float8,
    )


# torch.get_rng_state(): the CPU generator's state, which a compiled checkpoint saves as a tensor
# for each checkpointed region on a CPU (eager checkpoint keeps it outside autograd's saved tensors;
# on CUDA, measured on an H200, neither does).
CHECKPOINT_RNG_STATE_BYTES = 5056


def activation_bytes_per_layer(
    m: ModelConfig,
    seq: int,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    flash: bool = True,
    dropout: bool | None = None,
    mask_keys: int = 0,
    precision: SavedPrecision = KORTHIKANTI,
    cp: int = 1,
) -> float:
    """Bytes one transformer layer keeps for backward, for one micro-batch, on one device; `seq`
    is the device's share of the sequence (seq_len / cp under context parallel); `mask_keys`: the
    keys each query of a document mask sees (0: no mask). Three regimes, one function each:
    Korthikanti et al. 2022's tensor list for Megatron's kernels (`_korthikanti_layer`), and what
    this engine keeps, eager (`_eager_layer`) or torch.compile'd (`_compiled_layer`); full
    recompute keeps only the layer's input. The tensor lists and what was measured against them:
    docs/activation-memory.md."""
    drop = (m.dropout > 0) if dropout is None else dropout
    rep_div = tp if sequence_parallel else 1
    if recompute == "op":
        return _op_layer(m, seq, micro_batch, tp, sequence_parallel, flash, precision)
    if recompute == "full":
        rng = CHECKPOINT_RNG_STATE_BYTES if precision.engine and precision.compiled and precision.cpu else 0
        return precision.residual * seq * micro_batch * m.d_model / rep_div + rng
    e = precision.compute
    a = (precision.attention or e) if recompute == "none" else e  # selective recompute keeps e-byte inputs
    regime = _korthikanti_layer if not precision.engine else _compiled_layer if precision.compiled else _eager_layer
    replicated, linear, split, extra = regime(
        m, seq, micro_batch, tp, rep_div, recompute, flash, drop, a, precision, cp, mask_keys
    )
    scores = 0.0
    if not flash and recompute != "selective":  # softmax output, and with dropout its mask and output
        scores = (2 + (3 if drop else 0)) * m.n_heads * seq * seq * micro_batch
    mask = a * seq * micro_batch * mask_keys if recompute == "none" else 0  # SDPA's copy, one for all heads
    return replicated / rep_div + linear + (split + scores) / tp + mask + extra


def _op_layer(
    m: ModelConfig, s: int, b: int, tp: int, sequence_parallel: bool, flash: bool, precision: SavedPrecision
) -> float:
    """Per-operator recompute (parallel.apply's op policy): the block's input (the checkpoint's),
    and the outputs of its matmuls and attention kernel; the rest is recomputed in backward. The
    column-parallel outputs (Q, K, V, the MLP's up projections) and the core's are split over tp;
    under tensor parallel the row-parallel ones (attention output, MLP down) are kept after their
    collective (a sequence shard under sequence parallel) and their matmuls rerun. Measured with
    PeakMemory (what a forward leaves allocated): exact on a CPU, fp32 and bf16."""
    sb, sbh = s * b, s * b * m.d_model
    e, r = precision.compute, precision.residual
    a = precision.attention or e
    hq, hkv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    up = (2 if m.mlp == "swiglu" else 1) * e * sb * m.ffn_dim
    split = e * sb * (hq + 2 * hkv) + a * sb * hq + (4 * m.n_heads * sb if flash else 0) + up
    rep_div = tp if sequence_parallel else 1
    rng = CHECKPOINT_RNG_STATE_BYTES if precision.engine and precision.cpu else 0
    return (r + 2 * e) * sbh / rep_div + split / tp + rng


def checkpointed_layers(stages: tuple[int, ...], every: int) -> int:
    """Blocks a rank checkpoints under recompute_every=N: of each of its stages, the first and then
    every Nth (parallel.apply.apply_recompute)."""
    return sum(-(-k // every) for k in stages)


# Each regime returns (replicated: kept whole on every tensor-parallel rank unless sequence
# parallel, linear-input bytes, split: divided over tp, extra: neither) for recompute none/selective.


def _korthikanti_layer(m, s, b, tp, rep_div, recompute, flash, drop, a, precision, cp, mask_keys):
    """Korthikanti et al. 2022 Table 2, generalised: norm inputs and residual dropout masks, the
    attention and MLP inputs (1/t under sequence parallel), Q/K/V, the core's output, the MLP."""
    sb, sbh = s * b, s * b * m.d_model
    e, r = precision.compute, precision.residual
    hq, hkv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    masks = 2 * sbh if drop else 0
    mlp = (4 if m.mlp == "swiglu" else 2) * e * s * b * m.ffn_dim
    split = a * sb * (hq + 2 * hkv) + a * sb * hq + mlp
    return 2 * r * sbh + masks, 2 * e * sbh / rep_div, split, 0


def _eager_layer(m, s, b, tp, rep_div, recompute, flash, drop, a, precision, cp, mask_keys):
    """This engine's eager layer (PyTorch's kernels): norm inputs and internals, one cast per
    linear under autocast, SDPA's tensors, the MLP's."""
    sb, sbh = s * b, s * b * m.d_model
    e, r = precision.compute, precision.residual
    hq, hkv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    rms, casts = m.norm == "rmsnorm", r != e
    inputs = 2 if (not m.parallel_block or (rms and r < 4)) else 1
    norms = inputs * (4 if rms else r) * sbh + 2 * _norm_internals(m, sb, sbh, r, precision)
    masks = 2 * sbh if drop else 0
    linear = ((3 if casts else 1) + (2 if casts and m.mlp == "swiglu" else 1)) * e * sbh
    mlp = {"swiglu": 4, "relu": 1}.get(m.mlp, 2) * e * s * b * m.ffn_dim
    attn_extra = _logsumexp_bytes(m, sb, flash, recompute)
    attn_extra += e * sb * hq if _output_copy(m, a, e) and recompute == "none" else 0
    split = a * sb * (hq + 2 * hkv) + a * sb * hq + mlp + attn_extra + _kv_gathered_bytes(m, sb, a, cp)
    return norms + masks, linear, split, _engine_extra_bytes(m, s, precision, a, cp, mask_keys, recompute)


def _compiled_layer(m, s, b, tp, rep_div, recompute, flash, drop, a, precision, cp, mask_keys):
    """A torch.compile'd block of this engine (AOTAutograd's min-cut partitioner): the block's
    input, the norms' statistics and outputs, matmul inputs and outputs, the attention core as
    eager keeps it, and under autocast the bf16 cast of every linear weight."""
    sb, sbh = s * b, s * b * m.d_model
    e, r = precision.compute, precision.residual
    hq, hkv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    rms, casts = m.norm == "rmsnorm", r != e
    masks = 2 * sbh if drop else 0
    stats = (1 if m.parallel_block else 2) * (4 * sb if rms else 2 * r * sb)
    replicated = r * sbh + stats + (0 if m.parallel_block else e * sbh) + masks
    mlp = {"swiglu": 3 * e, "relu": e + 1}.get(m.mlp, 2 * e) * s * b * m.ffn_dim
    attn_extra = _logsumexp_bytes(m, sb, flash, recompute) + (e * sb * hq if _output_copy(m, a, e) else 0)
    out = a * sb * hq if recompute == "none" else 0
    split = a * sb * (hq + 2 * hkv) + out + mlp + attn_extra + _kv_gathered_bytes(m, sb, a, cp)
    weights = e * count_params(m).layer_matmul / m.n_layers / tp if casts else 0.0
    if casts and precision.float8:  # float8 linears cast their weights afresh in backward (an upper
        # bound: torchao's emulation on a CPU keeps less still, the partitioner recomputing more)
        weights -= e * float8_weight_elements(m, tp)
    rng = CHECKPOINT_RNG_STATE_BYTES if recompute == "selective" and precision.cpu else 0
    return (
        replicated,
        2 * e * sbh,
        split,
        _engine_extra_bytes(m, s, precision, a, cp, mask_keys, recompute) + weights + rng,
    )


def _logsumexp_bytes(m: ModelConfig, sb: float, flash: bool, recompute: str) -> float:
    """The fused attention kernel's fp32 log-sum-exp (not kept under selective recompute)."""
    return 4 * m.n_heads * sb if flash and recompute == "none" else 0


def _output_copy(m: ModelConfig, a: int, e: int) -> bool:
    """Whether the output projection keeps its own copy of the core's output: partial rotary
    leaves it (b, h, s, d)-contiguous, or the core computed in another dtype (a CPU under bf16)."""
    return m.pos == "rope" and m.rotary_dim < m.head_dim or a != e


def _kv_gathered_bytes(m: ModelConfig, sb: float, a: int, cp: int) -> float:
    """Context parallel: K and V all-gathered over the whole sequence, beyond the local share."""
    return a * sb * 2 * m.n_kv_heads * m.head_dim * (cp - 1)


def _engine_extra_bytes(
    m: ModelConfig, s: float, precision: SavedPrecision, a: int, cp: int, mask_keys: int, recompute: str
) -> float:
    """Per layer outside the tensor-parallel split: SDPA's copy of the (s, s·cp) causal mask under
    context parallel without a document mask, and FSDP2's per-block casts of RoPE's cos/sin."""
    e, r = precision.compute, precision.residual
    cp_mask = a * s * s * cp if cp > 1 and not mask_keys and recompute == "none" else 0
    tables = 2 * e * s * m.rotary_dim if m.pos == "rope" and r == e == 2 else 0
    return cp_mask + tables


def _norm_internals(m: ModelConfig, sb: float, sbh: float, r: int, precision: SavedPrecision) -> float:
    """What one eager norm keeps beside its input: RMSNorm its fp32 rstd, and on a CPU also the
    fp32 normalised input; LayerNorm its mean and rstd."""
    if m.norm == "rmsnorm":
        return 4 * sb + (4 * sbh if precision.cpu else 0)
    return 2 * r * sb


def in_flight_microbatches(schedule: str, pp: int, microbatches: int, rank: int = 0) -> int:
    """Micro-batches whose forwards pipeline rank `rank` holds at its peak, for the schedules that
    run each micro-batch through the rank's stages together. GPipe: all m (Huang et al. 2019).
    1F1B: min(p − r, m) (Narayanan et al. 2021; measured, `flopwise plan --measure`). ZB-V keeps
    1F1B's p on every rank (Qi et al. 2024), DualPipeV one more (DeepSeek-V3 report: p + 1)."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return microbatches
    if schedule == "dualpipev":
        return min(microbatches, pp + 1)
    return min(microbatches, pp - rank if schedule == "1f1b" else pp)


def held_forwards_bytes(
    schedule: str,
    pp: int,
    microbatches: int,
    weights: tuple[float, ...],
    rank: int = 0,
    send: float = 0.0,
    spent: tuple[float, ...] = (),
    grads: tuple[float, ...] = (),
) -> float:
    """The most pipeline rank `rank` holds at once of its forwards' saved bytes, `weights[c]` being
    what one micro-batch's forward through its c-th stage (r, r + p, ...) keeps until its backward,
    and of its sends, `send` bytes a stage-boundary tensor: torch 2.13's runtime schedules
    (_PipelineScheduleRuntime, which runs Interleaved 1F1B) wait on their sends only when the step
    ends, so every activation sent forward and gradient sent back is held until then; GPipe
    (ScheduleGPipe) waits on its forward sends when the forwards end. `spent[c]`: what the backward
    through stage c holds when it ends, having freed that forward's `weights[c]` (the embedding's
    dense gradient; autocast's compute-dtype weight gradients, whose shared casts run last).
    `grads[c]`: what stage c's first backward leaves until the step ends (FSDP2's unsharded
    gradients, which torch's stages reduce after their last micro-batch).

    Interleaved 1F1B is followed op by op in torch's order (ScheduleInterleaved1F1B): a round of
    r_m = m / max(1, ⌊m/p⌋) micro-batches, (v−1)·r_m + 2(p−1−rank) warm-up forwards (at most m·v),
    then a forward and a backward per step, forward k through stage ⌊k/r_m⌋ mod v and backward k
    through stage v−1 − (⌊k/r_m⌋ mod v), then the backwards left. With even stages and no sends rank
    0 holds Korthikanti et al.'s p(1 + (p−1)/(pv)) stages' worth (2022, §4.2.3); later ranks hold
    fewer, the head's stage (rank p−1's last) one micro-batch. Every stage's first backward comes
    within the first r_m·v steps; after them the held bytes repeat every r_m·v steps but for the
    sends, which only grow, and the backwards left only free. The other schedules hold
    `in_flight_microbatches` of every stage and all of `grads` (1F1B waits on each send before the
    next; ZB-V's and DualPipeV's held sends are not booked)."""
    v = len(weights)
    over = [(spent[c] - weights[c]) if spent else 0.0 for c in range(v)]  # a backward's end beyond its start
    every = sum(grads)
    if schedule == "gpipe" and pp > 1:
        return microbatches * (sum(weights) + (send if rank < pp - 1 else 0.0)) + max(0.0, *over) + every
    if schedule != "interleaved-1f1b" or pp == 1:
        return in_flight_microbatches(schedule, pp, microbatches, rank) * sum(weights) + max(0.0, *over) + every
    per_round = microbatches // max(1, microbatches // pp)
    total, period = microbatches * v, per_round * v
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)
    steady = total - warmup  # backward k has a forward before it while k < steady
    if not (send or spent or grads) and min(weights) == max(weights):  # even stages: the first steady step's
        return weights[0] * min(warmup + 1, total)
    fwd = [weights[c] + (send if c * pp + rank < v * pp - 1 else 0.0) for c in range(v)]  # by stage
    bwd = [(send if c * pp + rank > 0 else 0.0) - weights[c] for c in range(v)]
    first = grads or (0.0,) * v

    def walk(held: float, k0: int, k1: int) -> tuple[float, float]:
        """(held after, most held) over backwards k0..k1-1, in spans where neither stage moves."""
        cuts = {k0, k1, *range(k0 - k0 % per_round + per_round, k1, per_round)}
        cuts |= {k for k in range(k0 - (warmup + k0) % per_round + per_round, min(k1, steady), per_round)}
        cuts |= {steady} if k0 < steady < k1 else set()
        most = 0.0
        for a, e in itertools.pairwise(sorted(cuts)):
            b = v - 1 - (a // per_round) % v
            f = fwd[((warmup + a) // per_round) % v] if a < steady else 0.0
            g = first[b] if a < period and a % per_round == 0 else 0.0  # stage b's first backward
            step = f + bwd[b]
            most = max(most, held + f, held + f + over[b] + g)
            if e - a > 1:
                top = f + max(0.0, over[b])
                most = max(most, held + g + step + top, held + g + (e - 1 - a) * step + top)
            held += g + (e - a) * step
        return held, max(most, held)

    rounds, part = divmod(warmup, per_round)  # the warm-up: whole rounds of one stage each, then part of one
    held = peak = per_round * (rounds // v * sum(fwd) + sum(fwd[: rounds % v])) + part * fwd[rounds % v]
    held, most = walk(held, 0, period)
    peak = max(peak, most)
    if steady > period:  # periodic but for the sends: the last whole period and what is left of one
        grown = walk(0.0, period, 2 * period)[0]
        whole, rest = divmod(steady - period, period)
        if whole:
            peak = max(peak, walk(held + (whole - 1) * grown, period, 2 * period)[1])
        held += whole * grown
        if rest:
            held, most = walk(held, period, period + rest)
            peak = max(peak, most)
    start = max(steady, period)
    if start < total:  # the backwards left, from their first period on only freeing
        peak = max(peak, walk(held, start, min(total, start + period))[1])
    return peak


def rank_activation_bytes(
    m: ModelConfig,
    lo,
    seq: int,
    global_batch: int,
    layers: int,
    flash: bool = True,
    document_mask: bool = False,
    precision: SavedPrecision = KORTHIKANTI,
    pp_rank: int = 0,
    cache: dict | None = None,
    stages: tuple[int, ...] = (),
    ends: tuple[float, ...] = (),
    send: float = 0.0,
    spent: tuple[float, ...] = (),
    grads: tuple[float, ...] = (),
) -> float:
    """Saved activations a rank holding `layers` layers keeps at its peak: its forwards held at
    once (`held_forwards_bytes` on pipeline rank `pp_rank`), each stage's forward keeping its
    layers' bytes (under recompute_every=N the blocks not checkpointed at the bytes of none;
    `stages`: the rank's stage sizes, by default one stage of all its layers) and `ends[c]`, what
    the c-th stage keeps outside its layers; plus, under full recompute, the one layer whose
    activations the backward rebuilds (under op, what it recomputes beside what it kept). `lo` is
    a layout.rules.Layout; `cache` (one per model, seq and document mask) keeps the per-layer bytes;
    `send`, `spent`, `grads`: a stage-boundary tensor's bytes, what each stage's backward holds at
    its end and what its first backward leaves, to count the sends the schedule holds, the
    backward's end and the gradients too (`held_forwards_bytes`)."""

    def per_layer() -> tuple[float, float, float]:
        args = (m, seq // lo.cp, lo.micro_batch, lo.tp, lo.sequence_parallel)
        kw = dict(flash=flash, mask_keys=seq if document_mask else 0, precision=precision, cp=lo.cp)
        whole = activation_bytes_per_layer(*args, "none", **kw)
        one = activation_bytes_per_layer(*args, lo.recompute, **kw)
        return one, whole, {"full": whole, "op": max(whole - one, 0.0)}.get(lo.recompute, 0.0)

    one, whole, rebuilt = memo(
        cache, ("layer", lo.cp, lo.micro_batch, lo.tp, lo.sequence_parallel, lo.recompute, flash, precision), per_layer
    )
    every = lo.recompute_every if lo.recompute in ("op", "full") and lo.recompute_every > 1 else 1
    sizes, ends = stages or (layers,), ends or (0.0,) * len(stages or (layers,))
    if every == 1:
        weights = [one * n + e for n, e in zip(sizes, ends, strict=True)]
    else:
        kept = [checkpointed_layers((n,), every) for n in sizes]
        weights = [one * k + whole * (n - k) + e for n, k, e in zip(sizes, kept, ends, strict=True)]
    key = (lo.pp_schedule, lo.pp, lo.microbatches(global_batch), tuple(weights), pp_rank, send, spent, grads)
    return memo(cache, ("held", *key), lambda: held_forwards_bytes(*key)) + rebuilt


def end_activation_bytes(
    m: ModelConfig,
    seq: int,
    micro_batch: int,
    tp: int,
    has_embedding: bool,
    has_head: bool,
    precision: SavedPrecision,
    loss_chunk: int = 0,
) -> float:
    """What one micro-batch keeps for backward outside the layers, in this engine (measured with
    SavedBytes, 2·L1 − L2 layers): on the first stage the token ids (int64); on every stage the
    RoPE cos/sin gathered for the forward (fp32, shared by its layers); on the last the final norm's
    input and internals (as a layer's norm), the head's input (compute dtype), the targets (int64)
    and what the loss keeps: the eager loss its fp32 log-softmax over the vocabulary (split over
    tp); the compiled one (`precision.compiled`, without tensor parallel) the logits themselves in
    the compute dtype and two fp32 per-token statistics (max and log-sum-exp), never an fp32 copy.
    A chunked loss (`loss_chunk` tokens, layout.rules.loss_chunk_tokens) keeps nothing vocabulary-
    wide: its checkpoints keep the final norm's output (the residual dtype) and the targets."""
    s, b = seq, micro_batch
    sb, sbh = s * b, s * b * m.d_model
    e, r = precision.compute, precision.residual
    out = 8 * sb if has_embedding else 0.0
    out += 2 * 4 * s * m.rotary_dim if m.pos == "rope" else 0.0
    if has_head:
        norm = _norm_internals(m, sb, sbh, r, precision)
        compiled_loss = precision.compiled and tp == 1  # the engine's loss (train.engine.Engine.loss)
        loss = e * sb * m.vocab_size + 2 * 4 * sb if compiled_loss else 4 * sb * m.vocab_size / tp
        head_input, loss = (r * sbh, 0.0) if loss_chunk else (e * sbh, loss)
        out += r * sbh + norm + head_input + loss + 8 * sb
    return out


def embedding_grad_bytes(m: ModelConfig, tp: int, precision: SavedPrecision) -> float:
    """What the embedding's backward holds as it ends, before autograd adds its gradient to the one
    accumulated: the dense gradient (the table's shape, the weight's dtype) and, under tensor
    parallel, the whole table's (DTensor computes the vocab-sharded table's backward replicated)
    with two copies of this rank's shard (its redistribution and the accumulation's clone). Under a
    pipeline schedule this comes while the rank holds its other micro-batches' forwards (measured:
    aten::embedding_dense_backward's output, and at tp 2 the AccumulateGrad clones, live at the
    first pipeline rank's high-water mark in `plan measure`)."""
    table = precision.residual * m.vocab_size * m.d_model
    return table * (1 + 2 / tp) if tp > 1 else table


def buffer_bytes(m: ModelConfig, layers: int, tp: int = 1, stages: int = 1) -> float:
    """The engine's computed buffers (fp32, resident from the build on): RoPE's cos and sin tables
    and Transformer-XL's distance embeddings (one table per block) hold a row per position up to
    model.max_seq_len on every rank; ALiBi's slopes, this rank's heads. RoPE's and ALiBi's are the
    model's, so a rank running `stages` pipeline stages (each its own module) holds them that many
    times (measured: the 405B rehearsal's six stages per rank, 805 MB of tables). A large
    max_seq_len makes these, not the parameters, the bytes that do not fit (1e8 positions: 51 GB)."""
    rows = 2 * m.max_seq_len * m.rotary_dim if m.pos == "rope" else 0
    rows += m.n_heads // tp if m.pos == "alibi" else 0
    rows *= stages
    rows += layers * m.max_seq_len * m.d_model if m.pos == "relative" else 0
    return 4.0 * rows


def loss_working_bytes(
    m: ModelConfig,
    seq: int,
    micro_batch: int,
    tp: int,
    precision: SavedPrecision,
    loss_chunk: int = 0,
    staged: bool = False,
) -> float:
    """What the last stage holds at the step's high-water mark beyond the saved tensors: under a
    pipeline schedule (`staged`) the head's logits (compute dtype), the stage's output, which the
    schedule keeps until the micro-batch's backward (without one nothing refers to them after the loss's
    forward: the eager loss saves its fp32 log-softmax, not its input); and the
    fp32 vocabulary-wide tensors the eager cross-entropy's backward holds at once: two (the
    gradients of its log-softmax's output and input), three for the vocab-parallel loss under
    tensor parallel (which recomputes the softmax's exp), each split over tp. The compiled loss
    keeps the logits among its saved tensors and its fused backward writes only their gradient, in
    the compute dtype. A chunked loss (`loss_chunk` tokens) holds one chunk's: the log-softmax its
    backward recomputes and the two fp32 gradients (12 bytes a logit, fp32 or bf16; under tensor
    parallel one more for the recomputed exp), and the head's weight gradient of that chunk (compute
    dtype) beside the one accumulated so far. Measured with PeakMemory."""
    if loss_chunk:
        fp32 = 3 if tp == 1 else 4
        return (4 * fp32 * loss_chunk * m.vocab_size + precision.compute * m.vocab_size * m.d_model) / tp
    if precision.compiled and tp == 1:
        return precision.compute * seq * micro_batch * m.vocab_size
    fp32 = 2 if tp == 1 else 3
    kept = precision.compute if staged else 0
    return (kept + 4 * fp32) * seq * micro_batch * m.vocab_size / tp


def regathered_bytes(block_params: float, lo, compute_bytes: int = 2) -> float:
    """ZeRO-3's working set in backward: a re-gathered block (`block_params`: one block's parameters
    on this rank, its tensor-parallel slice) in the compute dtype and the prefetched next one, with
    their unsharded fp32 gradients before the reduce-scatter. It comes after the loss's working
    set is freed, so a step holds the larger of the two."""
    return 2 * (compute_bytes + 4) * block_params if lo.reshards_params else 0.0


def reduce_working_bytes(block_params: float, lo, compute_bytes: int, *, gloo: bool) -> float:
    """What FSDP2's post-backward reduce of one block holds (`block_params`: its parameters on this
    rank, its tensor-parallel slice): the block's unsharded gradients in the compute dtype, the
    fp32 reduce-scatter input (MixedPrecisionPolicy's reduce_dtype), this rank's fp32 output shard
    and, on gloo, the copy its reduce-scatter makes of the input. Measured: `plan measure` of a
    2-rank ZeRO-2 run (4 blocks of 37.7M parameters): 75.5 + 151 + 75.5 + 151 MB live at the last
    block's reduce, the step's high-water mark (the fake process group of a rehearsal copies nothing)."""
    shard = lo.dp_shard * lo.cp
    return block_params * (compute_bytes + 4 + 4 / shard + (4 if gloo else 0))


def step_grads(lo, microbatches: int, grads: float) -> tuple[float, bool]:
    """The gradient bytes a step allocates, and whether they exist when the activations peak (the
    start of the last micro-batch's backward). DDP's gradients are views of its buckets, which
    exist before the step, except under no_sync accumulation, where they are tensors of their own.
    They are held at the peak when an earlier micro-batch has run backward (accumulation, a
    pipeline schedule); otherwise they appear as backward frees the activations."""
    ddp = not lo.fsdp2 and lo.dp * lo.cp > 1
    held = microbatches > 1 or lo.pp > 1
    return (0.0 if ddp and not held else grads), held


def step_peak_bytes(grads: float, grads_held: bool, activations: float, other: float) -> float:
    """What a step allocates on a device at its high-water mark, above the parameters and optimizer
    state (and DDP's buckets) it starts with: `other` (copies, working sets) with the activations'
    peak, plus the gradients if they are held then, or the whole gradients at the end of backward if
    that is larger. The device's peak is this plus its resident model states."""
    return other + max(activations + (grads if grads_held else 0.0), grads)


def autocast_weight_copy_bytes(m: ModelConfig, layers: int, head: bool, tp: int = 1, float8: bool = False) -> float:
    """The bf16 copies autocast makes of the fp32 weights a rank multiplies with: each linear's
    weight and bias in its `layers` blocks (their tensor-parallel slices) and the head's matrix (tied
    or not); the embedding lookup and the norms read the fp32 parameters. Autocast caches them for
    its whole region, one step in this engine (Engine.forward_backward), so they count once, not
    per micro-batch. None under FSDP2 with bf16 param_dtype (the parameters are bf16 already).
    Compiled blocks make and keep their own casts per micro-batch (`activation_bytes_per_layer`):
    a compiled rank books only its head here (layers=0). `float8`: the blocks' float8 linears
    (train.float8) make no such copy (torchao casts their fp32 weights to float8 at each use)."""
    block = sum(
        math.prod(tp_local_shape(n, s, tp))
        for n, s in param_shapes(m.model_copy(update={"n_layers": 1}))
        if n.startswith("layers.0.") and any(k in n for k in LINEAR_KEYS)
    )
    if float8:
        block -= float8_weight_elements(m, tp)
    return 2 * (layers * block + (m.vocab_size * m.d_model / tp if head else 0))


def _chunk_rows(rows: int, n: int, rank: int) -> int:
    """Rows FSDP2 gives `rank` of n when it shards dim 0 (torch.chunk: ceil-sized chunks, the
    last ranks may get fewer or none)."""
    size = -(-rows // n)
    return max(0, min(rows, (rank + 1) * size) - rank * size)


def _zero1_loads(sizes: list[tuple[int, bool]], n: int) -> list[int]:
    """Elements ZeroRedundancyOptimizer assigns to each of n ranks, from (numel, weight-decayed) per
    tensor: per param group (decay, then no decay), largest tensor first, each to the least-loaded
    rank so far, the lowest rank on ties (torch's greedy partition; a heap keeps it O(T log n))."""
    heap = [(0, r) for r in range(n)]
    for decay in (True, False):
        for numel in sorted((k for k, d in sizes if d == decay), reverse=True):
            load, r = heapq.heappop(heap)
            heapq.heappush(heap, (load + numel, r))
    out = [0] * n
    for load, r in heap:
        out[r] = load
    return out


_HEAD_NAMES = ("norm.weight", "norm.bias", "output.weight")


def _tensor_parts(m: ModelConfig, tp: int) -> tuple[list, list, list]:
    """One block's, the embedding side's and the head side's parameters as (tensor-parallel local
    shape, weight-decayed), read off a one-layer copy of the model (every block has the same)."""
    block: list[tuple[tuple[int, ...], bool]] = []
    emb: list[tuple[tuple[int, ...], bool]] = []
    head: list[tuple[tuple[int, ...], bool]] = []
    for name, shape in param_shapes(m.model_copy(update={"n_layers": 1})):
        part = block if name.startswith("layers.") else head if name in _HEAD_NAMES else emb
        part.append((tp_local_shape(name, shape, tp), len(shape) >= 2 and "embeddings" not in name))
    return block, emb, head


def _rank_tensors(
    m: ModelConfig, tp: int, layers: int, has_embedding: bool, has_head: bool, cache: dict | None = None
) -> list[tuple[tuple[int, ...], bool, int]]:
    """(tensor-parallel local shape, weight-decayed, how many) of the parameter tensors one
    pipeline rank of this engine holds: the `layers` blocks of its stages, the embedding on the
    first stage, final norm and head on the last."""
    block, emb, head = memo(cache, ("tensors", tp), lambda: _tensor_parts(m, tp))
    return (
        [(s, d, layers) for s, d in block]
        + [(s, d, 1) for s, d in emb if has_embedding]
        + [(s, d, 1) for s, d in head if has_head]
    )


def zero1_rank_loads(
    m: ModelConfig, lo, layers: int, has_embedding: bool, has_head: bool, cache: dict | None = None
) -> list[int]:
    """Optimizer-state elements torch's ZeroRedundancyOptimizer gives each of a pipeline rank's
    dp·cp ranks (`zero1_loads` over its tensors). One large tensor (an embedding or head of V×h/t)
    can exceed Ψ/N at large dp."""
    n = lo.dp * lo.cp

    def loads() -> list[int]:
        mine = _rank_tensors(m, lo.tp, layers, has_embedding, has_head, cache)
        return _zero1_loads([(math.prod(s), d) for s, d, count in mine for _ in range(count)], n)

    return memo(cache, ("zero1", lo.tp, layers, has_embedding, has_head, n), loads)


def gathered_param_bytes(
    m: ModelConfig,
    lo,
    layers: int,
    has_embedding: bool,
    has_head: bool,
    dtype: str = "bf16",
    cache: dict | None = None,
    float8_gather: bool = False,
) -> float:
    """Bytes of FSDP2's all-gathered (unsharded) parameters one rank holds when its saved
    activations peak, apart from the fp32 shards the optimizer steps: each tensor's all-gather
    output, dim 0 padded to a multiple of the dp_shard·cp ranks, in the compute dtype (FSDP2's bf16
    param_dtype; fp32 runs gather fp32). ZeRO-2 and pipelined ZeRO-3 keep every group gathered from
    its forward to its backward. ZeRO-3 has freed them all by then: each block after its forward,
    the root (embedding, final norm, head) after the model's, before the loss saves its tensors;
    what it re-gathers in backward is `regathered_bytes`. ZeRO-0 with tensor parallel runs on
    FSDP2's replicate: one whole gathered copy. None under DDP (ZeRO 0/1 compute with the fp32
    parameters). `float8_gather`: tensorwise float8 with torchao's float8 all-gather: the blocks'
    float8 linear weights are gathered in 1 byte per element instead (their one scale each is
    metadata of a few bytes, not counted)."""
    if not lo.fsdp2 or lo.reshards_params:
        return 0.0
    n = lo.dp_shard * lo.cp if lo.zero >= 2 else 1  # replicate's shard dim is 1
    e = 2 if dtype == "bf16" else 4
    mine = _rank_tensors(m, lo.tp, layers, has_embedding, has_head, cache)
    out = e * sum(count * -(-s[0] // n) * n * math.prod(s[1:]) for s, _, count in mine)
    if float8_gather:
        f8 = float8_shapes(m, lo.tp)
        out -= layers * (e - 1) * sum(-(-s[0] // n) * n * math.prod(s[1:]) for s in f8)
    return out


def rank_param_count(
    m: ModelConfig, lo, layers: int, has_embedding: bool, has_head: bool, cache: dict | None = None
) -> int:
    """Parameters of one rank's stages, its tensor-parallel slice, before any ZeRO sharding (the
    buffer its data-parallel collectives move)."""
    return sum(count * math.prod(s) for s, _, count in _rank_tensors(m, lo.tp, layers, has_embedding, has_head, cache))


def rank_model_states(
    m: ModelConfig,
    lo,
    layers: int,
    has_embedding: bool,
    has_head: bool,
    shard_rank: int = 0,
    dp_rank: int = 0,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    k: int = 8,
    cache: dict | None = None,
) -> ModelStates:
    """Exactly what one rank of this engine holds (fp32 master weights, fp32 gradients after the
    backward, AdamW moments after the step), tensor by tensor: the `layers` blocks of the rank's
    pipeline stages, its tensor-parallel slice, and its data-parallel share: DDP replicates;
    ZeRO-1 partitions whole tensors over the dp·cp ranks (`dp_rank` among them); FSDP2 (zero 2/3)
    shards dim 0 over the dp_shard·cp ranks (`shard_rank`; torch.chunk gives the first ranks the
    most), at rest. `lo` is a layout.rules.Layout."""
    mine = _rank_tensors(m, lo.tp, layers, has_embedding, has_head, cache)
    if lo.zero >= 2 and lo.world > 1:  # FSDP2 (any process group)
        n_shard = lo.dp_shard * lo.cp
        sharded = sum(count * _chunk_rows(s[0], n_shard, shard_rank) * math.prod(s[1:]) for s, _, count in mine)
        return ModelStates(params=param_bytes * sharded, grads=grad_bytes * sharded, optimizer=k * sharded)
    whole = sum(count * math.prod(s) for s, _, count in mine)
    owned = (
        zero1_rank_loads(m, lo, layers, has_embedding, has_head, cache)[dp_rank]
        if lo.zero == 1 and lo.dp * lo.cp > 1
        else whole
    )
    return ModelStates(params=param_bytes * whole, grads=grad_bytes * whole, optimizer=k * owned)
