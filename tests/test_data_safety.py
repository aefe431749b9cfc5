"""Nothing lost: every command that writes, pointed at a folder of a user's files (some named as
flopwise's own outputs are: index.json, config.json, step-N, metrics.jsonl ...), leaves each of
those files byte for byte as it was, whatever the command's exit code."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_overrides

# a user's files, several named as what flopwise writes
SENTINELS = [
    "index.json", "config.json", "tokenizer.json", "config.toml", "metrics.jsonl", "manifest.json", "report.json",
    "recipe.json", "loss.png", "fit.png", "model.safetensors", "state.json", "prediction.json", "ids.json", "step-5",
    "train-00000.bin", "notes.txt", "src/thesis.tex", "checkpoints/step-00000001/notes.txt",
    "checkpoints/step-00000002", "checkpoints/step-00000003.tmp", "data/index.json", "data/notes.txt",
    "hf/config.json", "hf/model.safetensors", "ladder/notes.txt", "ladder/index.json",
]


def seed_user_tree(root: Path) -> dict[str, str]:
    """Sentinel files under `root`; returns {relative path: sha256}."""
    for i, rel in enumerate(SENTINELS):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(f"a user's {rel}, #{i}: not flopwise's\n".encode() * (i + 1))
    return hashes(root)


def hashes(root: Path) -> dict[str, str]:
    return {rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() if (root / rel).is_file() else "missing"
            for rel in SENTINELS}


def flopwise(*args, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "flopwise", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory) -> Path:
    """A finished tiny run (2 checkpoints) and its HF export, made outside any user folder."""
    root = tmp_path_factory.mktemp("made")
    out = flopwise("train", *tiny_overrides(root / "run", tiny_data, **{"train.steps": 4, "checkpoint.interval": 2}),
                   cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    out = flopwise("convert", "to-hf", root / "run", root / "hf", cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    return root


def commands(u: Path, made: Path, data: Path) -> dict[str, list]:
    """Each writing command, aimed at the user's folder `u`."""
    return {
        "train": ["train", *tiny_overrides(u, data, **{"train.steps": 2, "checkpoint.interval": 1})],
        "train-prepares-data": ["train", *tiny_overrides(u, "builtin:alice", **{"train.steps": 1,
                                                                              "data.tokenizer": '"bpe:300"'})],
        "data-prepare": ["data", "prepare", "builtin:alice", "--out", u, "--train-tokenizer", 300],
        "data-contamination": ["data", "contamination", data, "--tasks", "alice-lastword", "--ids-out", u / "ids.json"],
        "checkpoint-export": ["checkpoint", "export", made / "run", "--out", u],
        "convert-to-hf": ["convert", "to-hf", made / "run", u / "hf"],
        "convert-from-hf": ["convert", "from-hf", made / "hf", u],
        "generate": ["generate", made / "run", "--prompt", "Alice", "--max-new-tokens", 4],
        "plan-out-config": ["plan", "model.preset=\"demo-tiny\"", "--out-config", u / "config.toml",
                            "--plot", u / "loss.png"],
        "scale-fit": ["scale", "fit", Path(__file__).parent / "data" / "chinchilla_svg_extracted_data.csv",
                      "--bootstrap", 0, "--out", u / "ids.json", "--plots", u],
        "scale-optimal-out-config": ["scale", "optimal", "--flops", "1e15", "--out-config", u / "config.toml"],
    }


SLOW = {  # multi-process or long: the slow set
    "scale-sweep": lambda u, made, data: ["scale", "sweep", "--out", u / "ladder", "--budgets", "1e11", "--sizes", 2],
    "plan-measure": lambda u, made, data: ["plan", *tiny_overrides(u / "measure", data), "--measure", "--nproc", 1,
                                           "--steps", 1],
}


def _check(name: str, argv_of, trained: Path, tiny_data: Path, tmp_path: Path) -> None:
    u = tmp_path / "user"
    before = seed_user_tree(u)
    out = flopwise(*argv_of(u, trained, tiny_data), cwd=u)
    after = hashes(u)
    changed = {k for k in before if before[k] != after[k]}
    assert not changed, f"{name} (exit {out.returncode}) changed {sorted(changed)}: {out.stdout[-800:]}{out.stderr[-800:]}"
    assert "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("name", list(commands(Path("u"), Path("m"), Path("d"))))
def test_a_writing_command_leaves_every_user_file_intact(name, trained, tiny_data, tmp_path):
    _check(name, lambda u, made, data: commands(u, made, data)[name], trained, tiny_data, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW))
def test_a_slow_writing_command_leaves_every_user_file_intact(name, trained, tiny_data, tmp_path):
    _check(name, SLOW[name], trained, tiny_data, tmp_path)


def test_to_hf_replaces_only_a_folder_it_exported(trained, tmp_path):
    """A second export into its own folder replaces it; once the user adds or changes a file there,
    the folder is theirs and the export is refused in one line, with their files intact."""
    hf = tmp_path / "hf"
    for _ in range(2):
        out = flopwise("convert", "to-hf", trained / "run", hf, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
    (hf / "README.md").write_text("my model card")
    out = flopwise("convert", "to-hf", trained / "run", hf, cwd=tmp_path)
    assert out.returncode == 2 and "README.md" in out.stderr and "Traceback" not in out.stderr
    assert (hf / "README.md").read_text() == "my model card"
