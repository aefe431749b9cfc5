import math

import pytest
import torch

from flopwise.config.schema import ModelConfig, RopeScaling
from flopwise.eval.generate import generate_tokens
from flopwise.model.layers import KVCache, Span, alibi_slopes, rope_frequencies
from flopwise.model.transformer import build_model

FAMILIES = {
    "gpt2": dict(arch="gpt2"),
    "opt": dict(arch="opt"),
    "neox": dict(arch="neox"),
    "bloom": dict(arch="bloom"),
    "llama-gqa": dict(arch="llama", n_kv_heads=2),
    "llama3-scaled": dict(
        arch="llama", rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8)
    ),
    "mistral": dict(arch="mistral", n_kv_heads=2, sliding_window=5),
    "qwen3": dict(arch="qwen3", n_kv_heads=2, head_dim=16),
    "palm-mqa": dict(arch="palm", n_kv_heads=1),
    "gopher": dict(arch="gopher"),
}


def tiny(**kw) -> ModelConfig:
    base = dict(n_layers=2, d_model=32, n_heads=4, vocab_size=97, max_seq_len=24)
    return ModelConfig(**{**base, **kw})


@pytest.fixture(params=list(FAMILIES), ids=list(FAMILIES))
def family_model(request):
    torch.manual_seed(0)
    return build_model(tiny(**FAMILIES[request.param]), "cpu", seed=0).eval()


def test_causal(family_model):
    x = torch.randint(0, 97, (2, 20))
    y = x.clone()
    y[:, 12] = (y[:, 12] + 1) % 97
    with torch.no_grad():
        a, b = family_model(x), family_model(y)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:], atol=1e-4)


def test_kv_cache_matches_full_forward(family_model):
    m = family_model.cfg
    x = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        full = family_model(x)
        cache = KVCache(m, 2, 20, "cpu", torch.float32)
        parts = [family_model(x[:, :7], cache)] + [family_model(x[:, t : t + 1], cache) for t in range(7, 20)]
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)


def test_requests_prefilled_alone_decode_together_as_the_full_forward(family_model):
    """KVCache.join (how `plan serve --measure` batches requests): two prompts prefilled one at a
    time, then decoded as one batch, give each sequence's own whole-sequence logits; and
    `last_only` is the last position of those."""
    m = family_model.cfg
    x = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        full = family_model(x)
        caches = [KVCache(m, 1, 20, "cpu", torch.float32) for _ in range(2)]
        prefill = [family_model(x[i : i + 1, :7], caches[i], last_only=True) for i in range(2)]
        cache = KVCache.join(caches)
        steps = [family_model(x[:, t : t + 1], cache) for t in range(7, 20)]
    assert torch.allclose(torch.cat(prefill), full[:, 6:7], atol=1e-5)
    assert torch.allclose(torch.cat(steps, dim=1), full[:, 7:], atol=1e-5)


def test_caches_at_different_positions_do_not_join():
    m = tiny()
    a, b = KVCache(m, 1, 8, "cpu", torch.float32), KVCache(m, 1, 8, "cpu", torch.float32)
    b.pos = 3
    with pytest.raises(ValueError, match="different positions"):
        KVCache.join([a, b])


def test_the_default_span_is_the_whole_sequence(family_model):
    """`model(tokens)` needs nothing else: it is the call with the whole sequence's span."""
    x = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        assert torch.equal(family_model(x), family_model(x, span=Span.after(0, 20)))
    with pytest.raises(ValueError, match="max_seq_len"):
        family_model(x, span=Span(torch.arange(20, 40), torch.arange(40)))


def test_greedy_generation_with_cache_equals_recomputation(family_model):
    prompt = [3, 14, 15, 9, 2]
    a = generate_tokens(family_model, prompt, 15, temperature=0.0, use_cache=True)
    b = generate_tokens(family_model, prompt, 15, temperature=0.0, use_cache=False)
    assert a == b and len(a) == 15


def test_sampling_is_seeded(family_model):
    a = generate_tokens(family_model, [1, 2, 3], 10, temperature=1.0, top_k=20, top_p=0.9, seed=7)
    b = generate_tokens(family_model, [1, 2, 3], 10, temperature=1.0, top_k=20, top_p=0.9, seed=7)
    assert a == b


def test_sliding_window_receptive_field():
    """One layer, window 5: position i sees tokens i-4..i only."""
    model = build_model(tiny(arch="mistral", n_layers=1, sliding_window=5), "cpu", seed=0).eval()
    x = torch.randint(0, 97, (1, 16))
    y = x.clone()
    y[0, 3] = (y[0, 3] + 1) % 97
    with torch.no_grad():
        diff = (model(x) - model(y)).abs().amax(-1)[0]
    assert (diff[3:8] > 1e-5).all() and (diff[8:] < 1e-6).all() and (diff[:3] < 1e-6).all()


def test_alibi_slopes_and_rope_scaling():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    assert len(alibi_slopes(12)) == 12 and alibi_slopes(12)[8] == pytest.approx(2**-0.5)
    plain = rope_frequencies(128, 500000.0, None)
    scaled = rope_frequencies(
        128, 500000.0, RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
    )
    wavelen = 2 * math.pi / plain
    assert torch.equal(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])  # high frequencies kept
    assert torch.allclose(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)  # low frequencies stretched 8×


def test_partial_rotary_leaves_the_rest_unrotated():
    m = tiny(arch="neox")
    assert m.rotary_dim == 2  # 25% of head_dim 8
    model = build_model(m, "cpu", seed=0)
    assert model.rope_cos.shape[-1] == 2


def test_initialisation_scales():
    m = tiny(arch="llama", n_layers=8, d_model=256, n_heads=4, vocab_size=1000)
    model = build_model(m, "cpu", seed=0)
    assert model.layers["0"].feed_forward.w1.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.layers["0"].attention.wo.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones(256))


def test_init_is_seeded():
    a = build_model(tiny(), "cpu", seed=3)
    b = build_model(tiny(), "cpu", seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_too_long_sequence_is_rejected():
    model = build_model(tiny(), "cpu", seed=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 25, dtype=torch.long))
