"""Communication volumes per step and ring-collective times. Pure Python.

Volumes are the bytes one device sends (= receives) in a ring, the quantity the distributed engine
will count and the planner will time:
- data parallel (Rajbhandari et al. 2020 §7): stages 0-2 move 2Ψ elements per step (reduce-scatter
  of gradients + all-gather of parameters, or an all-reduce of the same size), stage 3 moves 3Ψ
  (parameters all-gathered in forward and again in backward, gradients reduce-scattered);
- tensor parallel (Narayanan et al. 2021 §3.2/§4.1): 4 all-reduces of b·s·h per layer per
  micro-batch in forward + backward, each 2·(t−1)/t of its size on the wire per device; with
  sequence parallelism each becomes an all-gather + reduce-scatter, and Megatron all-gathers the
  two column-parallel inputs again in backward, 2 more b·s·h (Korthikanti et al. 2022 §4.2.2);
- pipeline parallel: b·s·h per micro-batch per stage boundary, each way (activations forward,
  gradients backward); /t with scatter/gather across the tensor-parallel ranks, after which the
  receiver all-gathers the b·s·h over NVLink (Narayanan et al. 2021 §4.1), or /t natively when
  sequence parallelism already splits the tensor by sequence;
- tied embeddings split across the pipeline: the table's gradient all-reduced once per step
  between the first and the last stage (Shoeybi/Narayanan Megatron-LM, `_allreduce_embedding_grads`).
A ring collective over n devices moves (n−1)/n of the buffer per device for reduce-scatter or
all-gather, 2(n−1)/n for all-reduce; its time is α·steps + bytes / bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def sp_regather_elements(seq: float, micro_batch: int, d_model: int, n_layers: int) -> float:
    """Elements all-gathered again in backward under Megatron's sequence parallelism, per
    micro-batch: 2 · b·s·h per layer. It saves only the sequence shard of the inputs of the two
    column-parallel linears (QKV, MLP up) and re-gathers each to compute the weight gradient
    (Korthikanti et al. 2022 §4.2.2)."""
    return 2 * seq * micro_batch * d_model * n_layers


def pp_boundary_elements(seq: int, micro_batch: int, d_model: int, tp: int = 1, scatter_gather: bool = True) -> float:
    """Elements sent across one stage boundary per micro-batch, one direction."""
    return seq * micro_batch * d_model / (tp if scatter_gather else 1)


def tied_embedding_elements(vocab: int, d_model: int, tp: int) -> float:
    """Elements of the embedding-table gradient shard the first and last pipeline stages all-reduce
    per step when the output layer shares the table (vocab-parallel: V·h/t per rank)."""
    return vocab * d_model / tp


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One data-parallel collective: its kind, the elements of its full buffer, how often it runs
    ("step" or "micro": every micro-batch), over which ranks ("shard": the ZeRO shard group,
    "replicate": across HSDP replicas, "all": every rank holding the same weights), and whether it
    carries gradients (else parameters)."""

    kind: str
    elements: float
    when: str
    group: str
    gradients: bool


def dp_collectives(
    psi: float,
    zero: int,
    *,
    zero1_broadcast: bool = False,
    gather_per_micro: bool = False,
    pipelined: bool = False,
    hsdp: bool = False,
) -> list[Collective]:
    """What a data-parallel rank runs per step for `psi` parameters by ZeRO stage.

    zero 0: one all-reduce of the gradients per step. zero 1: the paper's reduce-scatter of the
    gradients and all-gather of the updated parameters (Megatron's distributed optimizer), or with
    `zero1_broadcast` torch's ZeroRedundancyOptimizer: DDP's all-reduce, then every rank
    broadcasts the parameters it stepped (Ψ more). zero 2/3: gradients reduce-scattered after every
    micro-batch's backward; parameters gathered once per step (the paper), or for every
    micro-batch (`gather_per_micro`: FSDP2 frees them after each backward), and under zero 3 again
    for the backward. A pipeline stage keeps both across its micro-batches: once per step.
    HSDP adds an all-reduce of the gradient shards across replicas with each reduce-scatter."""
    if zero == 0:
        return [Collective(kind="all_reduce", elements=psi, when="step", group="all", gradients=True)]
    if zero == 1 and zero1_broadcast:
        return [
            Collective(kind="all_reduce", elements=psi, when="step", group="all", gradients=True),
            Collective(kind="all_gather", elements=psi, when="step", group="all", gradients=False),
        ]
    micro = "step" if zero == 1 or pipelined else "micro"
    out = [
        Collective(kind="reduce_scatter", elements=psi, when=micro, group="shard", gradients=True),
        Collective(
            kind="all_gather",
            elements=psi,
            when=micro if zero >= 3 or gather_per_micro else "step",
            group="shard",
            gradients=False,
        ),
    ]
    if zero >= 3 and not pipelined:
        out.append(Collective(kind="all_gather", elements=psi, when="micro", group="shard", gradients=False))
    if hsdp:
        out.append(Collective(kind="all_reduce", elements=psi, when=micro, group="replicate", gradients=True))
    return out


def fsdp_copy_bytes(
    collectives: list[Collective],
    shard: int,
    n_micro: int,
    *,
    compute_bytes: int,
    reduce_bytes: int,
    master_bytes: int = 4,
    float8_elements: float = 0.0,
) -> dict[str, float]:
    """HBM bytes FSDP2 copies around its data-parallel collectives (`dp_collectives`' list), by when
    they run ("micro", "step"), on one rank of a `shard`-rank shard group (dp_shard · cp). From
    torch.distributed.fsdp's foreach_all_gather, foreach_all_gather_copy_out and foreach_reduce:

    - each parameter all-gather: the fp32 shards cast to the compute dtype (one foreach copy; none
      when they already are), copied into the all-gather buffer, and the gathered buffer split into
      the parameters (split_with_sizes_copy): read + write of the shard, the shard, the whole.
      `float8_elements` of them (torchao's float8 all-gather) are gathered at 1 byte, cast by
      torchao (plan.float8's cast bytes), not by the foreach copy. A one-rank shard group gathers
      nothing (FSDPParamGroup.unshard): each parameter is cast and copied into its unsharded tensor;
    - each gradient reduction (reduce-scatter; the all-reduce of FSDP2's replicate): the
      gradients concatenated into one buffer in the reduce dtype (chunk_cat: read the gradients,
      write fp32), from the compute dtype or, accumulated over micro-batches before a per-step
      reduction, from the reduce dtype; with no shard group to scatter over (one rank, replicate)
      the buffer is copied into the output besides.
    HSDP's all-reduce across replicas works in place on that output: nothing more."""
    out = {"micro": 0.0, "step": 0.0}
    for c in collectives:
        if c.kind == "all_gather" and not c.gradients:
            plain = c.elements - float8_elements
            gathered = compute_bytes * plain + float8_elements
            cast = (master_bytes + compute_bytes) * plain / shard if compute_bytes != master_bytes else 0.0
            out[c.when] += cast + 2 * gathered * (1 if shard == 1 else 1 + 1 / shard)
        elif c.gradients and (c.kind == "reduce_scatter" or c.group == "all"):
            grads = reduce_bytes if c.when == "step" and n_micro > 1 else compute_bytes
            alone = c.kind != "reduce_scatter" or shard == 1
            out[c.when] += (grads + reduce_bytes + 2 * reduce_bytes * alone) * c.elements
    return out
