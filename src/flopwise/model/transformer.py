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
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from flopwise.config.schema import ModelConfig
from flopwise.model.init import canonical_name, fill_constant, fill_normal, global_box
from flopwise.model.layers import AttnContext, Block, KVCache, Span, alibi_slopes, make_norm, rope_cos_sin


class Transformer(nn.Module):
    """A plain module: parameters, and the computed buffers (RoPE tables, ALiBi slopes). What a
    parallel layout changes reaches it as data: the span of the sequence a forward computes (and
    how to gather the other ranks' keys), or a buffer the parallel plan sharded (ALiBi's slopes
    across tensor-parallel heads); it holds no parallel state of its own."""

    rope_cos: torch.Tensor  # buffers, registered by the positions in use
    rope_sin: torch.Tensor
    alibi: torch.Tensor

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
        self.reset_buffers()

    def tie_weights(self) -> None:
        """Share the head with the embedding; redo after `to_empty`, which unties parameters."""
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """The computed (non-persistent) buffers: RoPE tables, ALiBi slopes (of the heads this rank
        holds, where a tensor-parallel plan sharded the buffer: flopwise.parallel.tensor)."""
        m = self.cfg
        if m.pos == "rope":
            cos, sin = rope_cos_sin(m, m.max_seq_len)
            self.register_buffer("rope_cos", cos.to(device), persistent=False)
            self.register_buffer("rope_sin", sin.to(device), persistent=False)
        if m.pos == "alibi":
            held = getattr(self, "alibi", None)
            self.register_buffer("alibi", _held_part(alibi_slopes(m.n_heads), held, device), persistent=False)

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
            if (reset := getattr(module, "reset_buffers", None)) is not None:
                reset(device)

    def context(
        self, span: Span, documents: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> AttnContext:
        """What every layer shares for the tokens at `span`: positions, rope tables, the mask (see
        `forward` for `documents` and `positions`)."""
        m = self.cfg
        pos_ids = _position_ids(span, positions)
        cos = sin = None
        if m.pos == "rope":
            cos, sin = _rope_tables(self.rope_cos, self.rope_sin, pos_ids)
        mask = _allowed_keys(span, m.sliding_window, documents)
        if m.pos == "alibi":
            mask = _alibi_mask(_local_part(self.alibi), span, mask)
        elif m.pos == "relative" and mask is None:  # Attention._relative folds its terms into a mask
            mask = causal(span)
        return AttnContext(span, cos, sin, mask, mask is None, pos_ids)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        span: Span | None = None,
        last_only: bool = False,
        targets: torch.Tensor | None = None,
        loss_chunk: int = 0,
    ) -> torch.Tensor:
        """tokens (b, t) -> logits (b, t, vocab), or with `targets` (b, t) the mean next-token loss
        (`head_loss`, `loss_chunk` tokens at a time) as a (1,) tensor: a pipeline schedule
        concatenates its last stage's outputs, which a 0-d tensor cannot be. A pipeline stage
        without the embedding takes the previous stage's hidden states (b, t, d) instead, and one
        without the head returns them.

        `span`: the positions these tokens hold in their sequence and the keys they attend to (a
        context-parallel shard's, flopwise.parallel.context); by default a whole sequence from
        position 0, or the tokens after a KV cache's. `documents` and `positions` (b, s), over the
        whole (not context-sharded) sequence: `documents` numbers the document of every token and
        attention stays inside documents; `positions` replaces the absolute positions the
        embeddings see (e.g. restarting in every document), while masks and relative terms keep the
        absolute ones. `document_ids` and `document_positions` make them from the tokens.
        `last_only`: the logits of the last position alone (b, 1, vocab), all that generation reads:
        a prompt's head products are one token's, not the prompt's."""
        if span is None:
            span = Span.after(cache.pos if cache is not None else 0, tokens.shape[1], tokens.device)
        if span.length > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {span.length} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}")
        ctx = self.context(span, documents, positions)
        h = self.embed(tokens, ctx.pos_ids) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, ctx, cache)
        if cache is not None:
            cache.pos += span.q_pos.shape[0]
        if self.output is None:
            return h
        if targets is not None:
            return self.head_loss(h, targets, loss_chunk).reshape(1)
        return self.output(self.norm(h[:, -1:] if last_only else h))

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32) of the last block's output h (b, t, d): the norm,
        then the head and the loss `chunk` tokens at a time (0: all at once), each chunk under
        activation checkpointing, so one chunk's logits and log-softmax exist at a time, in forward
        and in backward (which reruns that chunk's head). Under tensor parallel the head's logits are
        vocabulary shards (the engine's loss_parallel); sequence-parallel states are gathered once.
        The head and loss draw no random numbers: no RNG state is kept per chunk."""
        h = self.norm(h)
        if isinstance(h, DTensor):
            h = h.redistribute(h.device_mesh, [Replicate()] * h.device_mesh.ndim)
        h, targets = h.flatten(0, 1), targets.flatten()
        chunk = chunk or targets.numel()
        sums = [
            checkpoint(self._chunk_loss, hc, yc, use_reentrant=False, preserve_rng_state=False)
            for hc, yc in zip(h.split(chunk), targets.split(chunk), strict=True)
        ]
        return sum(sums[1:], sums[0]) / targets.numel()

    def _chunk_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.output(h).float(), targets, reduction="sum")

    def embed(self, tokens: torch.Tensor, pos_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(pos_ids + self.cfg.pos_offset)
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        return self.dropout(h)


# --- what a forward's span means for attention: one concern each ------------------------------


def _position_ids(span: Span, positions: torch.Tensor | None) -> torch.Tensor:
    """The positions RoPE and learned embeddings see: the queries' absolute ones (t,), or theirs in
    `positions` (b, s) over the whole sequence: (b, t)."""
    return span.q_pos if positions is None else positions[:, span.q_pos]


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor, pos_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the RoPE tables at `pos_ids`; per sequence (b, t, r) -> (b, 1, t, r) against (b, h, t, d)."""
    cos, sin = cos[pos_ids], sin[pos_ids]
    if pos_ids.dim() == 2:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return cos, sin


def causal(span: Span) -> torch.Tensor:
    """(t, k) bool: each query sees the keys at or before its position."""
    return span.k_pos[None, :] <= span.q_pos[:, None]


def _allowed_keys(span: Span, window: int | None, documents: torch.Tensor | None) -> torch.Tensor | None:
    """Which keys each query may see, or None where SDPA's is_causal says it (a whole sequence, no
    window, no documents): causal, within `window` positions, and inside the query's document
    (`documents` (b, s): then one (b, 1, t, k) mask per sequence, shared by the heads)."""
    if span.whole and not window and documents is None:
        return None
    allowed = causal(span)
    if window:
        allowed = allowed & (span.q_pos[:, None] - span.k_pos[None, :] < window)
    if documents is not None:
        same = documents[:, span.q_pos, None] == documents[:, None, span.k_pos]
        allowed = (allowed & same).unsqueeze(1)
    return allowed


def _alibi_mask(slopes: torch.Tensor, span: Span, allowed: torch.Tensor | None) -> torch.Tensor:
    """ALiBi (Press et al. 2022): −slope·distance on the keys a query may see, −inf elsewhere;
    (h, t, k), or (b, h, t, k) with a per-sequence mask."""
    dist = (span.q_pos[:, None] - span.k_pos[None, :]).float()
    bias = -slopes[:, None, None] * dist
    keep = allowed if allowed is not None else causal(span)
    return torch.where(keep, bias, float("-inf"))


def _local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a buffer a parallel plan sharded (a DTensor), or the buffer."""
    return t.to_local() if isinstance(t, DTensor) else t


def _held_part(full: torch.Tensor, held: torch.Tensor | None, device: torch.device | str | None) -> torch.Tensor:
    """`full`'s values for what this rank holds of a computed buffer: the same slice of it where a
    parallel plan sharded the buffer (`held` a DTensor: its layout kept), else all of it."""
    if not isinstance(held, DTensor):
        return full.to(device)
    offset, shape = global_box(held)
    part = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))].to(device)
    return DTensor.from_local(part, held.device_mesh, held.placements, run_check=False)


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
    to split and shard before anything is allocated (flopwise.train.build).
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
    plain = getattr(model, "module", model)
    if isinstance(plain, Transformer):
        plain.tie_weights()
    plain.init_weights(seed)  # type: ignore[operator]  # Transformer's method; nn.Module's stub can't know it
