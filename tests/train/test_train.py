import json
import math
import shutil
import statistics
import sys

import pytest
import torch

from flopwise.checkpoints import checkpoint
from flopwise.config.schema import ModelConfig, OptimConfig, load_config
from flopwise.errors import CheckpointError, ConfigError, DataError
from flopwise.eval.load import load_for_inference
from flopwise.model.transformer import build_model
from flopwise.parallel.apply import apply_recompute
from flopwise.train.engine import lm_loss
from flopwise.train.launch import train
from flopwise.train.optim import lr_at, param_groups
from tests.conftest import tiny_overrides


def run(tmp, data, **kw):
    return train(load_config(None, tiny_overrides(tmp, data, **kw)))


def metric_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run_bitwise(tiny_data, tiny_run, tmp_path):
    """2k steps straight == k steps, stop, resume for k more (fp32, CPU): same losses, same weights.
    Straight: tiny_run(8) (its checkpoints at 3 and 6, not 4, change nothing), its losses as logged."""
    full = tiny_run(8)
    losses = [r["loss"] for r in metric_rows(full) if "loss" in r]
    half = run(tmp_path / "split", tiny_data, **{"train.steps": 8, "train.stop_after": 4, "checkpoint.interval": 4})
    resumed = run(tmp_path / "split", tiny_data, **{"train.steps": 8, "checkpoint.interval": 4})
    assert len(losses) == 8 and half.losses == losses[:4]
    assert resumed.losses == losses[4:]
    a, _, _ = load_for_inference(full)
    b, _, _ = load_for_inference(tmp_path / "split")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    rows = [r["loss"] for r in metric_rows(tmp_path / "split") if "loss" in r]
    assert rows == losses  # the metrics file of the resumed run is continuous


@pytest.mark.slow
def test_metrics_records_and_artifacts(tiny_data, tmp_path):
    r = run(tmp_path, tiny_data, **{"train.sample_tokens": 8})
    rows = metric_rows(tmp_path)
    train_rows = [x for x in rows if "loss" in x]
    assert len(train_rows) == 6
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "tokens"} <= set(train_rows[0])
    assert train_rows[-1]["tokens"] == 6 * 8 * 32
    assert [x["step"] for x in rows if "val_loss" in x] == [3, 6]
    assert 0 < r.mfu < 1 and r.tokens_per_s > 0
    # the summary's speed is the median logged interval's, not the last one's, nor the first step's
    # (its warm-up: logged, but not the run's speed)
    assert r.tokens_per_s == statistics.median(x["tokens_per_s"] for x in train_rows[1:])
    assert r.mfu == statistics.median(x["mfu"] for x in train_rows[1:])
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert r.sample.startswith("Romeo.")
    assert [p.name for p in checkpoint.list_complete(tmp_path)] == ["step-00000003", "step-00000006"]


def test_loss_decreases(tiny_data, tmp_path):
    r = run(
        tmp_path, tiny_data, **{"train.steps": 30, "optim.lr": 3e-3, "checkpoint.interval": 0, "train.eval_every": 0}
    )
    assert sum(r.losses[-5:]) / 5 < r.losses[0] - 0.5
    # a run flushes subnormals while it trains (build.subnormals_flushed) and gives the process its
    # floating-point state back: hypothesis, numpy and a caller's own code see subnormals again
    assert torch.tensor(1e-40).item() != 0.0


def test_recompute_modes_give_the_same_gradients(tiny_data):
    from flopwise.data.loader import TokenLoader

    batch = TokenLoader(tiny_data, "train", 32, 4, seed=0).next_batch()
    cfg = load_config(None, ["model.preset=demo-tiny", "data.seq_len=32"]).model
    grads = {}
    for mode in ("none", "selective", "full"):
        model = build_model(cfg, "cpu", seed=0)
        apply_recompute(model, mode)
        lm_loss(model, batch, torch.device("cpu"), "fp32").backward()
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    for mode in ("selective", "full"):
        assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(grads["none"], grads[mode], strict=True))


@pytest.mark.slow
def test_grad_accumulation_equals_one_big_batch(tiny_data, tmp_path):
    a = run(tmp_path / "a", tiny_data, **{"train.micro_batch": 8, "train.steps": 3, "checkpoint.interval": 0})
    b = run(tmp_path / "b", tiny_data, **{"train.micro_batch": 2, "train.steps": 3, "checkpoint.interval": 0})
    assert a.losses == pytest.approx(b.losses, rel=1e-5)


def test_one_document_has_no_validation_split_and_is_refused_before_step_one(tmp_path):
    """A split holds whole documents: one document leaves validation empty, and every run
    evaluates at its end, so the run stops before training rather than after it."""
    from flopwise.data.shards import resolve_input

    (tmp_path / "book.txt").write_text(resolve_input("builtin:alice").read_text())
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / "run", "x", **{"data.path": f'"{tmp_path / "book.txt"}"', "data.tokenizer": '"bpe:512"'}
        ),
    )
    with pytest.raises(DataError, match="no validation split of one data.seq_len=32 sequence"):
        train(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_a_sample_prompt_the_context_cannot_take_is_refused_before_step_one(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match="train.sample_prompt is 0 tokens: it needs 1 to model.max_seq_len-1"):
        run(tmp_path, tiny_data, **{"train.sample_prompt": '""', "train.sample_tokens": 8})
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_logging(tiny_data, tmp_path, monkeypatch):
    run(tmp_path, tiny_data, **{"log.tensorboard": "true", "train.steps": 2})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    # without the extra installed: one line before the run folder exists
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'flopwise\[tensorboard\]'"):
        run(tmp_path / "none", tiny_data, **{"log.tensorboard": "true", "train.steps": 2})
    assert not (tmp_path / "none").exists()


def test_bf16_autocast_trains(tiny_data, tmp_path):
    r = run(tmp_path, tiny_data, **{"train.dtype": '"bf16"', "train.steps": 3})
    assert all(math.isfinite(x) for x in r.losses)


def test_schedules():
    o = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert lr_at(0, o, 100) == pytest.approx(0.1) and lr_at(9, o, 100) == pytest.approx(1.0)
    assert lr_at(10, o, 100) == pytest.approx(1.0) and lr_at(99, o, 100) == pytest.approx(0.1)
    assert lr_at(int(10 + 89 / 2), o, 100) == pytest.approx(0.55, abs=0.02)
    lin = o.model_copy(update={"schedule": "linear"})
    assert lr_at(99, lin, 100) == pytest.approx(0.1) and lr_at(54, lin, 100) == pytest.approx(0.555, abs=0.01)
    wsd = o.model_copy(update={"schedule": "wsd", "decay_fraction": 0.2})
    assert lr_at(79, wsd, 100) == 1.0 and lr_at(99, wsd, 100) == pytest.approx(0.1)
    assert lr_at(89, wsd, 100) == pytest.approx(0.55)


def test_no_weight_decay_on_norms_biases_embeddings():
    m = build_model(ModelConfig(arch="gpt2", d_model=32, n_heads=4, vocab_size=100, max_seq_len=16))
    decay, no_decay = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    assert all(p.dim() == 2 and "embeddings" not in names[id(p)] for p in decay["params"])
    assert any("norm" in names[id(p)] for p in no_decay["params"])
    assert any("tok_embeddings" in names[id(p)] for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(m.parameters()))


def test_incomplete_checkpoints_are_never_resumed(tiny_run_copy):
    run_dir = tiny_run_copy(6)
    done = checkpoint.list_complete(run_dir)
    assert [p.name for p in done] == ["step-00000003", "step-00000006"]
    (run_dir / "checkpoints" / "step-00000009.tmp").mkdir()  # a crash mid-write
    broken = run_dir / "checkpoints" / "step-00000012"
    shutil.copytree(done[-1], broken)
    (broken / "__0_0.distcp").write_bytes(b"truncated")  # size no longer matches the manifest
    assert checkpoint.latest(run_dir).name == "step-00000006"
    with pytest.raises(CheckpointError, match="damaged"):
        checkpoint.resolve(broken)


def test_a_checkpoint_missing_any_one_file_is_never_resumed(tiny_run_copy):
    """The newest checkpoint with each of its files removed in turn: every time, resume takes the
    one before it (a checkpoint whose files are removed one at a time is never resumed from)."""
    run_dir = tiny_run_copy(6)
    newest = checkpoint.list_complete(run_dir)[-1]
    files = sorted(p.name for p in newest.iterdir())
    assert len(files) >= 4  # .metadata, state.json, manifest.json, tensor files, tokenizer
    for name in files:
        broken = run_dir / "checkpoints" / "step-00000099"
        shutil.rmtree(broken, ignore_errors=True)
        shutil.copytree(newest, broken)
        (broken / name).unlink()
        assert checkpoint.latest(run_dir) == newest, name
        with pytest.raises(CheckpointError):
            checkpoint.resolve(broken)


@pytest.mark.slow
def test_keep_prunes_old_checkpoints(tiny_data, tmp_path):
    run(tmp_path, tiny_data, **{"train.steps": 8, "checkpoint.interval": 2, "checkpoint.keep": 2})
    assert [p.name for p in checkpoint.list_complete(tmp_path)] == ["step-00000006", "step-00000008"]


@pytest.mark.slow
def test_checkpoint_of_another_shape_is_refused(tiny_data, tmp_path):
    """Resuming another model is refused before anything loads, naming the key; so is a checkpoint
    of other data. Keys that may change (steps, layout, LR) are reported, not refused."""
    run(tmp_path, tiny_data)
    with pytest.raises(CheckpointError, match=r"another run \(model.n_layers=2 there, 3 here\)"):
        run(tmp_path, tiny_data, **{"model.n_layers": 3, "train.steps": 9})
    with pytest.raises(CheckpointError, match=r"train.global_batch=8 there, 4 here"):
        run(tmp_path, tiny_data, **{"train.global_batch": 4, "train.steps": 9})
    other = tmp_path.parent / (tmp_path.name + "-other-data")
    from flopwise.data.prepare import prepare_data

    prepare_data(["builtin:alice"], other, tokenizer=str(tiny_data / "tokenizer.json"))  # same tokenizer, other split
    with pytest.raises(CheckpointError, match="other data"):
        run(tmp_path, other, **{"train.steps": 9})
    r = run(tmp_path, tiny_data, **{"train.steps": 9, "optim.min_lr": 1e-5})
    assert r.steps == 9


def test_vocab_smaller_than_tokenizer_is_a_config_error(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match="model.vocab_size=100"):
        run(tmp_path, tiny_data, **{"model.vocab_size": 100})


def test_eval_and_generate_cli(tiny_run, tmp_path, cli):
    run_dir = tiny_run(6)
    text = tmp_path / "t.txt"
    text.write_text("Alice was beginning to get very tired of sitting by her sister on the bank. " * 20)
    r = cli("eval", run_dir, "--text", text, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"loss", "ppl", "tokens", "seq_len"} and out["ppl"] == pytest.approx(math.exp(out["loss"]))
    args = ["generate", run_dir, "--prompt", "Alice", "--temperature", "0", "--max-new-tokens", "12"]
    cached, full = cli(*args), cli(*args, "--no-cache")
    assert cached.returncode == full.returncode == 0, cached.stderr + full.stderr
    assert cached.stdout == full.stdout and cached.stdout.startswith("Alice")


def test_compile_auto_compiles_long_runs_on_tested_layouts(tiny_data, tmp_path):
    """train.compile=auto: long single-process or data-parallel runs compile, short runs and
    tensor/pipeline/context-parallel layouts stay eager unless asked; the run's banner says which."""
    from flopwise.layout.rules import COMPILE_MIN_STEPS, Layout
    from flopwise.parallel.apply import config_compiles

    def cfg(**kw):
        return load_config(None, tiny_overrides(tmp_path, tiny_data, **kw))

    long = cfg(**{"train.steps": COMPILE_MIN_STEPS})
    assert config_compiles(long, Layout()) and config_compiles(long, Layout(dp=4, zero=3))
    assert not config_compiles(long, Layout(tp=2)) and not config_compiles(long, Layout(pp=2))
    assert not config_compiles(cfg(**{"train.steps": COMPILE_MIN_STEPS - 1}), Layout())
    assert config_compiles(cfg(**{"train.compile": "true", "train.steps": 2}), Layout(tp=2))
    assert not config_compiles(cfg(**{"train.compile": "false", "train.steps": 10 * COMPILE_MIN_STEPS}), Layout())
    with pytest.raises(ConfigError, match="train.compile"):
        cfg(**{"train.compile": '"sometimes"'})
