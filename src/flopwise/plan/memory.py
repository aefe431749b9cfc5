"""Memory per device: model states by ZeRO stage and activations by parallel layout. Pure Python.

Model states (Rajbhandari et al. 2020, §3.1 and Table 1): mixed-precision Adam keeps 2Ψ bytes of
16-bit parameters, 2Ψ of 16-bit gradients and KΨ of optimizer state (K = 12: fp32 master copy,
momentum, variance). Stage 1 shards the optimizer state over the N_d data-parallel ranks, stage 2
the gradients too, stage 3 the parameters too.

Activations (Korthikanti et al. 2022, §4 and Table 2), generalised from GPT's 4h GeLU MLP and
multi-head attention to any ffn width, SwiGLU, grouped-query attention, flash attention and
dropout-free models. With the paper's assumptions (MHA, ffn = 4h, dropout, no flash) it is exactly
their s·b·h·(34 + 5·a·s/h) and its tensor/sequence-parallel and recompute variants (tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flopwise.config import ModelConfig

OPTIMIZER_BYTES_PER_PARAM = 12  # K of mixed-precision Adam


@dataclass(frozen=True)
class ModelStates:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(psi: float, zero: int, shard: int, k: float = OPTIMIZER_BYTES_PER_PARAM,
                      param_bytes: float = 2, grad_bytes: float = 2, params_sharded: bool | None = None) -> ModelStates:
    """Bytes of parameters, gradients and optimizer state on one device holding `psi` parameters
    (its tensor/pipeline share), sharded `shard` ways by ZeRO stage `zero` (params_sharded: whether
    the parameters stay sharded through the step; by default from zero >= 3)."""
    sharded = zero >= 3 if params_sharded is None else params_sharded
    return ModelStates(params=param_bytes * psi / (shard if sharded else 1),
                       grads=grad_bytes * psi / (shard if zero >= 2 else 1),
                       optimizer=k * psi / (shard if zero >= 1 else 1))


def activation_bytes_per_layer(m: ModelConfig, seq: int, micro_batch: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               flash: bool = True, dropout: bool | None = None, mask_keys: int = 0) -> float:
    """Bytes one transformer layer keeps for backward, for one micro-batch, on one device.

    Items (16-bit activations, 1-byte dropout masks):
      replicated over tp unless sequence parallel: both norm inputs (2·2sbh), the attention and MLP
        inputs (2·2sbh), the two residual dropout masks (2·sbh);
      split over tp: Q, K, V (2sb·(h_q + 2·h_kv)), the output projection's input (2sb·h_q), the MLP
        (GeLU/ReLU: 2 tensors of 2sbf; SwiGLU: 4 of 2sbf);
      attention scores (not with flash attention): softmax output 2·a·s²·b, plus its dropout mask
        and output (a·s²·b + 2·a·s²·b) when dropout is on;
      a document mask (data.document_mask, `mask_keys` = the keys each query sees, the whole
        sequence under context parallel): SDPA keeps its own 16-bit copy of the (b, 1, s, keys)
        mask per layer, 2·s·b·keys, not split over tp (one mask serves every head).
    Selective recompute drops the score and mask terms; full recompute keeps only the layer input 2sbh.
    """
    s, b, h = seq, micro_batch, m.d_model
    sbh = s * b * h
    drop = (m.dropout > 0) if dropout is None else dropout
    rep_div = tp if sequence_parallel else 1
    if recompute == "full":
        return 2 * sbh / rep_div
    hq, hkv, f = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim, m.ffn_dim
    replicated = 4 * sbh + 4 * sbh + (2 * sbh if drop else 0)
    mlp = (4 if m.mlp == "swiglu" else 2) * 2 * s * b * f
    split = 2 * s * b * (hq + 2 * hkv) + 2 * s * b * hq + mlp
    scores = 0.0
    if not flash and recompute != "selective":
        scores = (2 + (3 if drop else 0)) * m.n_heads * s * s * b
    mask = 2 * s * b * mask_keys if recompute == "none" else 0
    return replicated / rep_div + (split + scores) / tp + mask


def in_flight_microbatches(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak.

    GPipe: all m (Huang et al. 2019). 1F1B: min(p, m) (Narayanan et al. 2021). Interleaved 1F1B:
    p·(1 + (p−1)/(p·v)) (Korthikanti et al. 2022 §4.2.3). ZB-V keeps 1F1B's p (Qi et al. 2024);
    DualPipeV one more (DeepSeek-V3 report: p + 1 in flight).
    """
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return microbatches
    if schedule == "interleaved-1f1b":
        return min(microbatches, pp) * (1 + (pp - 1) / (pp * virtual_stages))
    if schedule == "dualpipev":
        return min(microbatches, pp + 1)
    return min(microbatches, pp)


def rank_activation_bytes(m: ModelConfig, lo, seq: int, global_batch: int, layers: int, flash: bool = True,
                          document_mask: bool = False) -> float:
    """Saved activations a rank holding `layers` layers keeps at its peak: the micro-batches in
    flight on a first pipeline stage × its layers × one layer's bytes, plus, under full recompute,
    the one layer whose activations the backward rebuilds. `lo` is a plan.layout.Layout."""
    keys = seq if document_mask else 0
    args = (m, seq // lo.cp, lo.micro_batch, lo.tp, lo.sequence_parallel)
    per_layer = activation_bytes_per_layer(*args, lo.recompute, flash=flash, mask_keys=keys)
    in_flight = in_flight_microbatches(lo.pp_schedule, lo.pp, lo.microbatches(global_batch),
                                       lo.virtual_stages if lo.pp > 1 else 1)
    rebuilt = activation_bytes_per_layer(*args, "none", flash=flash, mask_keys=keys) if lo.recompute == "full" else 0.0
    return per_layer * layers * in_flight + rebuilt


# Tensor-parallel split of each parameter in this engine's Megatron plan (parallel/tensor.py):
# column-parallel weights and biases split dim 0, row-parallel weights dim 1 (their biases and
# every norm are replicated), the vocab-parallel embedding and head split the vocabulary.
_TP_DIM0 = ("attention.wq.", "attention.wk.", "attention.wv.", "feed_forward.w1.", "feed_forward.w3.",
            "tok_embeddings.weight", "output.weight")
_TP_DIM1 = ("attention.wo.weight", "feed_forward.w2.weight")


def _tp_local(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    if tp > 1 and any(k in name for k in _TP_DIM0):
        return (shape[0] // tp, *shape[1:])
    if tp > 1 and name.endswith(_TP_DIM1):
        return (shape[0], shape[1] // tp)
    return shape


def _chunk_rows(rows: int, n: int, rank: int) -> int:
    """Rows FSDP2 gives `rank` of n when it shards dim 0 (torch.chunk: ceil-sized chunks, the
    last ranks may get fewer or none)."""
    size = -(-rows // n)
    return max(0, min(rows, (rank + 1) * size) - rank * size)


def _zero1_owned(sizes: list[tuple[int, bool]], n: int, rank: int) -> int:
    """Elements ZeroRedundancyOptimizer assigns to `rank`: per param group (decay, then no decay),
    largest tensor first, each to the least-loaded rank so far (torch's greedy partition)."""
    load, mine = [0] * n, 0
    for decay in (True, False):
        for numel in sorted((k for k, d in sizes if d == decay), reverse=True):
            r = load.index(min(load))
            load[r] += numel
            mine += numel if r == rank else 0
    return mine


def _rank_tensors(m: ModelConfig, lo, stage_layers: list[int], has_embedding: bool,
                  has_head: bool) -> list[tuple[tuple[int, ...], bool]]:
    """(tensor-parallel local shape, weight-decayed) of each parameter one rank holds."""
    from flopwise.flops import param_shapes

    layers = {f"layers.{i}." for i in stage_layers}
    head_names = ("norm.weight", "norm.bias", "output.weight")
    mine = []
    for name, shape in param_shapes(m):
        if name.startswith("layers."):
            keep = name[:name.index(".", 7) + 1] in layers
        elif name in head_names:
            keep = has_head
        else:
            keep = has_embedding
        if keep:
            mine.append((_tp_local(name, shape, lo.tp), len(shape) >= 2 and "embeddings" not in name))
    return mine


def rank_param_count(m: ModelConfig, lo, stage_layers: list[int], has_embedding: bool, has_head: bool) -> int:
    """Parameters of one rank's stages, its tensor-parallel slice, before any ZeRO sharding (the
    buffer its data-parallel collectives move)."""
    return sum(math.prod(s) for s, _ in _rank_tensors(m, lo, stage_layers, has_embedding, has_head))


def rank_model_states(m: ModelConfig, lo, stage_layers: list[int], has_embedding: bool, has_head: bool,
                      shard_rank: int = 0, dp_rank: int = 0, param_bytes: int = 4, grad_bytes: int = 4,
                      k: int = 8) -> ModelStates:
    """Exactly what one rank of this engine holds (fp32 master weights, fp32 gradients after the
    backward, AdamW moments after the step), tensor by tensor: the rank's pipeline stages
    (`stage_layers`: their layer indices), its tensor-parallel slice, and its data-parallel share:
    DDP replicates; ZeRO-1 partitions whole tensors over the dp·cp ranks (`dp_rank` among them);
    FSDP2 (zero 2/3) shards dim 0 over the dp_shard·cp ranks (`shard_rank`), at rest. `lo` is a
    plan.layout.Layout."""
    mine = _rank_tensors(m, lo, stage_layers, has_embedding, has_head)
    whole = sum(math.prod(s) for s, _ in mine)
    n_shard = lo.dp_shard * lo.cp
    sharded = sum(_chunk_rows(s[0], n_shard, shard_rank) * math.prod(s[1:]) for s, _ in mine)
    if lo.zero >= 2 and lo.world > 1:  # FSDP2 (any process group)
        return ModelStates(param_bytes * sharded, grad_bytes * sharded, k * sharded)
    if lo.zero == 1 and lo.dp * lo.cp > 1:
        owned = _zero1_owned([(math.prod(s), d) for s, d in mine], lo.dp * lo.cp, dp_rank)
        return ModelStates(param_bytes * whole, grad_bytes * whole, k * owned)
    return ModelStates(param_bytes * whole, grad_bytes * whole, k * whole)
