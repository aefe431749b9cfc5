"""Slow: the embedded default end to end, and compilation. `pytest -m "not slow"` skips them."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flopwise.config.schema import load_config
from flopwise.train.launch import train
from tests.conftest import tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def default_run(tmp_path: Path) -> tuple[Path, str]:
    """The run folder `flopwise train` makes with no arguments, and what it printed. CI's stage 1
    runs the README's first command as written in a fresh venv (.ci/run) and hands that run over,
    FLOPWISE_DEFAULT_RUN its folder and FLOPWISE_DEFAULT_LOG its printout, so that the suite does
    not train the same 300 steps a second time; without them this test trains it here."""
    made, log = os.environ.get("FLOPWISE_DEFAULT_RUN"), os.environ.get("FLOPWISE_DEFAULT_LOG")
    if made and log:
        return Path(made), Path(log).read_text()
    r = subprocess.run(
        [sys.executable, "-m", "flopwise", "train", f'run.dir="{tmp_path}"'],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return tmp_path, r.stdout


@pytest.mark.timeout(2400)
def test_default_train_beats_the_unigram_entropy(tmp_path):
    """`flopwise train` with the demo defaults: val loss clearly below the corpus's unigram entropy."""
    run, stdout = default_run(tmp_path)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    val = [x["val_loss"] for x in rows if "val_loss" in x][-1]
    entropy = json.loads((run / "data" / "index.json").read_text())["unigram_entropy_nats"]
    assert val < entropy - 1.0, (val, entropy)
    assert "sample" in stdout and re.search(r"\n[A-Z][A-Za-z]+\.\n", stdout)  # a speaker line: "Romeo."
    assert (run / "loss.png").exists() and (run / "checkpoints" / "step-00000300" / "manifest.json").exists()


@pytest.mark.compile
def test_compile_matches_eager(tiny_data, tmp_path):
    kw = {"train.steps": 3, "checkpoint.interval": 0, "train.eval_every": 0}
    eager = train(load_config(None, tiny_overrides(tmp_path / "e", tiny_data, **kw)))
    compiled = train(load_config(None, tiny_overrides(tmp_path / "c", tiny_data, **kw, **{"train.compile": "true"})))
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4)
