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

    def context(self, start: int, t: int, device: torch.device) -> AttnContext:
        """Positions and mask for `t` new tokens after `start` cached ones (or this rank's tokens of
        a context-parallel sequence, attending to the all-gathered keys)."""
        m = self.cfg
        gather = None
        if self.cp is not None:
            seq = t * self.cp.size
            q_pos, k_pos = self.cp.positions(seq).to(device), self.cp.key_positions(seq).to(device)
            gather = self.cp.gather
        else:
            q_pos = torch.arange(start, start + t, device=device)
            k_pos = torch.arange(0, start + t, device=device)
        cos = sin = None
        if m.pos == "rope":
            cos, sin = self.rope_cos[q_pos], self.rope_sin[q_pos]
        allowed = None
        if m.sliding_window or start > 0 or gather is not None:
            allowed = k_pos[None, :] <= q_pos[:, None]
            if m.sliding_window:
                allowed = allowed & (q_pos[:, None] - k_pos[None, :] < m.sliding_window)
        if m.pos == "alibi":
            dist = (q_pos[:, None] - k_pos[None, :]).float()
            bias = -self.alibi[:, None, None] * dist
            keep = allowed if allowed is not None else (k_pos[None, :] <= q_pos[:, None])
            return AttnContext(q_pos, k_pos, cos, sin, bias.masked_fill(~keep, float("-inf")), False, gather)
        is_causal = allowed is None and m.pos != "relative"
        if m.pos == "relative" and allowed is None:
            allowed = k_pos[None, :] <= q_pos[:, None]
        return AttnContext(q_pos, k_pos, cos, sin, allowed, is_causal, gather)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """tokens (b, t) -> logits (b, t, vocab). A pipeline stage without the embedding takes the
        previous stage's hidden states (b, t, d) instead, and one without the head returns them."""
        start = cache.pos if cache is not None else 0
        first = self.tok_embeddings is not None
        t = tokens.shape[1] * (1 if first else self.hidden_seq_div)
        full = t * (self.cp.size if self.cp is not None else 1)
        if start + full > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {start + full} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}")
        ctx = self.context(start, t, tokens.device)
        h = tokens
        if first:
            h = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(ctx.q_pos + self.cfg.pos_offset)
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
