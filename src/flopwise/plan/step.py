"""Time of one training step for one layout on one cluster, and the step's estimate. Pure Python, no torch.

`estimate` sets the step's time beside its bytes: the worst rank's memory is plan.rank_memory's
(`layout_memory`: this engine's per-rank account, or a published stack's), the time is this
module's.

The step is built bottom-up from what each device executes, and every term has a source:

- GEMMs: each weight matmul of a layer on its tensor-parallel shard, timed by a roofline
  max(FLOPs / (η·peak), bytes / (η_mem·HBM bandwidth)). η is the device's achievable dense-GEMM
  fraction (`Hardware.matmul_efficiency`, a property of the chip and its BLAS, never of a run);
  the memory side catches the small, skinny GEMMs of attention scores and narrow tp shards.
  Backward is two GEMMs of the forward's size (data and weight gradients).
- Attention core: with flash attention (fused, the default stack) its FLOPs run at η and the
  backward re-runs the forward's score matmuls; with materialised scores (Megatron 2020-2022)
  the score GEMMs go through the roofline and the softmax, its mask and dropout stream s² bytes
  through HBM (Korthikanti et al. 2022 Table 2 lists the same tensors).
- Element-wise work (norms, residual adds, activation function, dropout, rotary): bytes moved at
  η_mem·HBM bandwidth. Sequence parallelism divides the norm/dropout part by tp.
- Tensor parallel: 2 all-reduces (or all-gather + reduce-scatter with sequence parallel) of b·s·h
  per layer forward, 2 backward, 2 more when full recompute re-runs the forward (Narayanan et al.
  2021 §3.2); on NVLink when tp fits a node. Not overlapped with compute (stated). Megatron's
  sequence parallelism keeps only the sequence shard of the two column-parallel inputs (the
  activation list of `plan.memory` with Korthikanti's precision) and all-gathers them again in
  backward, 2 more b·s·h per layer (Korthikanti et al. 2022 §4.2.2); the engine keeps the gathered
  tensors and does not. The paper overlaps that all-gather with the data-gradient GEMM, yet its
  Table 4 measures the 22B layer's backward no faster with sequence parallelism (11.8 vs 11.9 ms)
  although the norm and dropout traffic drops by t: booked exposed, the layer model gives the
  measured selective + sequence-parallel layer (20.3 ms forward + backward).
- Context parallel: K/V all-gather per layer forward and reduce-scatter of their gradients.
- Pipeline: the slowest rank (layers, plus the output layer and loss on the last) sets the pace.
  Bubble (p−1)/v of a micro-batch's slot on that rank for 1F1B/GPipe/interleaved (Narayanan et al.
  2021 §2.2), a third of 1F1B's for zero-bubble and DualPipeV (Qi et al. 2024: ZB-H1). A slot
  includes its p2p exchanges: Megatron's `_communicate` waits on them and synchronises the device
  before the next chunk, so they sit on the critical path in the fill and drain as in the steady
  state. Per micro-batch per chunk one activation forward and one gradient backward cross each
  boundary: b·s·h/t with scatter/gather plus the receiver's all-gather of b·s·h over the
  tensor-parallel ranks (Narayanan §4.1; none under sequence parallelism, already split), or the
  whole b·s·h per rank (this engine without sequence parallelism). Tied embeddings split across
  stages add an all-reduce of the table's gradient between the first and last stage per step.
- Gradient accumulation: every micro-batch after the first adds its weight gradients into the
  held ones, an HBM stream per local parameter (`Stack.grad_accum_bytes`); pipelining needs
  m ≫ p small micro-batches, so it pays this m − 1 times where data parallelism alone can take
  one large micro-batch.
- Data parallel: ZeRO volumes of `plan.comm` over the dp ring (inter-node when it leaves a node),
  with a stated fraction hidden behind the last micro-batch's backward (stages 0-2) or behind every
  micro-batch (stage 3, FSDP prefetch).
- ZeRO-1 optimizer state: this engine's is torch's ZeroRedundancyOptimizer, which gives each rank
  whole tensors (greedy, per param group), so the busiest rank's share is booked
  (`plan.rank_memory.busiest_dp_rank`); one V×h/t table can exceed Ψ/N at large dp. Megatron's
  distributed optimizer shards flat buffers, so Ψ/N is right for the megatron stacks.
- Optimizer: bytes streamed per local parameter (the busiest rank's, under ZeRO). Fused AdamW on
  fp32 parameters reads p, g, m, v and writes p, m, v (28) plus the clipping norm's read of g (4)
  = 32. Megatron keeps separate
  16-bit model and fp32 main copies: + grad copy to main (2 + 4) + main-to-model copy (4 + 2) = 44.

The software stacks (`flopwise`, `megatron-2021`, `megatron-2022`) and what each assumes: plan.stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flopwise.config.schema import ModelConfig
from flopwise.errors import ConfigError
from flopwise.flops import count_params, mfu
from flopwise.hardware.catalogue import Hardware
from flopwise.layout.linears import float8_all_gather, float8_eligible, float8_weight_elements
from flopwise.layout.rules import Layout, compiles, loss_chunk_tokens, stage_sizes
from flopwise.plan.comm import (
    Collective,
    dp_collectives,
    fsdp_copy_bytes,
    pp_boundary_elements,
    ring_time,
    sp_regather_elements,
    tied_embedding_elements,
)
from flopwise.plan.float8 import cast_bytes, scaled_mm_speed
from flopwise.plan.memory import autocast_weight_copy_bytes, checkpointed_layers, engine_precision, memo
from flopwise.plan.rank_memory import FIT_MARGIN, layout_memory
from flopwise.plan.shape import RankLoad, Shape, first_ranks, model_shape, rank_loads
from flopwise.plan.stack import STACKS, Stack

MEM_EFFICIENCY = 0.8  # achievable fraction of HBM bandwidth for streaming kernels (STREAM-like copies)
LINK_EFFICIENCY = 0.8  # NCCL bus bandwidth over the nominal per-direction link rate
_DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb default (this engine's ZeRO 0/1 gradient all-reduce)
ACT_BYTES = 2  # 16-bit activations


def gemm_time(mm: float, kk: float, nn: float, hw: Hardware, peak: float, count: float = 1) -> float:
    """Roofline time of `count` (M×K)·(K×N) 16-bit GEMMs: at the calibrated efficiency of that shape
    when the hardware entry was measured (`flopwise hardware calibrate`), else the chip's one."""
    flops = 2 * mm * kk * nn
    nbytes = ACT_BYTES * (mm * kk + kk * nn + mm * nn)
    return count * max(flops / (gemm_efficiency(mm, kk, nn, hw) * peak), nbytes / (MEM_EFFICIENCY * hw.memory_bw))


def gemm_efficiency(mm: float, kk: float, nn: float, hw: Hardware) -> float:
    """The share of the peak an (M×K)·(K×N) product reaches: its shape's calibrated share when the
    hardware entry was measured, else the chip's one (`Hardware.matmul_efficiency`)."""
    return hw.calibration.gemm_efficiency(mm, nn, kk) if hw.calibration else hw.matmul_efficiency


def gemm_fwd_bwd(shapes: list[tuple[float, float, float]], hw: Hardware, peak: float) -> tuple[float, float]:
    """Forward and backward time of (M, K, N) products: backward is the data gradient
    (M×N)·(N×K) and the weight gradient (K×M)·(M×N), each timed at its own shape."""
    fwd = sum(gemm_time(m, k, n, hw, peak) for m, k, n in shapes)
    bwd = sum(gemm_time(m, n, k, hw, peak) + gemm_time(k, m, n, hw, peak) for m, k, n in shapes)
    return fwd, bwd


def stream_time(nbytes: float, hw: Hardware, tensor_bytes: float | None = None, tp: int = 1) -> float:
    """Memory-bound work: at the bandwidth measured for tensors of `tensor_bytes` at tensor-parallel
    degree `tp` when calibrated (small tensors stream slower: launch and cache effects; sharded ones
    pay DTensor's dispatch), else a share of nominal HBM bandwidth."""
    if hw.calibration and tensor_bytes:
        return nbytes / hw.calibration.stream_bandwidth(tensor_bytes, tp)
    return nbytes / (MEM_EFFICIENCY * hw.memory_bw)


def _link_bw(hw: Hardware, group_span: int) -> float:
    """Per-device bandwidth of a ring whose ranks span `group_span` consecutive devices."""
    nominal = hw.intra_node_bw if group_span <= hw.devices_per_node else hw.inter_node_bw
    return LINK_EFFICIENCY * nominal


def comm_time(hw: Hardware, kind: str, n: int, nbytes: float, group_span: int) -> float:
    """One collective over n ranks spanning `group_span` devices: the latency and bandwidth fitted
    to the calibrated measurements of that kind within a node, else the α-β ring model on the
    nominal links."""
    fit = hw.calibration.collective(kind) if hw.calibration and group_span <= hw.devices_per_node else None
    if kind == "send_recv":
        if fit:
            return fit[0] + nbytes / fit[1]
        return ring_time("all_gather", 2, 2 * nbytes, _link_bw(hw, group_span))  # latency + bytes / bw
    if fit:
        return ring_time(kind, n, nbytes, fit[1], fit[0])
    return ring_time(kind, n, nbytes, _link_bw(hw, group_span))


@dataclass(frozen=True, kw_only=True)
class LayerTimes:
    """One layer, one micro-batch: compute by kind (GEMMs, attention core, element-wise) per direction."""

    gemm_fwd: float
    gemm_bwd: float
    attn_fwd: float  # attention core (what selective recompute re-runs)
    attn_bwd: float
    other_fwd: float  # element-wise and memory-bound work
    other_bwd: float
    tp_fwd: float  # tensor-parallel communication of one forward
    tp_bwd: float
    cp_fwd: float
    cp_bwd: float

    @property
    def fwd(self) -> float:
        return self.gemm_fwd + self.attn_fwd + self.other_fwd

    @property
    def bwd(self) -> float:
        return self.gemm_bwd + self.attn_bwd + self.other_bwd


def layer_elementwise_bytes(
    sh: Shape, tokens: float, tp: int, sp: bool, eager: tuple[int, int] | None = None
) -> tuple[float, float, float]:
    """(bytes one layer's forward element-wise work moves, its backward's, bytes of one b·s·h
    activation).

    Fused (torch.compile'd blocks, Megatron's kernels; `eager` None), in 2-byte elements per token:
    2 norms (r+w), 2 residual adds (2r+w), 2 dropouts (r+w+½ mask) on the sequence-parallel part;
    activation (r+w per input) and rotary on the tensor-parallel part; backward about twice that.

    Eager (this engine's blocks op by op; `eager` = (compute, residual) bytes per element of its
    precision, plan.memory.engine_precision): every PyTorch kernel reads its inputs and writes its
    output (`_eager_layer_bytes`)."""
    h = sh.d_model
    act = ACT_BYTES * tokens * h
    if eager:
        seq_f, seq_b, tp_f, tp_b = _eager_layer_bytes(sh, *eager)
        div = tp if sp else 1
        return tokens * (seq_f / div + tp_f / tp), tokens * (seq_b / div + tp_b / tp), act
    seq_part = 2 * 2 * h + 2 * 3 * h + (2 * 2.5 * h if sh.dropout else 0)
    tp_part = (sh.ffn_in + 1) * sh.ffn + 2 * (sh.hq + sh.hkv)
    fwd = ACT_BYTES * tokens * (seq_part / (tp if sp else 1) + tp_part / tp)
    return fwd, 2 * fwd, act


def _eager_layer_bytes(sh: Shape, e: int, r: int) -> tuple[float, float, float, float]:
    """Bytes per token one eager layer's element-wise kernels move: (forward, backward) of the
    sequence-parallel part (norms, residual adds, dropouts, autocast's casts of the linears'
    inputs) and of the tensor-parallel part (rotary, the MLP's activation), for the engine's
    model.layers code under autocast (e-byte compute over an r-byte residual stream; e == r: no
    casts). Counted from the ops, not fitted:
    - norm (RMSNorm/LayerNorm; in fp32 under autocast, its fp32-listed op): read r, write n bytes;
      backward reads its output gradient and input, writes the input gradient.
    - a residual add reads r + e, writes r; backward adds the two gradients of the stream (3r) and,
      under autocast, casts the branch's gradient to e (r + e).
    - autocast casts each linear's input separately (q, k, v; w1 and w3): n + e each, and in
      backward the cast's gradient back (e + n) and the sum of the consumers' gradients (3n each).
    - rotary (apply_rope) on q and k: neg of one half, cat, two casts to fp32, two products with
      the tables, their sum, the cast back; backward the same chain reversed plus the sum of its
      two paths.
    - SwiGLU: silu (r+w) and the product (2r+w); backward both products and silu's gradient.
    - dropout (p > 0): read, write, a 1-byte mask, and the same in backward.
    Not counted (the same compiled and eager, or below this count's resolution): weight casts and
    their gradients, bias adds (fused into the GEMMs), layout copies around the attention core."""
    m = sh.config
    h = sh.d_model
    casts = e != r
    n = 4 if casts else r  # a norm's output: fp32 under autocast
    consumers = (3, 2 if m.mlp == "swiglu" else 1)  # linears reading each norm's output
    norms_f = 2 * (r + n)
    norms_b = 2 * (2 * n + r)
    adds_f = 2 * (2 * r + e)
    adds_b = 2 * (3 * r + (r + e if casts else 0))
    cast_f = sum(consumers) * (n + e) if casts else 0
    cast_b = (sum(consumers) * (e + n) if casts else 0) + sum(c - 1 for c in consumers) * 3 * n
    drop = 2 * (2 * e + 1) if sh.dropout else 0
    rope_elems = (sh.hq + sh.hkv) if m.pos == "rope" else 0
    up = (4 + e) if e < 4 else 0  # a cast to fp32 (none when already fp32)
    rope_f = e + 2 * e + 2 * up + 2 * 8 + 12 + up
    rope_b = up + 2 * 8 + 2 * up + e + 2 * e + 3 * e
    act_f, act_b = (5 * e, 9 * e) if m.mlp == "swiglu" else (2 * e, 3 * e)
    seq_f = (norms_f + adds_f + cast_f + drop) * h
    seq_b = (norms_b + adds_b + cast_b + drop) * h
    return seq_f, seq_b, rope_elems * rope_f + act_f * sh.ffn, rope_elems * rope_b + act_b * sh.ffn


def eager_precision(stack: Stack, compile: bool | str, steps: float, lo: Layout, dtype: str) -> tuple[int, int] | None:
    """(compute, residual) bytes per element when this engine runs the layout's blocks op by op
    (train.compile off, or `auto` declining it: layout.rules.compiles), else None (fused)."""
    if not stack.engine_activations or compiles(compile, steps, lo):
        return None
    precision = engine_precision(dtype, lo.fsdp2)
    return precision.compute, precision.residual


def loss_bytes(sh: Shape, tokens: float, tp: int, eager: tuple[int, int] | None = None) -> float:
    """HBM bytes of the loss over forward and backward (train.engine: cross-entropy of the logits in
    fp32). Fused: the fp32 logits read and written about three times. Eager: the cast to fp32
    (none in fp32), log-softmax (r+w), its gradient (two reads, one write) after the NLL's scatter
    into a zeroed tensor, the gradient's cast back."""
    per = 4 * tokens * sh.vocab / tp
    if not eager:
        return 3 * per
    cast = (4 + eager[0]) / 4 if eager[0] < 4 else 0
    return per * (2 * cast + 2 + 1 + 3)


def layer_times(
    sh: Shape,
    hw: Hardware,
    stack: Stack,
    seq: int,
    mb: int,
    tp: int,
    cp: int,
    sp: bool,
    float8: str = "none",
    fsdp2: bool = False,
    eager: tuple[int, int] | None = None,
) -> LayerTimes:
    """`eager`: this engine's blocks run op by op, (compute, residual) bytes per element
    (`layer_elementwise_bytes`); None: fused element-wise work. `float8` (train.float8): the
    block's linears whose local dims are multiples of 16 run their three GEMMs at the fp8 peak (at
    the same calibrated efficiency: one table per chip; rowwise's forward at
    plan.float8.scaled_mm_speed of it), plus the amax and cast kernels around them
    (plan.float8.cast_bytes; weights cast from fp32 masters, or from FSDP2's bf16 gathered copy)."""
    tokens = mb * seq / cp
    h = sh.d_model
    kv_local = kv_width(sh, tp)
    gemm_f, gemm_b = _linear_gemm_times(sh, hw, tokens, tp, float8)
    attn_f, attn_b = _attention_core_times(sh, hw, stack, seq, mb, tp, cp)
    ew_f, ew_b, act = layer_elementwise_bytes(sh, tokens, tp, sp, eager)
    float8_casts = float8 != "none"
    cast_f, cast_b = (
        cast_bytes(sh.config, tokens, tp, float8, weight_bytes=2 if fsdp2 else 4) if float8_casts else (0.0, 0.0)
    )
    # Two collectives of b·s·h per direction; with SP each all-reduce becomes AG + RS of the same bytes.
    tp_one = comm_time(hw, "all_reduce", tp, act, tp)
    regather = sp and not stack.engine_activations  # Megatron saved only the sequence shard
    tp_regather = (
        2 * comm_time(hw, "all_gather", tp, ACT_BYTES * sp_regather_elements(seq / cp, mb, h, 1) / 2, tp)
        if regather
        else 0.0
    )  # two all-gathers, one per input
    kv_bytes = ACT_BYTES * mb * seq * 2 * kv_local
    return LayerTimes(
        gemm_fwd=gemm_f,
        gemm_bwd=gemm_b,
        attn_fwd=attn_f,
        attn_bwd=attn_b,
        other_fwd=stream_time(ew_f + cast_f, hw, act, tp),
        other_bwd=stream_time(ew_b + cast_b, hw, act, tp),
        tp_fwd=2 * tp_one,
        tp_bwd=2 * tp_one + tp_regather,
        cp_fwd=comm_time(hw, "all_gather", cp, kv_bytes, tp * cp),
        cp_bwd=comm_time(hw, "reduce_scatter", cp, kv_bytes, tp * cp),
    )


def kv_width(sh: Shape, tp: int) -> float:
    """Elements of K (or V) per token one tensor-parallel rank holds: its share of the kv heads, or
    one whole head where tp exceeds them (each rank keeps a copy of the head its queries read)."""
    return sh.hkv / tp if sh.n_kv_heads >= tp else sh.head_dim


def linear_shapes(sh: Shape, tokens: float, tp: int) -> list[tuple[float, float, float]]:
    """(M, K, N) of one layer's weight products over `tokens` tokens on a tensor-parallel shard:
    QKV, the attention output, the MLP's input(s) and output (and Transformer-XL's position
    projection)."""
    h, hq, f, kv_local = sh.d_model, sh.hq, sh.ffn, kv_width(sh, tp)
    return [
        (tokens, h, (hq + 2 * kv_local * tp) / tp),
        (tokens, hq / tp, h),
        (tokens, h, sh.ffn_in * f / tp),
        (tokens, f / tp, h),
    ] + ([(tokens, h, hq / tp)] if sh.relative else [])


def _linear_gemm_times(sh: Shape, hw: Hardware, tokens: float, tp: int, float8: str = "none") -> tuple[float, float]:
    """Forward and backward time of one layer's weight GEMMs on its tensor-parallel shard, the
    float8 linears' at the fp8 peak and their recipe's kernel speed."""
    peak = planning_peak(hw)
    shapes = linear_shapes(sh, tokens, tp)
    low = float8 != "none"
    fp8 = [s for s in shapes if low and float8_eligible((int(s[2]), int(s[1])))]
    gemm_f, gemm_b = gemm_fwd_bwd([s for s in shapes if s not in fp8], hw, peak)
    if fp8:  # a device without an fp8 peak runs float8 emulated (train.float8_emulate): 16-bit GEMMs
        f8_f, f8_b = gemm_fwd_bwd(fp8, hw, hw.peak("fp8") or peak)
        # the recipe's kernels beside tensorwise cuBLAS (rowwise: a slower CUTLASS forward)
        speed_f, speed_b = scaled_mm_speed(float8) if hw.peak("fp8") else (1.0, 1.0)
        gemm_f, gemm_b = gemm_f + f8_f / speed_f, gemm_b + f8_b / speed_b
    return gemm_f, gemm_b


def flash_efficiency(hw: Hardware, context: float, head_dim: int) -> tuple[float, float]:
    """Shares of the peak fused (flash) attention reaches forward and backward over `context`
    keys: calibrated when the entry was measured, else the chip's GEMM share."""
    if hw.calibration:
        return hw.calibration.attention_efficiency(context, head_dim)
    return hw.matmul_efficiency, hw.matmul_efficiency


def _attention_core_times(
    sh: Shape, hw: Hardware, stack: Stack, seq: int, mb: int, tp: int, cp: int
) -> tuple[float, float]:
    """Forward and backward time of one layer's attention core: fused flash attention at its
    (calibrated) efficiency, or materialised scores (two GEMMs and the softmax's streams)."""
    peak = planning_peak(hw)
    heads = mb * sh.n_heads / tp
    q_len, context = seq / cp, min(seq, sh.window or seq)
    score_flops = 2 * 2 * heads * q_len * context * sh.head_dim * (1.5 if sh.relative else 1)
    if stack.flash_attention:
        # dQ, dK, dV plus the scores the fused kernel recomputes: 3x the forward's FLOPs
        eta_f, eta_b = flash_efficiency(hw, context, sh.head_dim)
        return score_flops / (eta_f * peak), 3 * score_flops / (eta_b * peak)
    elements = heads * q_len * context
    softmax_f = (4 + (5 if sh.dropout else 0)) * elements  # scale-mask-softmax r/w, dropout r/w + mask
    softmax_b = (6 + (5 if sh.dropout else 0)) * elements
    score_gemms = gemm_time(q_len, sh.head_dim, context, hw, peak, heads) + gemm_time(
        q_len, context, sh.head_dim, hw, peak, heads
    )
    return score_gemms + stream_time(softmax_f, hw), 2 * score_gemms + stream_time(softmax_b, hw)


@dataclass(kw_only=True)
class Estimate:
    layout: Layout
    fits: bool
    # bytes per device on the worst rank: params, grads, optimizer, activations, other (with the runtime
    # reserve), step_peak (allocated at the step's high-water mark above the resident model states, without
    # the reserve: what `plan --measure` calls peak) and total (what must fit)
    memory: dict
    time: dict  # s per step: matmul, attention, other_compute, tp_comm, dp_comm, pp_bubble, pp_comm, cp_comm,
    # grad_accum, fsdp_copies, weight_casts, optimizer
    step_time: float
    tokens_per_s: float
    model_tflops: float  # per device
    hardware_tflops: float
    mfu: float
    hfu: float
    usable_memory: float
    reason: str = ""  # why it does not fit
    float8: str = "none"  # train.float8 the estimate is for

    def to_json(self, tokens: float | None = None, gpus: int | None = None) -> dict:
        out = {
            **self.layout.to_json(),
            "fits": self.fits,
            "memory_per_gpu_bytes": {k: round(v) for k, v in self.memory.items()},
            "step_time_s": self.step_time,
            "time_breakdown_s": self.time,
            "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_gpu": self.model_tflops,
            "hardware_tflops_per_gpu": self.hardware_tflops,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "float8": self.float8,
        }
        if tokens is not None and gpus is not None:
            seconds = tokens / self.tokens_per_s
            out["train_days"] = seconds / 86400
            out["gpu_hours"] = seconds * gpus / 3600
        return out


def estimate(
    sh: Shape,
    hw: Hardware,
    lo: Layout,
    seq: int,
    global_batch: int,
    stack: Stack,
    cache: dict | None = None,
    compile: bool | str = "auto",
    steps: float = math.inf,
    dtype: str = "bf16",
    float8: str = "none",
    loss_chunk: int | str = "auto",
) -> Estimate:
    """Memory and time of one optimizer step (global_batch sequences of seq tokens), with the
    blocks' linears in float8 under `float8` (train.float8's recipe).

    `cache` (one dict per search over a fixed model, hardware, stack, seq, batch, compile, steps and
    dtype) memoises per-layer times and the per-rank tensor walks. `compile`, `steps` and `dtype`
    (train.compile, the run's length, by default a long one, and train.dtype) are the run's: they
    say what this engine keeps (layout.rules.compiles; fp32 or bf16 autocast); the step time does not
    model compilation. The published stacks keep 16-bit parameters whatever `dtype` says. The `cpu`
    entry books what this engine keeps on a CPU (EngineRun.cpu). `loss_chunk`: train.loss_chunk_tokens
    (layout.rules.loss_chunk_tokens), for the head's memory and its rerun forward."""
    loads = memo(
        cache,
        ("loads", lo.pp, lo.pp_schedule, lo.virtual_stages, lo.tp),
        lambda: first_ranks(rank_loads(sh, lo, stack.balanced_stages)),
    )
    memory, opt_elements = layout_memory(
        sh,
        lo,
        seq,
        global_batch,
        stack,
        loads,
        cache,
        compile=compile,
        steps=steps,
        dtype=dtype,
        float8=float8,
        cpu=hw.name == "cpu",
        loss_chunk=loss_chunk,
    )
    usable = hw.memory_bytes * (1 - FIT_MARGIN)
    fits = memory["total"] <= usable
    time = step_times(
        sh,
        hw,
        lo,
        seq,
        global_batch,
        stack,
        [load for load, _ in loads],
        opt_elements,
        cache,
        float8,
        eager_precision(stack, compile, steps, lo, dtype),
        dtype,
        loss_chunk,
    )
    step = sum(time.values())
    tokens = global_batch * seq
    gpus, peak = lo.world, planning_peak(hw)
    model_f = sh.model_flops_token["none"] * tokens
    hw_token = hardware_flops_token(sh, lo, stack.balanced_stages)
    hw_f = hw_token * tokens
    return Estimate(
        layout=lo,
        fits=fits,
        memory=memory,
        time=time,
        step_time=step,
        tokens_per_s=tokens / step,
        model_tflops=model_f / step / gpus / 1e12,
        hardware_tflops=hw_f / step / gpus / 1e12,
        mfu=mfu(tokens / step, sh.model_flops_token["none"], peak, gpus),
        hfu=mfu(tokens / step, hw_token, peak, gpus),
        usable_memory=usable,
        reason="" if fits else f"needs {memory['total'] / 2**30:.1f} GiB of {usable / 2**30:.1f} GiB usable",
        float8=float8,
    )


def _row_parallel_share(m: ModelConfig) -> float:
    """The share of a block's matmul FLOPs in its row-parallel linears (attention output, MLP
    down): what per-operator recompute reruns under tensor parallel (parallel.apply's op policy)."""
    hq = m.n_heads * m.head_dim
    return (hq + m.ffn_dim) * m.d_model / (count_params(m).layer_matmul / m.n_layers)


def hardware_flops_token(sh: Shape, lo: Layout, balanced: bool = True) -> float:
    """FLOPs per token the devices run (HFU's numerator): the model's, plus the forward work full
    or selective recompute reruns, full only over the blocks it checkpoints (recompute_every);
    op reruns no matmul nor attention kernel (flops.flops_per_token books neither)."""
    none = sh.model_flops_token["none"]
    if lo.recompute not in sh.model_flops_token:
        return none
    share = 1.0
    if lo.recompute == "full" and lo.recompute_every > 1:
        share = checkpointed_layers(stage_sizes(sh.config, lo, balanced), lo.recompute_every) / sh.config.n_layers
    return none + (sh.model_flops_token[lo.recompute] - none) * share


def planning_peak(hw: Hardware) -> float:
    """The dense 16-bit peak an estimate is stated against (plan_hardware refuses hardware without one)."""
    if not hw.peak_16bit:
        raise ConfigError(f"cluster.hardware={hw.name}: no catalogue bf16 or fp16 peak to plan against")
    return hw.peak_16bit


def step_times(
    sh: Shape,
    hw: Hardware,
    lo: Layout,
    seq: int,
    global_batch: int,
    stack: Stack,
    loads: list[RankLoad],
    opt_elements: float,
    cache: dict | None,
    float8: str = "none",
    eager: tuple[int, int] | None = None,
    dtype: str = "bf16",
    loss_chunk: int | str = "auto",
) -> dict[str, float]:
    """Seconds per step by term; the slowest pipeline rank sets the pace. `eager`: layer_times'."""
    n_micro = lo.microbatches(global_batch)
    v = lo.virtual_stages if lo.pp > 1 else 1
    tokens_mb = lo.micro_batch * seq / lo.cp
    lt = memo(
        cache,
        (lo.micro_batch, lo.tp, lo.cp, lo.sequence_parallel, float8, float8 != "none" and lo.fsdp2, eager),
        lambda: layer_times(
            sh, hw, stack, seq, lo.micro_batch, lo.tp, lo.cp, lo.sequence_parallel, float8, lo.fsdp2, eager
        ),
    )
    recompute = lo.recompute
    # what a checkpointed block re-sends in backward: full, all of its forward's; op, the gathers
    # (it keeps the reduce-scatters' outputs, not an all-reduce's)
    recompute_tp = {"full": lt.tp_fwd, "op": lt.tp_fwd / 2 if lo.sequence_parallel else lt.tp_fwd}.get(recompute, 0.0)
    recompute_cp = lt.cp_fwd if recompute in ("full", "op") else 0.0
    # the output layer: fwd + bwd GEMMs (this engine's chunked loss reruns the forward in backward:
    # layout.rules.loss_chunk_tokens at train.loss_chunk_tokens), and the fp32 cross-entropy's traffic
    head_fwd, head_bwd = gemm_fwd_bwd([(tokens_mb, sh.d_model, sh.vocab / lo.tp)], hw, planning_peak(hw))
    chunked = stack.engine_activations and loss_chunk_tokens(loss_chunk, int(tokens_mb), sh.vocab, lo.tp) > 0
    logits_mm = head_fwd * (2 if chunked else 1) + head_bwd
    # at the streaming rate of this micro-batch's activations, as the layers' element-wise work
    logits_other = stream_time(loss_bytes(sh, tokens_mb, lo.tp, eager), hw, ACT_BYTES * tokens_mb * sh.d_model, lo.tp)

    def micro_batch_times(load: RankLoad) -> dict[str, float]:
        n = load.layers
        # the blocks that rerun their forward: op reruns all but the matmuls and attention kernel
        k = checkpointed_layers(load.stages or (n,), lo.recompute_every) if recompute in ("op", "full") else 0
        full = k if recompute == "full" else 0
        attn_rerun = n if recompute == "selective" else full
        mm_rerun = full + (k * _row_parallel_share(sh.config) if recompute == "op" and lo.tp > 1 else 0)
        return {
            "matmul": n * (lt.gemm_fwd + lt.gemm_bwd) + mm_rerun * lt.gemm_fwd + (logits_mm if load.head else 0.0),
            "attention": n * (lt.attn_fwd + lt.attn_bwd) + attn_rerun * lt.attn_fwd,
            "other_compute": n * (lt.other_fwd + lt.other_bwd)
            + k * lt.other_fwd
            + (logits_other if load.head else 0.0),
            # + the vocab-parallel embedding's output all-reduce and the head's input-gradient all-reduce
            "tp_comm": n * (lt.tp_fwd + lt.tp_bwd) + k * recompute_tp + lt.tp_fwd,
            "cp_comm": n * (lt.cp_fwd + lt.cp_bwd) + k * recompute_cp,
        }

    slowest = max(loads, key=lambda load: sum(micro_batch_times(load).values()))
    mb_times = micro_batch_times(slowest)
    mb_total = sum(mb_times.values())
    mb_pp, pp_step = _pipeline_comm_times(sh, hw, lo, stack, seq)
    bubble_share = {"gpipe": 1.0, "1f1b": 1.0, "interleaved-1f1b": 1 / v, "zero-bubble": 1 / 3, "dualpipev": 1 / 3}
    bubble = (lo.pp - 1) * (mb_total + mb_pp) * bubble_share[lo.pp_schedule]
    biggest = max(loads, key=lambda load: load.params)
    psi = biggest.params
    shard = lo.dp_shard
    held_grads = psi / shard if lo.zero >= 2 and lo.pp == 1 else psi  # reduce-scattered every micro-batch
    accum_bytes = stack.grad_accum_bytes * held_grads
    optimizer = (
        hw.calibration.optimizer_seconds(opt_elements)
        if hw.calibration
        else stream_time(stack.optimizer_bytes * opt_elements, hw)
    )
    return {
        **{k: n_micro * t for k, t in mb_times.items()},
        "dp_comm": _data_parallel_time(hw, lo, stack, psi, n_micro, mb_total, slowest.layers, lt),
        "pp_bubble": bubble,
        "pp_comm": n_micro * mb_pp + pp_step,
        "grad_accum": (n_micro - 1) * stream_time(accum_bytes, hw, accum_bytes),
        "fsdp_copies": _fsdp_copy_time(sh, hw, lo, stack, biggest, n_micro, float8, dtype),
        "weight_casts": _weight_cast_time(sh, hw, lo, stack, slowest, n_micro, float8, dtype, eager is None),
        "optimizer": optimizer,
    }


def _fsdp_copy_time(
    sh: Shape, hw: Hardware, lo: Layout, stack: Stack, load: RankLoad, n_micro: int, float8: str, dtype: str
) -> float:
    """FSDP2's copies around its collectives on a rank with `load` (`fsdp_copies`), at the streaming
    rate of one block's gathered parameters."""
    if not (stack.engine_activations and lo.fsdp2):
        return 0.0
    nbytes = fsdp_copies(sh.config, lo, load.params, load.layers, n_micro, float8, dtype)
    block = engine_precision(dtype, True).compute * sh.layer_params / lo.tp
    return n_micro * stream_time(nbytes["micro"], hw, block) + stream_time(nbytes["step"], hw, block)


def _weight_cast_time(
    sh: Shape,
    hw: Hardware,
    lo: Layout,
    stack: Stack,
    load: RankLoad,
    n_micro: int,
    float8: str,
    dtype: str,
    compiled: bool,
) -> float:
    """bf16 autocast's casts of this engine's fp32 weights (`weight_cast_bytes`; none under FSDP2,
    whose gathered parameters are bf16 already), at the streaming rate of one block's weights."""
    if not stack.engine_activations or dtype != "bf16" or lo.fsdp2:
        return 0.0
    nbytes = weight_cast_bytes(sh.config, lo.tp, load.layers, load.head, n_micro, compiled, float8 != "none")
    return stream_time(nbytes, hw, ACT_BYTES * sh.layer_params / lo.tp)


def weight_cast_bytes(
    m: ModelConfig, tp: int, layers: int, head: bool, n_micro: int, compiled: bool, float8: bool = False
) -> float:
    """HBM bytes per step of bf16 autocast's weight casts over fp32 parameters: each linear weight
    of a rank's `layers` blocks and head (those plan.memory.autocast_weight_copy_bytes copies: not
    the float8 ones, whose casts plan.float8 books) read in fp32 and written in bf16, once a step
    (autocast caches the casts over the engine's forward_backward; compiled blocks cast inside their
    graphs, every micro-batch), and every linear's bf16 gradient (float8 ones' too) cast back to its
    fp32 parameter's dtype every micro-batch: 6 bytes an element each way."""
    blocks = autocast_weight_copy_bytes(m, layers, False, tp, float8) / 2
    head_elements = autocast_weight_copy_bytes(m, 0, head, tp) / 2
    cast = 6 * (blocks * (n_micro if compiled else 1) + head_elements)
    return cast + 6 * n_micro * (autocast_weight_copy_bytes(m, layers, False, tp) / 2 + head_elements)


def fsdp_copies(
    m: ModelConfig, lo: Layout, psi: float, layers: int, n_micro: int, float8: str = "none", dtype: str = "bf16"
) -> dict[str, float]:
    """HBM bytes this engine's FSDP2 (lo.fsdp2) copies around the data-parallel collectives of a rank
    with `psi` parameters (its stages, tensor-parallel local) in `layers` blocks, per micro-batch and
    per step (plan.comm.fsdp_copy_bytes); none under DDP. The published stacks' flat buffers are
    their collectives' own: nothing to copy."""
    if not lo.fsdp2:
        return {"micro": 0.0, "step": 0.0}
    stack = STACKS["flopwise"]
    f8 = layers * float8_weight_elements(m, lo.tp) if float8_all_gather(float8, lo) else 0.0
    collectives = dp_collectives(
        psi,
        lo.zero,
        zero1_broadcast=stack.zero1_broadcast,
        gather_per_micro=stack.fsdp2,
        pipelined=lo.pp > 1,
        hsdp=lo.dp_replicate > 1,
    )
    shard = lo.dp_shard * lo.cp
    if lo.zero == 0:  # FSDP2's replicate: a one-rank shard group, which unshards (casts and copies)
        # every parameter before each micro-batch's forward, once a step under a pipeline schedule
        # (it keeps them unsharded across the micro-batches), and gathers nothing
        collectives.append(
            Collective(
                kind="all_gather", elements=psi, when="step" if lo.pp > 1 else "micro", group="shard", gradients=False
            )
        )
        shard = 1
    return fsdp_copy_bytes(
        collectives,
        shard,
        n_micro,
        float8_elements=f8,
        compute_bytes=engine_precision(dtype, True).compute,
        reduce_bytes=stack.grad_reduce_bytes,
    )


def _pipeline_comm_times(sh: Shape, hw: Hardware, lo: Layout, stack: Stack, seq: int) -> tuple[float, float]:
    """(p2p time per micro-batch on a rank, per-step pipeline traffic). Per micro-batch each of the
    rank's v chunks exchanges one activation forward and one gradient backward with its neighbours
    (`plan.comm.pp_boundary_elements`); a scatter/gather stack then all-gathers each received
    tensor over the tensor-parallel ranks. Per step, tied embeddings split across the pipeline
    all-reduce the table's gradient between the first and last stage."""
    if lo.pp == 1:
        return 0.0, 0.0
    v = lo.n_stages // lo.pp
    sliced = lo.sequence_parallel or stack.pp_scatter_gather
    seq_local = seq // lo.cp
    send = ACT_BYTES * pp_boundary_elements(seq_local, lo.micro_batch, sh.d_model, lo.tp, sliced)
    whole = ACT_BYTES * pp_boundary_elements(seq_local, lo.micro_batch, sh.d_model, 1)
    pp_span = lo.tp * lo.cp * lo.dp  # stage neighbours are this many ranks apart in the mesh
    exchange = comm_time(hw, "send_recv", 2, send, pp_span + 1)
    if stack.pp_scatter_gather and not lo.sequence_parallel:
        exchange += comm_time(hw, "all_gather", lo.tp, whole, lo.tp)
    per_step = 0.0
    if sh.config.tie_embeddings:
        table = stack.grad_reduce_bytes * tied_embedding_elements(sh.vocab, sh.d_model, lo.tp)
        per_step = comm_time(hw, "all_reduce", 2, table, pp_span * (lo.pp - 1) + 1)
    return 2 * v * exchange, per_step


def _data_parallel_time(
    hw: Hardware, lo: Layout, stack: Stack, psi: float, n_micro: int, mb_total: float, rank_layers: int, lt: LayerTimes
) -> float:
    """Exposed data-parallel communication per step: the stack's collectives (`plan.comm`) over
    the dp rings, less what hides behind compute."""
    if lo.dp == 1:
        return 0.0
    span_shard = lo.tp * lo.cp * lo.dp_shard
    spans = {"shard": span_shard, "replicate": span_shard * lo.dp_replicate, "all": lo.tp * lo.cp * lo.dp}
    sizes = {"shard": lo.dp_shard, "replicate": lo.dp_replicate, "all": lo.dp}
    per = {"step": 0.0, "micro": 0.0, "after_step": 0.0}
    # ZeroRedundancyOptimizer broadcasts the updated fp32 master weights after the optimizer step
    param_bytes = stack.param_bytes if lo.zero == 1 and stack.zero1_broadcast else ACT_BYTES
    for c in dp_collectives(
        psi,
        lo.zero,
        zero1_broadcast=stack.zero1_broadcast,
        gather_per_micro=stack.fsdp2,
        pipelined=lo.pp > 1,
        hsdp=lo.dp_replicate > 1,
    ):
        nbytes = c.elements * (stack.grad_reduce_bytes if c.gradients else param_bytes)
        when = (
            "after_step" if c.when == "step" and not c.gradients and lo.zero == 1 and stack.zero1_broadcast else c.when
        )  # nothing to hide it behind: it follows the optimizer step
        per[when] += comm_time(hw, c.kind, sizes[c.group], nbytes, spans[c.group])
    # Overlap windows: the last micro-batch's backward for once-per-step traffic; every
    # micro-batch's compute for per-micro-batch traffic (FSDP prefetching); a calibrated device
    # hides only the share it was measured to (a CPU whose cores all compute: little).
    hides = stack.dp_overlap * (hw.calibration.overlap if hw.calibration else 1.0)
    exposed_step = max(0.0, per["step"] - hides * rank_layers * lt.bwd)
    if stack.fsdp2 and lo.zero <= 1 and lo.tp == 1:  # DDP: the last bucket is ready only when backward ends
        last = min(_DDP_BUCKET_BYTES, psi * stack.grad_reduce_bytes)
        exposed_step = max(exposed_step, comm_time(hw, "all_reduce", sizes["all"], last, spans["all"]))
    exposed_micro = n_micro * max(0.0, per["micro"] - hides * mb_total)
    return exposed_step + exposed_micro + per["after_step"]


def evaluate_layout(
    m: ModelConfig,
    hw: Hardware,
    lo: Layout,
    seq: int,
    global_batch: int,
    stack: str | Stack = "flopwise",
    compile: bool | str = "auto",
    steps: float = math.inf,
    dtype: str = "bf16",
    float8: str = "none",
    loss_chunk: int | str = "auto",
) -> Estimate:
    st = STACKS[stack] if isinstance(stack, str) else stack
    return estimate(
        model_shape(m, seq),
        hw,
        lo,
        seq,
        global_batch,
        st,
        compile=compile,
        steps=steps,
        dtype=dtype,
        float8=float8,
        loss_chunk=loss_chunk,
    )
