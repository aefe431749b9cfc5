"""THE parameter and FLOP convention, used by the trainer's MFU, the planner and the auditor.

Pure Python. Conventions (stated in every output that uses them):
- A multiply-accumulate is 2 FLOPs. Training = forward + backward = 3× forward.
- Matmul FLOPs count every weight matrix a token passes through, the output head included (tied or
  not); embedding lookups, norms, biases and softmax are not counted (PaLM App. B; Narayanan et al.
  2021 eq. 3; Korthikanti et al. 2022 eq. 7 count the same things).
- Attention scores (QKᵀ and AV) cost 2·2·s·h_q·d_head FLOPs per token per layer in the forward
  over the full context s, not halved for causality: PaLM's 6N + 12·L·H·Q·T convention. A sliding
  window w caps s at w; Transformer-XL relative positions add one more score matmul.
- MFU counts model FLOPs only (no recompute); HFU adds what activation recomputation reruns:
  full recompute reruns every layer's forward (Narayanan's 96·B·s·l·h² form), selective recompute
  reruns the attention-score forward. Korthikanti eq. 8 books selective recompute at 3× that; we
  count what is executed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from flopwise.config.presets import PRESETS
from flopwise.config.schema import ModelConfig

Recompute = Literal["none", "selective", "full"]


@dataclass(frozen=True)
class ParamCount:
    total: int
    embedding: int  # token (+ learned position) embeddings, and the output head when untied
    layer_matmul: int  # weight-matrix entries inside the blocks (per model, all layers)
    head_matmul: int  # output head entries (counted for FLOPs whether tied or not)
    per_layer: int = 0  # every parameter of one block
    embed_side: int = 0  # what sits before the first block: token (+ position) table, embedding norm
    head_side: int = 0  # what sits after the last block: final norm, and the head matrix when untied

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def _norm(m: ModelConfig, dim: int) -> int:
    return dim * (2 if (m.norm == "layernorm" and m.bias) else 1)


def count_params(m: ModelConfig) -> ParamCount:
    """Exact parameter count of the model `flopwise.model.Transformer(m)` builds (tested)."""
    d, hq, hkv, f = m.d_model, m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim, m.ffn_dim
    n_ffn_in = 2 if m.mlp == "swiglu" else 1
    attn_mm = d * hq + 2 * d * hkv + hq * d + (d * hq if m.pos == "relative" else 0)
    mlp_mm = n_ffn_in * d * f + f * d
    layer_mm = attn_mm + mlp_mm
    layer_other = 2 * _norm(m, d)
    if m.bias:
        layer_other += hq + 2 * hkv + d + n_ffn_in * f + d
    elif m.qkv_bias:
        layer_other += hq + 2 * hkv
    if m.qk_norm:
        layer_other += 2 * m.head_dim
    if m.pos == "relative":
        layer_other += 2 * hq  # Transformer-XL's u and v content/position biases
    tok = m.vocab_size * d
    pos = (m.max_seq_len + m.pos_offset) * d if m.pos == "learned" else 0
    head = 0 if m.tie_embeddings else m.vocab_size * d
    other = _norm(m, d) + (_norm(m, d) if m.embed_norm else 0)
    total = tok + pos + head + other + m.n_layers * (layer_mm + layer_other)
    final_norm = _norm(m, d)
    return ParamCount(
        total=total,
        embedding=tok + pos + head,
        layer_matmul=m.n_layers * layer_mm,
        head_matmul=m.vocab_size * d,
        per_layer=layer_mm + layer_other,
        embed_side=tok + pos + other - final_norm,
        head_side=final_norm + head,
    )


def param_shapes(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of `flopwise.model.Transformer(m)` as (name, shape), in the module's
    registration order (the order optimizers and ZeRO-1's partition see them; tested against the
    module). A tied head is the embedding's parameter, listed once."""
    d, hq, hkv, f = m.d_model, m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim, m.ffn_dim

    def linear(name: str, n_in: int, n_out: int, bias: bool = m.bias) -> list:
        return [(f"{name}.weight", (n_out, n_in))] + ([(f"{name}.bias", (n_out,))] if bias else [])

    def norm(name: str) -> list:
        return [(f"{name}.weight", (d,))] + ([(f"{name}.bias", (d,))] if m.norm == "layernorm" and m.bias else [])

    out: list[tuple[str, tuple[int, ...]]] = [("tok_embeddings.weight", (m.vocab_size, d))]
    if m.pos == "learned":
        out.append(("pos_embeddings.weight", (m.max_seq_len + m.pos_offset, d)))
    if m.embed_norm:
        out += norm("embed_norm")
    for i in range(m.n_layers):
        p = f"layers.{i}."
        out += norm(p + "attention_norm")
        if m.pos == "relative":  # a module's own parameters come before its submodules'
            out += [
                (p + "attention.pos_bias_u", (m.n_heads, m.head_dim)),
                (p + "attention.pos_bias_v", (m.n_heads, m.head_dim)),
            ]
        qkv = m.bias or m.qkv_bias
        out += (
            linear(p + "attention.wq", d, hq, qkv)
            + linear(p + "attention.wk", d, hkv, qkv)
            + linear(p + "attention.wv", d, hkv, qkv)
        )
        out += linear(p + "attention.wo", hq, d)
        if m.qk_norm:
            out += [(p + "attention.q_norm.weight", (m.head_dim,)), (p + "attention.k_norm.weight", (m.head_dim,))]
        if m.pos == "relative":
            out.append((p + "attention.pos_proj.weight", (hq, d)))
        out += norm(p + "ffn_norm")
        out += linear(p + "feed_forward.w1", d, f) + linear(p + "feed_forward.w2", f, d)
        if m.mlp == "swiglu":
            out += linear(p + "feed_forward.w3", d, f)
    out += norm("norm")
    if not m.tie_embeddings:
        out.append(("output.weight", (m.vocab_size, d)))
    return out


def scaling_flops(params, tokens):
    """Training compute as scaling laws count it, C = 6·N·D (Kaplan et al. 2020 §2.1, Hoffmann et al.
    2022): the law's own N, no attention term. Numbers or numpy arrays."""
    return 6 * params * tokens


def scaling_tokens(flops, params):
    """The D of C = 6·N·D: tokens a compute budget buys at N parameters."""
    return flops / (6 * params)


def attention_flops_per_token(m: ModelConfig, seq_len: int) -> int:
    """Forward FLOPs of the attention scores per token, all layers."""
    context = min(seq_len, m.sliding_window) if m.sliding_window else seq_len
    score_matmuls = 3 if m.pos == "relative" else 2
    return m.n_layers * 2 * score_matmuls * context * m.n_heads * m.head_dim


def forward_flops_per_token(m: ModelConfig, context: int) -> int:
    """Forward FLOPs of one token over `context` positions: 2 per weight entry it passes through
    (the head included) plus the attention scores; a third of training's, and what inference runs."""
    p = count_params(m)
    return 2 * (p.layer_matmul + p.head_matmul) + attention_flops_per_token(m, context)


def flops_per_token(m: ModelConfig, seq_len: int, recompute: Recompute = "none") -> int:
    """Training FLOPs per token (forward + backward), plus the recomputed forward work if asked.

    recompute="none" gives model FLOPs (the MFU numerator); other values give hardware FLOPs.
    """
    p = count_params(m)
    attn = attention_flops_per_token(m, seq_len)
    model = 3 * forward_flops_per_token(m, seq_len)
    if recompute == "full":
        return model + 2 * p.layer_matmul + attn
    if recompute == "selective":
        return model + attn
    return model


def flops_per_step(m: ModelConfig, seq_len: int, global_batch: int, recompute: Recompute = "none") -> int:
    return flops_per_token(m, seq_len, recompute) * seq_len * global_batch


def mfu(tokens_per_s: float, flops_per_token_: float, peak_flops: float, devices: int = 1) -> float:
    """THE utilisation: achieved FLOP/s (tokens/s × FLOPs per token) over the dense peak of the
    `devices` in use (`peak_flops` per device). Model FLOPs per token give MFU; FLOPs with
    recompute give HFU. The trainer, the planner and the auditor all call this."""
    return tokens_per_s * flops_per_token_ / (devices * peak_flops)


def preset_table() -> list[dict[str, Any]]:
    """Every built-in preset's architecture, shape and parameter counts, as `flopwise presets` lists them."""
    rows = []
    for name in PRESETS:
        m = ModelConfig(preset=name)
        c = count_params(m)
        rows.append(
            {
                "name": name,
                "arch": m.arch,
                "params": c.total,
                "non_embedding_params": c.non_embedding,
                "n_layers": m.n_layers,
                "d_model": m.d_model,
                "n_heads": m.n_heads,
                "n_kv_heads": m.n_kv_heads,
                "ffn_dim": m.ffn_dim,
                "vocab_size": m.vocab_size,
            }
        )
    return rows
