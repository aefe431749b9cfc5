"""`scale sweep` without training: prepared data shared across ladders by content, and what a
one-size sweep says about the size it trains against the size its law asked."""

import json

import pytest

from flopwise.config.schema import load_config
from flopwise.flops import count_params
from flopwise.train.ladder import _ensure_data, plan_ladder, sweep_ladder


@pytest.mark.slow  # prepares a corpus: under a minute on a busy machine
def test_ladders_share_prepared_data_by_content(tmp_path, monkeypatch):
    """Two ladders (two --out) over the same raw corpus and tokenizer prepare it once, in the cache;
    other content is another entry."""
    import flopwise.train.build as build

    monkeypatch.setenv("FLOPWISE_CACHE_DIR", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(f"Document {i}. " + "the quick brown fox jumps over the lazy dog. " * 200)
    prepared = []
    real = build.prepare_data
    monkeypatch.setattr(build, "prepare_data", lambda *a, **k: prepared.append(a[1]) or real(*a, **k))
    base = load_config(None, [f'data.path="{corpus}"', 'data.tokenizer="bpe:300"', "model.vocab_size=300"])
    dirs = []
    for name in ("a", "b"):
        runs = plan_ladder(base, [1e9], sizes=1, spread=1.0, out=tmp_path / name)
        _ensure_data(base, runs, tmp_path / name)
        dirs.append(runs[0].config.data.path)
    assert dirs[0] == dirs[1] and dirs[0].startswith(str(tmp_path / "cache")) and len(prepared) == 1
    (corpus / "doc0.txt").write_text("changed text. " * 300)
    assert plan_ladder(base, [1e9], sizes=1, spread=1.0, out=tmp_path / "c")[0].config.data.path != dirs[0]


def test_a_sweep_says_what_it_trains_against_what_the_law_asked(tmp_path):
    """A one-size sweep under a fitted law: its prediction for the run before training, and a line
    when the nearest shape is not the size the law asked (Hoffmann eq. 4 gives that size here)."""
    law = tmp_path / "law.json"  # a ladder's fit: N without embeddings
    law.write_text(json.dumps({"E": 2.0, "A": 30.0, "B": 3000.0, "alpha": 0.4, "beta": 0.5, "embeddings": False}))
    base = load_config(None, ['data.tokenizer="bpe:512"', "model.vocab_size=512", "data.seq_len=128"])
    for budget in ("1e12", "2.2e12"):
        lines: list[str] = []
        out = tmp_path / budget
        sweep_ladder(base, budget, 1, 1.0, f"fitted:{law}", out, emit=True, note=lines.append)
        g = (0.4 * 30.0 / (0.5 * 3000.0)) ** (1 / 0.9)
        n_opt = g * (float(budget) / 6) ** (0.5 / 0.9)
        cfg = load_config(str(next((out / "configs").iterdir())))
        n = count_params(cfg.model).non_embedding
        asks = [ln for ln in lines if "asks N" in ln]
        assert bool(asks) == (abs(n / n_opt - 1) > 0.1), (n, n_opt, lines)
        assert not asks or f"trains {n:,} non-embedding parameters" in asks[0]
        assert [ln for ln in lines if "predicts loss" in ln and "before training" in ln]


def test_cpu_tiny_puts_its_laws_optimum_between_two_sizes_at_every_budget(tmp_path):
    """The preset is chosen so every budget can be bracketed: the optimum its law predicts (Hoffmann
    eq. 4 on the cpu-tiny constants, worked out here by hand) has a trained size on either side."""
    from flopwise.train.ladder import ladder_preset

    p = ladder_preset("cpu-tiny")
    base = load_config(None, [*p.overrides, f'data.path="{tmp_path}"'])
    (tmp_path / "index.json").write_text("{}")  # a prepared folder: nothing to hash or prepare
    runs = plan_ladder(base, [1e12, 2e12, 4e12], p.sizes, p.spread, p.law, tmp_path / "out")
    g = (0.23 * 6.63 / (0.52 * 841)) ** (1 / 0.75)
    for budget in (1e12, 2e12, 4e12):
        n_opt = g * (budget / 6) ** (0.52 / 0.75)
        sizes = sorted(r.params for r in runs if r.budget == budget)
        assert sizes[0] < n_opt < sizes[-1] and len(sizes) >= 4, (budget, n_opt, sizes)
