"""The one FLOP convention against the papers' closed forms and published utilisation figures."""

import pytest

from flopwise.config.schema import ModelConfig
from flopwise.flops import attention_flops_per_token, count_params, flops_per_step, flops_per_token, mfu

V, S = 51200, 2048  # Megatron's padded GPT-2 vocabulary and sequence length


def megatron_gpt(layers: int, hidden: int, heads: int) -> ModelConfig:
    return ModelConfig(
        arch="gpt2", n_layers=layers, d_model=hidden, n_heads=heads, vocab_size=V, max_seq_len=S, mlp="gelu"
    )


# Narayanan et al. 2021, Table 1 (four rows): params (B), heads, hidden, layers, global batch.
NARAYANAN = [
    (1.7, 24, 2304, 24, 512),
    (18.4, 48, 6144, 40, 1024),
    (145.6, 96, 12288, 80, 2304),
    (1008.0, 160, 25600, 128, 3072),
]


@pytest.mark.parametrize("params_b, heads, h, l, batch", NARAYANAN)
def test_narayanan_eq3_full_recompute(params_b, heads, h, l, batch):  # noqa: E741 l: the paper's layer count
    """F = 96·B·s·l·h²·(1 + s/6h + V/16lh): GEMM FLOPs per iteration with full recomputation."""
    m = megatron_gpt(l, h, heads)
    expected = 96 * batch * S * l * h**2 * (1 + S / (6 * h) + V / (16 * l * h))
    assert flops_per_step(m, S, batch, recompute="full") == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("params_b, heads, h, l, batch", NARAYANAN)
def test_narayanan_eq2_param_count(params_b, heads, h, l, batch):  # noqa: E741 l: the paper's layer count
    """P = 12·l·h²·(1 + 13/12h + (V+s)/12lh), and the rounded 'Params (B)' column of Table 1."""
    m = megatron_gpt(l, h, heads)
    eq2 = 12 * l * h**2 * (1 + 13 / (12 * h) + (V + S) / (12 * l * h))
    total = count_params(m).total
    assert total - eq2 == pytest.approx(2 * h, abs=1e-3)  # eq. 2 leaves out the final LayerNorm's gain and bias
    assert round(total / 1e9, 1) == params_b


@pytest.mark.parametrize(
    "h, heads, l, gpus, batch, seconds, published_mfu",
    [
        (6144, 64, 48, 8, 4, 1.10, 0.415),  # Korthikanti et al. 2022 Table 5: 22B
        (20480, 128, 105, 280, 280, 37.83, 0.560),  # 530B (MT-NLG shape)
    ],
)
def test_korthikanti_table5_mfu(h, heads, l, gpus, batch, seconds, published_mfu):  # noqa: E741 l: the paper's layer count
    m = megatron_gpt(l, h, heads)
    model_flops = flops_per_step(m, S, batch)
    eq7 = 72 * batch * l * S * h**2 * (1 + S / (6 * h) + V / (12 * h * l))
    assert model_flops == pytest.approx(eq7, rel=1e-12)
    achieved = model_flops / seconds / (gpus * 312e12)
    assert achieved == pytest.approx(published_mfu, abs=0.003)


def test_palm_appendix_b_worked_mfu():
    """PaLM 540B: 6N + 12·L·H·Q·T FLOPs/token, 238.3K tokens/s on 6144 TPU v4 (275 TFLOP/s) = 46.2% MFU."""
    m = ModelConfig(preset="palm-540b")
    fpt = flops_per_token(m, 2048)
    assert fpt == pytest.approx(6 * 540.35e9 + 12 * 118 * 48 * 256 * 2048, rel=2e-5)
    assert mfu(238.3e3, fpt, 6144 * 275e12) == pytest.approx(0.462, abs=0.0005)


def test_recompute_ordering_and_window():
    m = ModelConfig(preset="llama3-8b")
    none, sel, full = (flops_per_token(m, 8192, r) for r in ("none", "selective", "full"))
    assert none < sel < full
    assert sel - none == attention_flops_per_token(m, 8192)
    c = count_params(m)
    assert full - none == 2 * c.layer_matmul + attention_flops_per_token(m, 8192)
    w = ModelConfig(preset="mistral-7b")  # window 4096 caps the attention context
    assert attention_flops_per_token(w, 8192) == attention_flops_per_token(w, 4096)
    # GQA shrinks K/V projections, not the score matmuls (those scale with query heads)
    mha = ModelConfig(preset="llama3-8b", n_kv_heads=32)
    assert attention_flops_per_token(mha, 4096) == attention_flops_per_token(m, 4096)
    assert flops_per_token(mha, 4096) > flops_per_token(m, 4096)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"arch": "gpt2"},
        {"arch": "qwen3", "n_kv_heads": 2},
        {"arch": "gopher", "pos": "relative"},
        {"arch": "bloom"},
        {"arch": "opt"},
        {"arch": "neox"},
        {"tie_embeddings": True},
    ],
    ids=lambda kw: "-".join(f"{v}" for v in kw.values()) or "llama",
)
def test_param_shapes_are_the_modules(kw):
    """The planner's parameter inventory is the built module's, name for name, in order."""
    from flopwise.flops import param_shapes
    from flopwise.model.transformer import build_model

    m = ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, max_seq_len=16, **kw)
    assert param_shapes(m) == [(n, tuple(p.shape)) for n, p in build_model(m, "meta").named_parameters()]
