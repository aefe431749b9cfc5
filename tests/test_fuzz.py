"""Property tests: every reader of user-supplied input, fed random bytes and random values, either
works or raises its one-line flopwise error, and writes nothing outside where it was pointed.
FLOPWISE_FUZZ_EXAMPLES=5000 digs deeper than the 150 examples per property CI runs."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flopwise.config import Config, load_config
from flopwise.data.shards import open_split, read_index
from flopwise.data.tokenizer import load_tokenizer
from flopwise.errors import CheckpointError, ConfigError, DataError, FlopwiseError
from flopwise.interop.hf_config import model_fields_from_hf
from flopwise.train import checkpoint

FUZZ = settings(max_examples=int(os.environ.get("FLOPWISE_FUZZ_EXAMPLES", "150")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
KEYS = ["train.steps", "train.global_batch", "model.n_layers", "model.d_model", "model.n_heads", "data.seq_len",
        "optim.lr", "parallel.tp", "checkpoint.interval", "checkpoint.async", "guard.window", "watchdog.min_s",
        "model.preset", "model.arch", "model.pos", "run.dir", "data.tokenizer", "cluster.gpus", "bogus.key", "train"]
scalars = st.one_of(st.integers(-10**12, 10**12), st.floats(allow_nan=True), st.booleans(), st.text(max_size=20))
json_values = st.recursive(st.none() | scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=12)


def one_line(e: Exception) -> bool:
    return isinstance(e, FlopwiseError) and "\n" not in str(e) and str(e)


@FUZZ
@given(raw=st.binary(max_size=400) | st.text(max_size=400).map(str.encode))
def test_config_files_of_random_bytes(tmp_path, raw):
    f = tmp_path / "c.toml"
    f.write_bytes(raw)
    try:
        assert isinstance(load_config(f), Config)
    except ConfigError as e:
        assert one_line(e)


@FUZZ
@given(items=st.lists(st.tuples(st.sampled_from(KEYS), st.text(max_size=12) | scalars.map(json.dumps)), max_size=4))
def test_random_overrides(items):
    try:
        load_config(None, [f"{k}={v}" for k, v in items])
    except ConfigError as e:
        assert one_line(e)


@FUZZ
@given(index=json_values, raw=st.binary(max_size=64))
def test_data_index_and_shards(tmp_path, index, raw):
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    (d / "index.json").write_text(json.dumps(index))
    (d / "train.bin").write_bytes(raw)
    before = set(tmp_path.rglob("*"))
    for call in (lambda: read_index(d), lambda: open_split(d, "train")):
        try:
            call()
        except DataError as e:
            assert one_line(e)
    assert set(tmp_path.rglob("*")) == before


@FUZZ
@given(good=st.fixed_dictionaries({"format": st.just("flopwise-shards/2"), "vocab_size": st.integers(-5, 70000),
                                    "dtype": st.sampled_from(["uint16", "uint32", "float64", "bogus"]),
                                    "splits": st.fixed_dictionaries({
                                        "train": st.fixed_dictionaries({
                                            "files": st.lists(st.fixed_dictionaries({
                                                "file": st.sampled_from(["train.bin", "../x", "", 3]),
                                                "tokens": st.integers(-3, 40)}), max_size=2),
                                            "tokens": st.integers(-3, 80)}),
                                        "val": st.just({"files": [], "tokens": 0})})}),
       raw=st.binary(max_size=80))
def test_nearly_valid_indexes(tmp_path, good, raw):
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    (d / "index.json").write_text(json.dumps(good))
    (d / "train.bin").write_bytes(raw)
    try:
        tokens = np.asarray(open_split(d, "train"))
        assert int(tokens.max(initial=0)) < good["vocab_size"]
    except DataError as e:
        assert one_line(e)


@FUZZ
@given(raw=st.binary(max_size=300))
def test_tokenizer_files(tmp_path, raw):
    f = tmp_path / "tokenizer.json"
    f.write_bytes(raw)
    with pytest.raises(DataError) as e:
        load_tokenizer(f)
    assert one_line(e.value)


@FUZZ
@given(manifest=json_values | st.binary(max_size=100), metadata=st.binary(max_size=200), state=st.binary(max_size=50))
def test_checkpoint_folders_of_junk(tmp_path, manifest, metadata, state):
    ckpt = tmp_path / "checkpoints" / "step-00000001"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "manifest.json").write_bytes(manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode())
    (ckpt / ".metadata").write_bytes(metadata)
    (ckpt / "state.json").write_bytes(state)
    reason = checkpoint.verify(ckpt)
    assert reason is None or isinstance(reason, str)
    with pytest.raises(CheckpointError) as e:
        checkpoint.read_dcp_metadata(ckpt)
    assert one_line(e.value)
    assert checkpoint.latest(tmp_path) in (None, ckpt)
    try:
        checkpoint.read_state(ckpt)
    except CheckpointError as e:
        assert one_line(e)


@FUZZ
@given(cfg=json_values | st.binary(max_size=100))
def test_hugging_face_configs(tmp_path, cfg):
    (tmp_path / "config.json").write_bytes(cfg if isinstance(cfg, bytes) else json.dumps(cfg).encode())
    try:
        model_fields_from_hf(tmp_path)
    except (CheckpointError, ConfigError) as e:
        assert one_line(e)


@pytest.mark.parametrize("args,fragment", [
    (["train", "train.steps=-1"], "train.steps"),
    (["train", "missing.toml"], "config file missing.toml: not found"),
    (["train", "data.path=/no/such/dir", "train.steps=1", "optim.warmup_steps=0"], "/no/such/dir"),
    (["train", "model.init_from=hf:/no/such/folder"], "/no/such/folder"),
    (["eval", "{run}", "--tasks", "alice-lastword"], "no complete checkpoint"),
    (["train", "data.tokenizer=bpe:lots"], "data.tokenizer"),
])
def test_cli_user_errors_are_one_line_exit_2_no_traceback(tmp_path, args, fragment):
    args = [a.replace("{run}", str(tmp_path)) for a in args]
    r = subprocess.run([sys.executable, "-m", "flopwise", *args], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "COLUMNS": "400"}, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and fragment in r.stderr
    assert r.stderr.strip().startswith("error:") and len(r.stderr.strip().splitlines()) == 1
