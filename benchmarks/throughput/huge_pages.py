"""A CPU training run with and without transparent huge pages for PyTorch's large tensors, side by side.

    python benchmarks/throughput/huge_pages.py [--steps 100] [--repeats 2]

flopwise sets THP_MEM_ALLOC_ENABLE=1 (flopwise/__init__.py) so that tensors of 2 MB and more are
allocated on huge pages: a CPU step allocates and frees its logits every step, and in 4 KB pages
the kernel faults every page in again. Each run is `flopwise train` in a fresh process on the demo's
data with a 13K-parameter model (the smallest of a scaling ladder: the logits dominate its step),
alternating the two settings; printed are wall, user and system seconds and minor page faults, and
the ratio of the medians (off / on).
"""

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMALL = ["model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=64"]


def run(setting: str, data: Path, steps: int, out: Path) -> dict[str, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(
        ["env", f"THP_MEM_ALLOC_ENABLE={setting}", "OMP_NUM_THREADS=1", sys.executable, "-m", "flopwise", "train",
         f'run.dir="{out}"', f'data.path="{data}"', f"train.steps={steps}", "log.every=1000", *SMALL],
        check=True, capture_output=True,
    )  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "wall": time.perf_counter() - t0,
        "user": after.ru_utime - before.ru_utime,
        "sys": after.ru_stime - before.ru_stime,
        "faults": after.ru_minflt - before.ru_minflt,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    from flopwise.config.schema import load_config
    from flopwise.train.build import ensure_data

    with tempfile.TemporaryDirectory() as d:
        data = ensure_data(load_config("demo"), Path(d) / "demo")[0].data_dir
        rows: dict[str, list[dict[str, float]]] = {"1": [], "0": []}
        for i in range(a.repeats):
            for setting in ("0", "1"):
                r = run(setting, data, a.steps, Path(d) / f"run-{setting}-{i}")
                rows[setting].append(r)
                print(f"THP_MEM_ALLOC_ENABLE={setting}: {r['wall']:.1f} s wall, {r['user']:.1f} s user, "
                      f"{r['sys']:.1f} s sys, {r['faults']:,.0f} minor faults")  # fmt: skip
        wall = {s: statistics.median(r["wall"] for r in rs) for s, rs in rows.items()}
        print(f"median wall: off {wall['0']:.1f} s, on {wall['1']:.1f} s: on is {wall['0'] / wall['1']:.2f}x faster")


if __name__ == "__main__":
    main()
