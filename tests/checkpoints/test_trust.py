"""Trust boundary: a checkpoint folder a user is handed can never run code.

The attack (reproduced): DCP metadata that declares a tensor entry as "bytes" makes DCP's reader
`torch.load(weights_only=False)` bytes of a file in the folder; with the manifest rewritten to
match, every loader would run it. Each loader path is tried on such a folder: the payload (which
creates a marker file) must never run, and each refuses with a one-line error.
"""

import builtins
import io
import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from flopwise.checkpoints import checkpoint
from flopwise.checkpoints.export import export_checkpoint
from flopwise.config.schema import load_config, to_toml
from flopwise.errors import CheckpointError
from flopwise.eval.load import load_for_inference
from flopwise.interop.convert import export_hf
from flopwise.model.transformer import build_model
from flopwise.train.launch import train
from tests.conftest import tiny_overrides


class Payload:
    """Unpickling this creates the marker file: evidence that code from the folder ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.open, (self.marker, "w"))


def plant(ckpt, marker, list_in_manifest: bool = True):
    """Turn model.norm.weight into a 'bytes' entry read from a payload file, and (as an attacker
    would) rewrite the manifest so sizes and checksums match."""
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)  # the test's own file: trusted here
    key = "model.norm.weight"
    md.state_dict_metadata[key] = BytesStorageMetadata()
    md.storage_data = {i: s for i, s in md.storage_data.items() if i.fqn != key}
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    (ckpt / "__evil.distcp").write_bytes(buf.getvalue())
    md.storage_data[MetadataIndex(key)] = _StorageInfo("__evil.distcp", 0, len(buf.getvalue()))
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    names = [".metadata", "__evil.distcp"] if list_in_manifest else [".metadata"]
    for name in names:
        manifest["files"][name] = {"bytes": (ckpt / name).stat().st_size, "sha256": checkpoint._sha256(ckpt / name)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def evil(tiny_data, tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path / "run", tiny_data))
    ckpt = checkpoint.save(
        tmp_path / "run",
        3,
        build_model(cfg.model, "cpu"),
        None,
        {"config": to_toml(cfg)},
        files={"tokenizer.json": tiny_data / "tokenizer.json"},
    )
    marker = tmp_path / "PWNED"
    plant(ckpt, marker)
    return ckpt, marker, cfg


def test_the_planted_folder_is_a_real_exploit_for_dcps_stock_reader(evil):
    """The reference: torch's own FileSystemReader runs the payload (so the tests below can fail)."""
    ckpt, marker, _ = evil
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model.norm.weight": io.BytesIO()}, storage_reader=FileSystemReader(str(ckpt)))
    assert marker.exists()


@pytest.mark.parametrize("path", ["eval/generate", "convert to-hf", "checkpoint export", "resume", "direct load"])
def test_every_loader_refuses_a_bytes_entry_and_runs_nothing(path, evil, tiny_data, tmp_path):
    ckpt, marker, cfg = evil
    attempts = {
        "eval/generate": lambda: load_for_inference(ckpt),
        "convert to-hf": lambda: export_hf(ckpt, tmp_path / "hf"),
        "checkpoint export": lambda: export_checkpoint(ckpt, tmp_path / "exported"),
        "resume": lambda: train(
            load_config(None, tiny_overrides(tmp_path / "resumed", tiny_data, **{"checkpoint.resume": f'"{ckpt}"'}))
        ),
        "direct load": lambda: checkpoint.load(ckpt, build_model(cfg.model, "cpu")),  # no verify first
    }
    with pytest.raises(CheckpointError) as e:
        attempts[path]()
    assert "BytesStorageMetadata" in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()


def test_a_file_the_manifest_does_not_list_is_refused(tiny_data, tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path / "run", tiny_data))
    ckpt = checkpoint.save(tmp_path / "run", 3, build_model(cfg.model, "cpu"), None, {"config": to_toml(cfg)})
    plant(ckpt, tmp_path / "PWNED", list_in_manifest=False)
    assert checkpoint.verify(ckpt) is not None and not (tmp_path / "PWNED").exists()


def test_the_cli_prints_one_line_and_exits_2(evil, tmp_path, cli):
    ckpt, marker, _ = evil
    text = tmp_path / "t.txt"
    text.write_text("To be or not to be")
    r = cli("eval", ckpt, "--text", text)
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    assert len((r.stderr + r.stdout).strip().splitlines()) == 1 and not marker.exists()


def test_data_prepare_never_deletes_a_folder_that_is_not_its_own(tmp_path, cli):
    """`flopwise data prepare --out DIR` on a folder of someone's files refuses in one line and
    leaves it as it was; --force replaces it; re-preparing its own output is allowed."""
    src = tmp_path / "in.txt"
    src.write_text("Some words to tokenize. " * 200)
    precious = tmp_path / "thesis"
    precious.mkdir()
    (precious / "chapter1.tex").write_text("irreplaceable")

    def prepare(out, *extra):
        return cli("data", "prepare", src, "--out", out, "--train-tokenizer", "300", "--workers", "1", *extra)

    r = prepare(precious)
    assert r.returncode == 2 and "--force" in r.stderr + r.stdout and "Traceback" not in r.stderr
    assert (precious / "chapter1.tex").read_text() == "irreplaceable"
    out = tmp_path / "prepared"
    for _ in range(2):  # its own folder may be prepared again
        r = prepare(out)
        assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "index.json").is_file()
    r = prepare(precious, "--force")
    assert r.returncode == 0 and (precious / "index.json").is_file() and not (precious / "chapter1.tex").exists()


def test_retention_says_what_it_could_not_delete(tiny_data, tmp_path, monkeypatch):
    cfg = load_config(None, tiny_overrides(tmp_path, tiny_data))
    model = build_model(cfg.model, "cpu")
    for step in (1, 2):
        checkpoint.save(tmp_path, step, model, None, {"config": to_toml(cfg)})
    real = Path.unlink

    def unlink(path, missing_ok=False):  # retention's deletions in step 1 fail; other removals work
        if path.parent.name == "step-00000001":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    with pytest.warns(UserWarning, match="could not delete .*step-00000001.*Permission denied"):
        checkpoint.save(tmp_path, 3, model, None, {"config": to_toml(cfg)}, keep=1)


def test_hf_tensors_the_model_does_not_use_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from flopwise.config.schema import ModelConfig
    from flopwise.interop.hf import from_hf, to_hf

    m = ModelConfig(n_layers=1, d_model=32, n_heads=4, vocab_size=64, max_seq_len=16)
    to_hf(build_model(m, "cpu"), m, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, "model.extra_adapter.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.warns(UserWarning, match="1 tensor.*ignored: model.extra_adapter.weight"):
        from_hf(tmp_path)
