"""Weighted data mixtures: the batches' make-up against the binomial law, the loader against
`flopwise data mix`, resume, metrics, and the refusals."""

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from flopwise.cli import app
from flopwise.config.schema import load_config
from flopwise.data.loader import TokenLoader
from flopwise.data.prepare import prepare_data
from flopwise.errors import DataError
from flopwise.train.build import ensure_data
from flopwise.train.launch import train
from tests.conftest import tiny_overrides


def sources_of(tmp_path, tiny_data, tiny_mix):
    cfg = load_config(None, tiny_overrides(tmp_path, tiny_data, **{"data.sources": tiny_mix}))
    return cfg, ensure_data(cfg, tmp_path)


def window_owner(sources, seq_len):
    """Every window's bytes -> the source it came from, read straight from the shard files."""
    owner = {}
    for s in sources:
        meta = json.loads((s.data_dir / "index.json").read_text())
        tokens = np.concatenate(
            [np.fromfile(s.data_dir / f["file"], dtype=meta["dtype"]) for f in meta["splits"]["train"]["files"]]
        ).astype(np.int64)
        for i in range((len(tokens) - 1) // seq_len):
            owner.setdefault(tokens[i * seq_len : (i + 1) * seq_len + 1].tobytes(), set()).add(s.name)
    return owner


@pytest.mark.slow
def test_source_shares_are_the_weights_within_binomial_error(tmp_path, tiny_data, tiny_mix):
    """10k global batches of 8: the share of sequences read from each source is its weight within
    4 binomial standard deviations; every sequence is a window of the source it is counted for."""
    _, sources = sources_of(tmp_path, tiny_data, tiny_mix)
    loader = TokenLoader(sources, "train", 32, 8, seed=3)
    owner = window_owner(sources, 32)
    counts = {"alice": 0, "plays": 0}
    for _ in range(10_000):
        for row in loader.next_batch().numpy():
            [name] = owner[row.tobytes()]  # the two texts share no 33-token window
            counts[name] += 1
    n = sum(counts.values())
    for name, w in (("alice", 0.7), ("plays", 0.3)):
        assert abs(counts[name] / n - w) < 4 * math.sqrt(w * (1 - w) / n), counts
    assert loader.tokens_by_source() == {k: v * 32 for k, v in counts.items()}


def test_data_mix_predicts_the_loaders_epochs(tmp_path, tiny_data, tiny_mix):
    """`flopwise data mix --json` for T tokens against a loader that has drawn T tokens."""
    cfg, sources = sources_of(tmp_path, tiny_data, tiny_mix)
    loader = TokenLoader(sources, "train", 32, 8, seed=0)
    loader.skip(2000)
    tokens = 2000 * 8 * 32
    r = CliRunner().invoke(
        app,
        [
            "data",
            "mix",
            *tiny_overrides(tmp_path, tiny_data, **{"data.sources": tiny_mix}),
            "--tokens",
            str(tokens),
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = {x["name"]: x for x in json.loads(r.stdout)}
    for s in sources:
        meta = json.loads((s.data_dir / "index.json").read_text())
        assert rows[s.name]["unique_tokens"] == meta["splits"]["train"]["tokens"]
        assert rows[s.name]["epochs"] == pytest.approx(loader.epochs_by_source()[s.name], rel=0.05)
    # windows are seq_len + 1 tokens from a stream cut every seq_len: one epoch is n_windows · seq_len
    loud = CliRunner().invoke(
        app,
        [
            "data",
            "mix",
            *tiny_overrides(tmp_path, tiny_data, **{"data.sources": tiny_mix}),
            "--tokens",
            str(tokens * 5),
        ],
    )
    assert loud.exit_code == 0 and "warning" in loud.output and "'plays'" in loud.output


@pytest.mark.slow
def test_mixture_run_resumes_bitwise_and_logs_tokens_by_source(tmp_path, tiny_data, tiny_mix):
    kw = {"data.sources": tiny_mix, "train.steps": 6, "checkpoint.interval": 3}
    full = train(load_config(None, tiny_overrides(tmp_path / "full", tiny_data, **kw)))
    train(load_config(None, tiny_overrides(tmp_path / "cut", tiny_data, **kw, **{"train.stop_after": 3})))
    rest = train(load_config(None, tiny_overrides(tmp_path / "cut", tiny_data, **kw)))
    assert rest.losses == full.losses[3:]  # bitwise: same batches, same state
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert all("tokens_by_source" in r for r in rows)
    steps = [r for r in rows if "loss" in r]
    assert [sum(r["tokens_by_source"].values()) for r in steps] == [r["tokens"] for r in steps]
    evals = [r for r in rows if "val_loss" in r]
    assert evals and set(evals[-1]["val_loss_by_source"]) == {"alice", "plays"}
    by = evals[-1]["val_loss_by_source"]
    assert evals[-1]["val_loss"] == pytest.approx(0.7 * by["alice"] + 0.3 * by["plays"])


def test_sources_with_different_tokenizers_are_refused(tmp_path, tiny_data):
    other = tmp_path / "other"
    prepare_data(["builtin:alice"], other, tokenizer="bpe:300")
    mix = f'[{{path="{tiny_data}", name="a"}}, {{path="{other}", name="b"}}]'
    cfg = load_config(None, tiny_overrides(tmp_path, tiny_data, **{"data.sources": mix}))
    with pytest.raises(DataError, match="'b'.*tokenized differently.*same --tokenizer"):
        ensure_data(cfg, tmp_path)


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_source_tokenizer_outside_its_folder_is_refused_before_any_read(tmp_path, monkeypatch, where):
    """A prepared source whose index.json names its tokenizer `../x.json` or by an absolute path:
    before, build joined the name onto the folder, read that file and copied it into the run (the
    next raw source was prepared with it) and only then refused; after, the member check every
    other index field gets refuses it first, one line, and nothing is prepared or copied."""
    import flopwise.train.build as build

    text = tmp_path / "text"
    text.mkdir()
    for i in range(4):
        (text / f"part_{i}.txt").write_text(f"Document {i}: the quick brown fox jumps over the lazy dog. " * 20)
    first = tmp_path / "first"
    prepare_data([str(text)], first, tokenizer="bpe:300", val_fraction=0.25, seed=0)
    outside = tmp_path / "x.json"
    (first / "tokenizer.json").rename(outside)
    index = json.loads((first / "index.json").read_text())
    index["tokenizer"] = "../x.json" if where == "relative" else str(outside)
    (first / "index.json").write_text(json.dumps(index))

    def prepare_spy(inputs, out, tokenizer, **kw):  # would read and copy `tokenizer` into the run
        raise AssertionError(f"source prepared into {out} with tokenizer {tokenizer}")

    monkeypatch.setattr(build, "prepare_data", prepare_spy)
    run_dir = tmp_path / "run"
    mix = f'[{{path="{first}", name="a"}}, {{path="{text}", name="b"}}]'
    cfg = load_config(None, tiny_overrides(run_dir, first, **{"data.sources": mix}))
    with pytest.raises(DataError, match="must be a plain name inside") as e:
        ensure_data(cfg, run_dir)
    assert "\n" not in str(e.value)
    assert not (run_dir / "data-b").exists()


def test_resume_with_other_sources_is_refused(tmp_path, tiny_data, tiny_mix):
    _, sources = sources_of(tmp_path, tiny_data, tiny_mix)
    state = TokenLoader(sources, "train", 32, 8, seed=0).state_dict()
    with pytest.raises(DataError, match="same data.sources"):
        TokenLoader(sources[::-1], "train", 32, 8, seed=0).load_state_dict(state)


def test_duplicate_source_names_are_a_config_error(tmp_path, tiny_data):
    from flopwise.errors import ConfigError

    with pytest.raises(ConfigError, match="data.sources: name 'x' used twice"):
        load_config(
            None,
            tiny_overrides(
                tmp_path,
                tiny_data,
                **{"data.sources": f'[{{path="{tiny_data}", name="x"}}, {{path="{tiny_data}", name="x"}}]'},
            ),
        )


def test_scale_optimal_counts_unique_tokens_of_a_data_dir(tiny_data):
    train_tokens = json.loads((tiny_data / "index.json").read_text())["splits"]["train"]["tokens"]
    args = ["scale", "optimal", "--flops", "1e15", "--json", "--unique-tokens"]
    by_dir = CliRunner().invoke(app, [*args, str(tiny_data)])
    by_number = CliRunner().invoke(app, [*args, str(train_tokens)])
    assert by_dir.exit_code == 0 and json.loads(by_dir.stdout) == json.loads(by_number.stdout)
    assert "epochs over" in by_dir.stdout
