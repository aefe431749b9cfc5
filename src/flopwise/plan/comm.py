"""Communication volumes per step and ring-collective times. Pure Python.

Volumes are the bytes one device sends (= receives) in a ring, the quantity the distributed engine
will count and the planner will time:
- data parallel (Rajbhandari et al. 2020 §7): stages 0-2 move 2Ψ elements per step (reduce-scatter
  of gradients + all-gather of parameters, or an all-reduce of the same size), stage 3 moves 3Ψ
  (parameters all-gathered in forward and again in backward, gradients reduce-scattered);
- tensor parallel (Narayanan et al. 2021 §3.2/§4.1): 4 all-reduces of b·s·h per layer per
  micro-batch in forward + backward, each 2·(t−1)/t of its size on the wire per device;
- pipeline parallel: b·s·h per micro-batch per stage boundary, each way (activations forward,
  gradients backward); /t with scatter/gather across the tensor-parallel ranks.
A ring collective over n devices moves (n−1)/n of the buffer per device for reduce-scatter or
all-gather, 2(n−1)/n for all-reduce; its time is α·steps + bytes / bandwidth.
"""

from __future__ import annotations


def ring_factor(kind: str, n: int) -> float:
    """Bytes on the wire per device, as a multiple of the full buffer's bytes."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    raise ValueError(f"unknown collective {kind!r}")


def ring_time(kind: str, n: int, nbytes: float, bandwidth: float, latency: float = 5e-6) -> float:
    """α-β model of a ring collective: 2(n−1) or (n−1) latency steps plus bytes over the link."""
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return steps * latency + ring_factor(kind, n) * nbytes / bandwidth


def dp_elements_per_step(psi: float, zero: int) -> float:
    """Elements of the buffers a data-parallel rank communicates per step: 2Ψ, or 3Ψ at stage 3."""
    return 3 * psi if zero >= 3 else 2 * psi


def tp_allreduce_elements(seq: int, micro_batch: int, d_model: int, n_layers: int) -> float:
    """Elements all-reduced by tensor parallelism per micro-batch: 4 · b·s·h per layer."""
    return 4 * seq * micro_batch * d_model * n_layers


def pp_boundary_elements(seq: int, micro_batch: int, d_model: int, tp: int = 1, scatter_gather: bool = True) -> float:
    """Elements sent across one stage boundary per micro-batch, one direction."""
    return seq * micro_batch * d_model / (tp if scatter_gather else 1)
