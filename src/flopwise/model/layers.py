"""Building blocks of the dense decoder: norms, positions, attention, MLP, KV cache.

Module names follow torchtitan (attention.wq/wk/wv/wo, feed_forward.w1/w2/w3, attention_norm,
ffn_norm) so the parallel plans and checkpoint keys stay stable across features.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flopwise.config.schema import ModelConfig, RopeScaling


def make_norm(m: ModelConfig, dim: int) -> nn.Module:
    if m.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=m.norm_eps)
    return nn.LayerNorm(dim, eps=m.norm_eps, bias=m.bias)


# --- positions ------------------------------------------------------------------------------


def rope_frequencies(rotary_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies, with Llama-3's wavelength-dependent scaling when configured."""
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    if scaling is None:
        return inv.float()
    wavelen = 2 * math.pi / inv
    low_wl = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wl = scaling.original_max_seq_len / scaling.high_freq_factor
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    mid = (1 - smooth) * inv / scaling.factor + smooth * inv
    out = torch.where(wavelen > low_wl, inv / scaling.factor, torch.where(wavelen < high_wl, inv, mid))
    return out.float()


def rope_cos_sin(m: ModelConfig, n_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = rope_frequencies(m.rotary_dim, m.rope_theta, m.rope_scaling)
    angles = torch.outer(torch.arange(n_positions, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)  # rotate-half layout (GPT-NeoX / HF Llama)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, h, t, d). Rotates the first cos.shape[-1] dims (partial rotary), keeps the rest."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    x1, x2 = xr.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = (xr.float() * cos + rotated.float() * sin).to(x.dtype)
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Press et al. 2022: geometric slopes 2^(-8i/n); for non powers of two, interleave the next."""

    def pow2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = pow2(closest)
    if closest < n_heads:
        slopes += pow2(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def _sinusoids(n: int, dim: int) -> torch.Tensor:
    """Transformer-XL relative-distance embeddings for distances 0..n-1."""
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ang = torch.outer(torch.arange(n, dtype=torch.float32), inv)
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


# --- attention ------------------------------------------------------------------------------


@dataclass(eq=False)
class Span:
    """Which positions of the sequence one forward computes, and which keys they attend to: data
    the model is handed, made once per batch by whoever splits the sequence (the engine's
    context-parallel sharder, flopwise.parallel.context) or caches it (`Span.after` a KV cache's
    tokens). Without one the model computes its input as a whole sequence from position 0."""

    q_pos: torch.Tensor  # (t,) absolute positions of this forward's tokens (the queries)
    k_pos: torch.Tensor  # (k,) absolute positions of the keys they attend to, in the keys' order
    gather_kv: Callable[[torch.Tensor], torch.Tensor] | None = None  # local K or V -> the keys' (context parallel)
    whole: bool = False  # the queries are the keys, positions 0..t-1: plain causal attention

    @classmethod
    def after(cls, start: int, t: int, device: torch.device | str | None = None) -> Span:
        """`t` new tokens after `start` cached ones (start 0: a whole sequence)."""
        return cls(
            torch.arange(start, start + t, device=device), torch.arange(0, start + t, device=device), whole=start == 0
        )

    @property
    def length(self) -> int:
        """Tokens of the sequence up to the last key (what max_seq_len bounds)."""
        return self.k_pos.shape[0]


@dataclass
class AttnContext:
    """Per-forward facts shared by every layer: the span, rope tables, the mask."""

    span: Span
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    mask: torch.Tensor | None  # bool (t, k) / (b, 1, t, k), or float (h, t, k) / (b, h, t, k); None with is_causal
    is_causal: bool
    pos_ids: torch.Tensor  # (t,) or (b, t): the positions RoPE and learned embeddings see


class KVCache:
    """Preallocated keys/values per layer for incremental decoding."""

    def __init__(self, m: ModelConfig, batch: int, max_len: int, device, dtype):
        shape = (batch, m.n_kv_heads, max_len, m.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(m.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(m.n_layers)]
        self.pos = 0
        self.max_len = max_len

    @classmethod
    def join(cls, caches: list[KVCache]) -> KVCache:
        """One cache of the requests of `caches` (each prefilled alone, all at the same position), to
        decode them together as one batch: how a serving engine admits prefilled requests."""
        if len({c.pos for c in caches}) != 1:
            raise ValueError("caches at different positions cannot be decoded as one batch")
        out = cls.__new__(cls)
        out.k = [torch.cat(layer) for layer in zip(*(c.k for c in caches), strict=True)]
        out.v = [torch.cat(layer) for layer in zip(*(c.v for c in caches), strict=True)]
        out.pos, out.max_len = caches[0].pos, min(c.max_len for c in caches)
        return out

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.pos + k.shape[2]
        self.k[layer][:, :, self.pos : end] = k
        self.v[layer][:, :, self.pos : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class CoreAttention(nn.Module):
    """softmax(QKᵀ/√d + mask)·V via SDPA. A module of its own so selective recompute can wrap it.
    Grouped-query K/V go in at their own width (SDPA's `enable_gqa`): no expanded copies, and
    autograd saves them at n_kv_heads, not n_heads.

    On CPU the core runs in fp32 even under bf16 autocast: torch's CPU flash kernel is up to 2.7×
    slower in bf16 than in fp32 at small head dims (forward + backward, head_dim 32: 11.1 vs 4.1 ms;
    never faster at head_dim 64; benchmarks/throughput/train_cpu.md), and fp32 is the more exact of the two."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        gqa = q.shape[1] != k.shape[1]
        if q.device.type == "cpu" and q.dtype != torch.float32:
            with torch.autocast("cpu", enabled=False):
                y = F.scaled_dot_product_attention(
                    q.float(), k.float(), v.float(), attn_mask=mask, dropout_p=p, is_causal=is_causal, enable_gqa=gqa
                )
            return y.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal, enable_gqa=gqa)


class Attention(nn.Module):
    distances: torch.Tensor  # a buffer (relative positions only)

    def __init__(self, m: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = m.head_dim
        hq, hkv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
        self.wq = nn.Linear(m.d_model, hq, bias=m.bias or m.qkv_bias)
        self.wk = nn.Linear(m.d_model, hkv, bias=m.bias or m.qkv_bias)
        self.wv = nn.Linear(m.d_model, hkv, bias=m.bias or m.qkv_bias)
        self.wo = nn.Linear(hq, m.d_model, bias=m.bias)
        self.q_norm = nn.RMSNorm(m.head_dim, eps=m.norm_eps) if m.qk_norm else None
        self.k_norm = nn.RMSNorm(m.head_dim, eps=m.norm_eps) if m.qk_norm else None
        self.relative = m.pos == "relative"
        if self.relative:  # Dai et al. 2019: W_R projects distance embeddings; u, v are global biases
            self.pos_proj = nn.Linear(m.d_model, hq, bias=False)
            self.pos_bias_u = nn.Parameter(torch.zeros(m.n_heads, m.head_dim))
            self.pos_bias_v = nn.Parameter(torch.zeros(m.n_heads, m.head_dim))
        self.max_seq_len, self.d_model = m.max_seq_len, m.d_model
        self.reset_buffers()
        self.core = CoreAttention(m.dropout)

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        if self.relative:
            self.register_buffer("distances", _sinusoids(self.max_seq_len, self.d_model).to(device), persistent=False)

    def forward(self, x: torch.Tensor, ctx: AttnContext, cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if ctx.cos is not None and ctx.sin is not None:
            q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        if ctx.span.gather_kv is not None:
            k, v = ctx.span.gather_kv(k), ctx.span.gather_kv(v)
        mask, is_causal = ctx.mask, ctx.is_causal
        if self.relative:
            q, mask, is_causal = self._relative(q, ctx)
        y = self.core(q, k, v, mask, is_causal)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))

    def _relative(self, q: torch.Tensor, ctx: AttnContext):
        """Fold Transformer-XL's position terms into SDPA: content bias u into q, the rest into a mask.

        score(i, j) = (q_i + u)·k_j + (q_i + v)·W_R r_{i-j}, all over √d.
        """
        q_pos, k_pos = ctx.span.q_pos, ctx.span.k_pos
        dist = (q_pos[:, None] - k_pos[None, :]).clamp(min=0)  # (t, k)
        r = self.pos_proj(self.distances[: int(dist.max()) + 1].to(q.dtype))  # (n, hq)
        r = r.view(r.shape[0], -1, self.head_dim)  # (n, h, d)
        pos = torch.einsum("bhtd,nhd->bhtn", q + self.pos_bias_v[None, :, None, :].to(q.dtype), r)
        pos = pos.gather(-1, dist.expand(*pos.shape[:2], *dist.shape)) / math.sqrt(self.head_dim)
        causal = k_pos[None, :] <= q_pos[:, None]
        if ctx.mask is not None and ctx.mask.dtype == torch.bool:
            causal = causal & ctx.mask
        mask = pos.masked_fill(~causal, float("-inf"))
        return q + self.pos_bias_u[None, :, None, :].to(q.dtype), mask, False


class _FeedForward(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.kind = m.mlp
        self.w1 = nn.Linear(m.d_model, m.ffn_dim, bias=m.bias)
        self.w2 = nn.Linear(m.ffn_dim, m.d_model, bias=m.bias)
        self.w3 = nn.Linear(m.d_model, m.ffn_dim, bias=m.bias) if m.mlp == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:  # swiglu
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        if self.kind == "relu":
            return self.w2(F.relu(self.w1(x)))
        return self.w2(F.gelu(self.w1(x), approximate="tanh" if self.kind == "gelu_tanh" else "none"))


class Block(nn.Module):
    """Pre-norm residual block; `parallel_block` sums attention and MLP of the same input
    (GPT-J / NeoX / PaLM), each with its own norm."""

    def __init__(self, m: ModelConfig, layer_idx: int):
        super().__init__()
        self.parallel = m.parallel_block
        self.attention_norm = make_norm(m, m.d_model)
        self.attention = Attention(m, layer_idx)
        self.ffn_norm = make_norm(m, m.d_model)
        self.feed_forward = _FeedForward(m)
        self.dropout = nn.Dropout(m.dropout)

    def forward(self, x: torch.Tensor, ctx: AttnContext, cache: KVCache | None = None) -> torch.Tensor:
        a = self.dropout(self.attention(self.attention_norm(x), ctx, cache))
        if self.parallel:
            return x + a + self.dropout(self.feed_forward(self.ffn_norm(x)))
        h = x + a
        return h + self.dropout(self.feed_forward(self.ffn_norm(h)))
