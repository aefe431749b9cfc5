"""Multi-process equivalence on CPU/gloo: every layout's per-step losses equal one process's.

Each torchrun launch runs many layouts (tests/dist/worker.py); the single-process references run
in this process. fp32 throughout, so the tolerance is 1e-5 relative (reduction order only).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from conftest import tiny_overrides
from flopwise.config import load_config
from flopwise.train.trainer import train

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parent / "dist" / "worker.py"
STEPS = 3


def base(run_dir, data, **extra) -> list[str]:
    """A 4-layer untied Llama (so pp2 × 2 virtual stages fits) on 8 × 32-token sequences."""
    kw = {"model.n_layers": 4, "model.tie_embeddings": "false", "train.steps": STEPS, "train.micro_batch": 2,
          "train.eval_every": 0, "checkpoint.interval": 0, "train.eval_batches": 1}
    kw.update(extra)
    return tiny_overrides(run_dir, data, **kw)


def torchrun(n: int, jobs: list[dict], tmp: Path, timeout: int = 600) -> dict:
    spec, out = tmp / f"jobs{n}.json", tmp / f"out{n}.json"
    spec.write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                        "--master-port", str(29500 + n), str(WORKER), str(spec), str(out)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())


LAYOUTS = {
    2: {
        "dp2-zero0": {"parallel.zero": 0}, "dp2-zero1": {"parallel.zero": 1},
        "dp2-zero2": {"parallel.zero": 2}, "dp2-zero3": {"parallel.zero": 3},
        "tp2": {"parallel.tp": 2}, "tp2-sp": {"parallel.tp": 2, "parallel.sequence_parallel": "true"},
        "pp2-gpipe": {"parallel.pp": 2, "parallel.pp_schedule": '"gpipe"'},
        "pp2-1f1b": {"parallel.pp": 2, "parallel.pp_schedule": '"1f1b"'},
        "pp2-interleaved-v2": {"parallel.pp": 2, "parallel.pp_schedule": '"interleaved-1f1b"', "parallel.virtual_stages": 2},
        "pp2-zero-bubble": {"parallel.pp": 2, "parallel.pp_schedule": '"zero-bubble"', "parallel.virtual_stages": 2},
        "pp2-dualpipev": {"parallel.pp": 2, "parallel.pp_schedule": '"dualpipev"', "parallel.virtual_stages": 2},
        "cp2": {"parallel.cp": 2},
    },
    4: {
        "hsdp2x2": {"parallel.zero": 3, "parallel.dp_replicate": 2},
        "tp2xdp2": {"parallel.tp": 2, "parallel.zero": 3, "parallel.sequence_parallel": "true"},
        "cp2xdp2": {"parallel.cp": 2, "parallel.zero": 3},
    },
    8: {"pp2xtp2xdp2": {"parallel.pp": 2, "parallel.tp": 2, "parallel.zero": 3}},
}


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> list[float]:
    r = train(load_config(None, base(tmp_path_factory.mktemp("ref"), tiny_data)), Console(quiet=True))
    return r.losses


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_layouts_match_single_process(world, reference, tiny_data, tmp_path):
    jobs = [{"name": name, "kind": "losses",
             "overrides": base(tmp_path / name, tiny_data, **{k: v for k, v in extra.items()})}
            for name, extra in LAYOUTS[world].items()]
    results = torchrun(world, jobs, tmp_path)
    bad = {}
    for name, r in results.items():
        if "error" in r:
            bad[name] = r["trace"]
        elif r["losses"] != pytest.approx(reference, rel=1e-5):
            bad[name] = f"losses {r['losses']} vs single process {reference}"
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())
