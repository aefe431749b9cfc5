import json
import subprocess
import sys

import pytest

from flopwise.config.presets import PRESETS
from flopwise.config.schema import ModelConfig
from flopwise.flops import count_params

PUBLISHED = [n for n, p in PRESETS.items() if p.published]


@pytest.mark.parametrize("name", PUBLISHED)
def test_param_count_matches_published(name):
    pub = PRESETS[name].published
    c = count_params(ModelConfig(preset=name))
    assert abs(c.total / pub.params - 1) <= pub.rel_tol, (c.total, pub.params, pub.source)
    if pub.non_embedding:
        assert abs(c.non_embedding / pub.non_embedding - 1) <= pub.non_embedding_rel_tol


def test_required_presets_exist():
    required = [
        "gpt2-124m",
        "gpt2-355m",
        "gpt2-774m",
        "gpt2-1.5b",
        "gpt3-125m",
        "gpt3-175b",
        "opt-175b",
        "gpt-neox-20b",
        "bloom-176b",
        "gopher-280b",
        "chinchilla-70b",
        "palm-8b",
        "palm-62b",
        "palm-540b",
        "llama-7b",
        "llama-13b",
        "llama-33b",
        "llama-65b",
        "llama2-7b",
        "llama2-13b",
        "llama2-70b",
        "llama3-8b",
        "llama3-70b",
        "llama3-405b",
        "mistral-7b",
        "qwen3-0.6b",
        "qwen3-1.7b",
        "qwen3-4b",
        "qwen3-8b",
        "qwen3-14b",
        "qwen3-32b",
        "mt-nlg-530b",
        "demo-tiny",
    ]
    assert not set(required) - set(PRESETS)
    assert len([n for n in PRESETS if n.startswith("gpt3-")]) == 8
    exact = [n for n in PUBLISHED if PRESETS[n].published.rel_tol < 1e-6]
    assert len(exact) >= 15  # checkpoints define these counts exactly


@pytest.mark.parametrize(
    "name",
    [
        "llama3-405b",
        "palm-540b",
        "gopher-280b",
        "bloom-176b",
        "gpt-neox-20b",
        "opt-175b",
        "qwen3-32b",
        "mistral-7b",
        "gpt2-124m",
    ],
)
def test_module_on_meta_has_the_counted_parameters(name):
    """The nn.Module built on the meta device (no memory) has exactly the analytic count."""
    from flopwise.model.transformer import build_model

    m = ModelConfig(preset=name)
    model = build_model(m, "meta")
    assert sum(p.numel() for p in model.parameters()) == count_params(m).total
    assert all(p.is_meta for p in model.parameters())


def test_presets_json_cli():
    r = subprocess.run(
        [sys.executable, "-m", "flopwise", "presets", "--json"], capture_output=True, text=True, check=True
    )
    rows = json.loads(r.stdout)
    keys = {
        "name",
        "arch",
        "params",
        "non_embedding_params",
        "n_layers",
        "d_model",
        "n_heads",
        "n_kv_heads",
        "ffn_dim",
        "vocab_size",
    }
    assert all(set(r) == keys for r in rows)
    by = {r["name"]: r for r in rows}
    assert by["llama3-8b"]["params"] == 8_030_261_248 and by["llama3-8b"]["n_kv_heads"] == 8
