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
                      param_bytes: float = 2, grad_bytes: float = 2) -> ModelStates:
    """Bytes of parameters, gradients and optimizer state on one device holding `psi` parameters
    (its tensor/pipeline share), sharded `shard` ways by ZeRO stage `zero`."""
    return ModelStates(params=param_bytes * psi / (shard if zero >= 3 else 1),
                       grads=grad_bytes * psi / (shard if zero >= 2 else 1),
                       optimizer=k * psi / (shard if zero >= 1 else 1))


def activation_bytes_per_layer(m: ModelConfig, seq: int, micro_batch: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               flash: bool = True, dropout: bool | None = None) -> float:
    """Bytes one transformer layer keeps for backward, for one micro-batch, on one device.

    Items (16-bit activations, 1-byte dropout masks):
      replicated over tp unless sequence parallel: both norm inputs (2·2sbh), the attention and MLP
        inputs (2·2sbh), the two residual dropout masks (2·sbh);
      split over tp: Q, K, V (2sb·(h_q + 2·h_kv)), the output projection's input (2sb·h_q), the MLP
        (GeLU/ReLU: 2 tensors of 2sbf; SwiGLU: 4 of 2sbf);
      attention scores (not with flash attention): softmax output 2·a·s²·b, plus its dropout mask
        and output (a·s²·b + 2·a·s²·b) when dropout is on.
    Selective recompute drops the score terms; full recompute keeps only the layer input 2sbh.
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
    return replicated / rep_div + (split + scores) / tp


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
