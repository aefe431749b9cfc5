"""The model as the planner computes with it: its numbers, extracted once, and what each pipeline
rank of a layout holds. Pure Python, read by the byte account and the time model alike."""

from __future__ import annotations

from dataclasses import dataclass

from flopwise.config.schema import ModelConfig
from flopwise.flops import count_params, flops_per_token
from flopwise.layout.rules import Layout, stage_ids, stage_sizes


@dataclass(frozen=True, kw_only=True)
class Shape:
    """The numbers of a ModelConfig the step model needs, extracted once (the search calls this a lot)."""

    n_layers: int
    d_model: int
    hq: int
    hkv: int
    ffn: int
    ffn_in: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    dropout: bool
    relative: bool
    window: int | None
    params: int
    layer_params: float  # one block's parameters
    embed_params: int  # token (+ position) table and embedding norm, on the first stage
    final_norm_params: int  # on the last stage, with the output matrix (a copy of the table when tied and pp > 1)
    model_flops_token: dict  # recompute -> FLOPs per token, at the planned seq_len
    config: ModelConfig
    document_mask: bool = False  # data.document_mask: a (b, 1, s, s) mask instead of is_causal


def model_shape(m: ModelConfig, seq_len: int, document_mask: bool = False) -> Shape:
    """The step model's view of a model. A document mask changes no FLOP (the dense SDPA kernel
    computes every score and the convention counts the full context anyway) but adds the mask to
    each layer's saved activations (`activation_bytes_per_layer`)."""
    p = count_params(m)
    return Shape(
        n_layers=m.n_layers,
        d_model=m.d_model,
        hq=m.n_heads * m.head_dim,
        hkv=m.n_kv_heads * m.head_dim,
        ffn=m.ffn_dim,
        ffn_in=2 if m.mlp == "swiglu" else 1,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        head_dim=m.head_dim,
        vocab=m.vocab_size,
        dropout=m.dropout > 0,
        relative=m.pos == "relative",
        window=m.sliding_window,
        params=p.total,
        layer_params=p.per_layer,
        embed_params=p.embed_side,
        final_norm_params=p.head_side - (0 if m.tie_embeddings else p.head_matmul),
        model_flops_token={r: flops_per_token(m, seq_len, r) for r in ("none", "selective", "full")},
        config=m,
        document_mask=document_mask,
    )


@dataclass(frozen=True, kw_only=True)
class RankLoad:
    """What one pipeline rank holds: layers, parameters (its tensor-parallel shard), the head, the embedding."""

    layers: int
    params: float
    head: bool
    embedding: bool = False
    stages: tuple[int, ...] = ()  # layers of each of its stages (recompute_every counts per stage)


def rank_loads(sh: Shape, lo: Layout, balanced: bool) -> list[RankLoad]:
    """Per pipeline rank, with the engine's (or Megatron's) stage split (`layout.rules`)."""
    sizes = stage_sizes(sh.config, lo, balanced)
    last = lo.n_stages - 1
    tied_whole = lo.pp == 1 and sh.config.tie_embeddings  # one table serves both ends
    head_side = sh.final_norm_params if tied_whole else sh.final_norm_params + sh.vocab * sh.d_model
    out = []
    for r in range(lo.pp):
        ids = stage_ids(r, lo)
        head = last in ids
        psi = (
            sum(sizes[i] for i in ids) * sh.layer_params
            + (sh.embed_params if 0 in ids else 0)
            + (head_side if head else 0)
        )
        stages = tuple(sizes[i] for i in ids)
        out.append(RankLoad(layers=sum(stages), params=psi / lo.tp, head=head, embedding=0 in ids, stages=stages))
    return out


def first_ranks(loads: list[RankLoad]) -> list[tuple[RankLoad, int]]:
    """Each distinct pipeline-rank load with the first rank that has it (the most micro-batches in
    flight of those alike): ranks alike count once."""
    first: dict[RankLoad, int] = {}
    for r, load in enumerate(loads):
        first.setdefault(load, r)
    return list(first.items())
