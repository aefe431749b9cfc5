"""docs/config.md is what `flopwise config docs` generates from the config model, and it names every key."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from flopwise.config.reference import render
from flopwise.config.schema import load_config, to_toml

pytestmark = pytest.mark.docs
PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_the_committed_reference_is_what_the_code_generates():
    assert PAGE.read_text() == render(), (
        "docs/config.md differs from the config model: run `flopwise config docs > docs/config.md`"
    )


def _keys(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in tree.items():
        out |= _keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
    return out


def test_every_key_of_a_resolved_config_is_documented_with_a_description():
    """Independent of the generator: the keys the demo config resolves to (its TOML), each in a row with
    a non-empty description."""
    row = re.compile(r"^\| `([\w.\[\]]+)` \|.*\| ([^|]*) \|$", re.M)
    rows = {m.group(1): m.group(2) for m in row.finditer(PAGE.read_text())}
    keys = _keys(tomllib.loads(to_toml(load_config("demo", []))))
    assert len(keys) > 80
    missing = sorted(k for k in keys if not rows.get(k, "").strip())
    assert not missing, f"keys without a documented description: {missing}"


def test_the_drift_the_hand_written_table_had_is_gone():
    """The README's hand-written table gave cluster.gpus_per_node a default of 8; the code's is none."""
    row = next(ln for ln in PAGE.read_text().splitlines() if ln.startswith("| `cluster.gpus_per_node`"))
    assert "| none |" in row and "devices per node" in row
