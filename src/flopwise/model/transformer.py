"""The dense decoder-only Transformer: a plain nn.Module. Parallelism, activation checkpointing
and compilation are applied from outside (flopwise.parallel.apply).

Initialisation (`init_weights`): every weight matrix and embedding ~ N(0, init_std) (0.02 by
default, GPT-2), the residual output projections (attention.wo, feed_forward.w2) ~ N(0,
init_std/√(2·n_layers)) so the residual stream's variance does not grow with depth (GPT-2,
Megatron); biases 0, norm gains 1. The draws are layout-invariant (flopwise.model.init): a rank
that holds a shard initialises only that shard, with the values the one-process model has there.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flopwise.config import ModelConfig
from flopwise.model.init import canonical_name, fill_constant, fill_normal
from flopwise.model.layers import AttnContext, Block, KVCache, alibi_slopes, make_norm, rope_cos_sin


class Transformer(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.cfg = m
        self.tok_embeddings = nn.Embedding(m.vocab_size, m.d_model)
        self.pos_embeddings = nn.Embedding(m.max_seq_len + m.pos_offset, m.d_model) if m.pos == "learned" else None
        self.embed_norm = make_norm(m, m.d_model) if m.embed_norm else None
        self.dropout = nn.Dropout(m.dropout)
        self.layers = nn.ModuleDict({str(i): Block(m, i) for i in range(m.n_layers)})
        self.norm = make_norm(m, m.d_model)
        self.output = nn.Linear(m.d_model, m.vocab_size, bias=False)
        self.tie_weights()
        # Set from outside by flopwise.parallel (the model never imports it): a context-parallel
        # sharder of the sequence, how many ways sequence parallel splits a stage's input, and
        # which of the heads this rank computes under tensor parallel (rank, ways).
        self.cp = None
        self.hidden_seq_div = 1
        self.tp_heads = (0, 1)
        self.reset_buffers()

    def tie_weights(self) -> None:
        """Share the head with the embedding; redo after `to_empty`, which unties parameters."""
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """The computed (non-persistent) buffers: RoPE tables, this rank's ALiBi slopes."""
        m = self.cfg
        if m.pos == "rope":
            cos, sin = rope_cos_sin(m, m.max_seq_len)
            self.register_buffer("rope_cos", cos.to(device), persistent=False)
            self.register_buffer("rope_sin", sin.to(device), persistent=False)
        if m.pos == "alibi":
            rank, ways = self.tp_heads
            h = m.n_heads // ways
            self.register_buffer("alibi", alibi_slopes(m.n_heads)[rank * h:(rank + 1) * h].to(device), persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise the parameters this module (or rank) holds, and recompute the buffers (after
        `to_empty` from meta). Values depend on (seed, name, position) only, not on the layout."""
        m = self.cfg
        resid_std = m.init_std / math.sqrt(2 * m.n_layers)
        device = None
        for raw, p in self.named_parameters():
            name, device = canonical_name(raw), p.device
            if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                fill_normal(p, name, seed, resid_std)
            elif p.dim() >= 2:
                fill_normal(p, name, seed, m.init_std)
            else:
                fill_constant(p, 1.0 if "norm" in name and name.endswith("weight") else 0.0)
        for module in self.modules():
            if hasattr(module, "reset_buffers"):
                module.reset_buffers(device)

    def context(self, start: int, t: int, device: torch.device, documents: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> AttnContext:
        """Positions and mask for `t` new tokens after `start` cached ones (or this rank's tokens of
        a context-parallel sequence, attending to the all-gathered keys). `documents` (b, s) numbers
        the document of every token of the whole sequence: attention then stays inside documents.
        `positions` (b, s) replaces the absolute positions the embeddings see (e.g. restarting in
        every document); masks and relative terms keep using the absolute ones."""
        m = self.cfg
        gather = None
        if self.cp is not None:
            seq = t * self.cp.size
            q_pos, k_pos = self.cp.positions(seq).to(device), self.cp.key_positions(seq).to(device)
            gather = self.cp.gather
        else:
            q_pos = torch.arange(start, start + t, device=device)
            k_pos = torch.arange(0, start + t, device=device)
        pos_ids = q_pos if positions is None else positions[:, q_pos]
        cos = sin = None
        if m.pos == "rope":
            cos, sin = self.rope_cos[pos_ids], self.rope_sin[pos_ids]
            if pos_ids.dim() == 2:  # per sequence: (b, t, r) -> (b, 1, t, r) against (b, h, t, d)
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        allowed = None
        if m.sliding_window or start > 0 or gather is not None or documents is not None:
            allowed = k_pos[None, :] <= q_pos[:, None]
            if m.sliding_window:
                allowed = allowed & (q_pos[:, None] - k_pos[None, :] < m.sliding_window)
            if documents is not None:  # (b, 1, t, k): one mask per sequence, shared by the heads
                same = documents[:, q_pos, None] == documents[:, None, k_pos]
                allowed = (allowed & same).unsqueeze(1)
        if m.pos == "alibi":
            dist = (q_pos[:, None] - k_pos[None, :]).float()
            bias = -self.alibi[:, None, None] * dist
            keep = allowed if allowed is not None else (k_pos[None, :] <= q_pos[:, None])
            return AttnContext(q_pos, k_pos, cos, sin, torch.where(keep, bias, float("-inf")), False, gather, pos_ids)
        is_causal = allowed is None and m.pos != "relative"
        if m.pos == "relative" and allowed is None:
            allowed = k_pos[None, :] <= q_pos[:, None]
        return AttnContext(q_pos, k_pos, cos, sin, allowed, is_causal, gather, pos_ids)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, documents: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (b, t) -> logits (b, t, vocab). A pipeline stage without the embedding takes the
        previous stage's hidden states (b, t, d) instead, and one without the head returns them.
        `documents` and `positions` (b, s), over the whole (not context-sharded) sequence: see
        `context`; `document_ids` and `document_positions` make them from the tokens."""
        start = cache.pos if cache is not None else 0
        first = self.tok_embeddings is not None
        t = tokens.shape[1] * (1 if first else self.hidden_seq_div)
        full = t * (self.cp.size if self.cp is not None else 1)
        if start + full > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {start + full} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}")
        ctx = self.context(start, t, tokens.device, documents, positions)
        h = tokens
        if first:
            h = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(ctx.pos_ids + self.cfg.pos_offset)
            if self.embed_norm is not None:
                h = self.embed_norm(h)
            h = self.dropout(h)
        for layer in self.layers.values():
            h = layer(h, ctx, cache)
        if cache is not None:
            cache.pos += t
        if self.output is None:
            return h
        return self.output(self.norm(h))


def document_ids(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """(b, s) tokens -> (b, s) index of each token's document in its window. EOS opens the document
    after it (it plays BOS), so a packed document [EOS, x1, ..., xn] is seen as it would be alone."""
    return (tokens == eos).cumsum(1)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """(b, s) document ids -> each token's position inside its document (0 at its first token)."""
    idx = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return idx - torch.where(starts, idx, 0).cummax(1).values


def build_model(m: ModelConfig, device: str | torch.device = "cpu", seed: int = 0) -> Transformer:
    """Build on the meta device (no memory), then materialise on `device` and initialise.

    `device="meta"` returns the unmaterialised model, e.g. to count a 405B preset's parameters, or
    to split and shard before anything is allocated (flopwise.build).
    """
    with torch.device("meta"):
        model = Transformer(m)
    if str(device) != "meta":
        materialise(model, device, seed)
    return model


def materialise(model: nn.Module, device: str | torch.device, seed: int) -> None:
    """Allocate what this rank holds of a meta-device model (whole tensors, or DTensor shards once
    it is sharded) and initialise it."""
    model.to_empty(device=device)
    plain = model.module if hasattr(model, "module") else model
    if isinstance(plain, Transformer):
        plain.tie_weights()
    plain.init_weights(seed)
