"""MFU has one denominator: a GPU's catalogue dense peak (identified by its driver name), else a
ceiling measured here that a faster step re-measures, so a logged MFU is never >= 1."""

import json
import subprocess
import sys

import pytest
import torch

from flopwise.config.schema import load_config
from flopwise.hardware.catalogue import CATALOGUE, GiB, identify_gpu
from flopwise.train import trainer
from flopwise.train.launch import train
from flopwise.train.metrics import Peak
from tests.conftest import tiny_overrides

# torch.cuda.get_device_name / total_memory as the driver reports them on each chip
DRIVER_NAMES = [
    ("NVIDIA A100-SXM4-40GB", 40 * GiB, "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", 80 * GiB, "a100-80gb"),
    ("NVIDIA A100 80GB PCIe", 80 * GiB, "a100-80gb"),
    ("NVIDIA A100-PCIE-40GB", 40 * GiB, "a100-40gb"),
    ("NVIDIA H100 80GB HBM3", 80 * GiB, "h100-sxm"),
    ("NVIDIA H100 PCIe", 80 * GiB, "h100-pcie"),
    ("NVIDIA H100 NVL", 94e9, "h100-nvl"),
    ("NVIDIA H200", 141e9, "h200"),
    ("NVIDIA H200 NVL", 141e9, "h200-nvl"),
    ("NVIDIA L4", 24e9, "l4"),
    ("NVIDIA L40S", 48e9, "l40s"),
    ("NVIDIA B200", 180e9, "b200"),
    ("NVIDIA GeForce RTX 4090", 24 * GiB, None),
    ("NVIDIA GH200 480GB", 96e9, None),
    ("Tesla T4", 16e9, None),
]


@pytest.mark.parametrize("name,memory,entry", DRIVER_NAMES)
def test_gpu_driver_names_map_to_their_catalogue_entry(name, memory, entry):
    assert identify_gpu(name, memory) == entry


def test_catalogue_dense_bf16_peaks_are_the_datasheets():
    """Dense (no 2:4 sparsity) bf16 tensor-core TFLOP/s as NVIDIA's datasheets state them."""
    datasheet = {
        "a100-40gb": 312,
        "a100-80gb": 312,
        "h100-sxm": 989.4,
        "h100-pcie": 756.5,
        "h100-nvl": 835.5,
        "h200": 989.4,
        "h200-nvl": 835.5,
        "l4": 121,
        "l40s": 362.05,
        "b200": 2250,
    }
    assert {k: CATALOGUE[k].peak("bf16") / 1e12 for k in datasheet} == pytest.approx(datasheet)


def _train(tmp, data, peak: Peak, monkeypatch, steps=6):
    monkeypatch.setattr(trainer, "device_peak", lambda *a: peak)
    r = train(load_config(None, tiny_overrides(tmp, data, **{"train.steps": steps})))
    return r, [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_ceiling_measured_while_the_machine_was_busy_is_remeasured(tiny_data, tmp_path, monkeypatch):
    """The start-up ceiling came out at 1 MFLOP/s (as if another process had the cores): the first
    step that beats it re-measures it for real, logs the event, and no MFU reaches 1."""
    r, rows = _train(tmp_path, tiny_data, Peak(1e6, "measured fp32 matmul ceiling on this cpu", True), monkeypatch)
    logged = [x for x in rows if "loss" in x]
    events = [x for x in rows if x.get("event") == "peak_remeasured"]
    assert events and events[0]["previous_peak_flops"] == 1e6 and events[0]["peak_flops"] > events[0]["achieved_flops"]
    assert all(0 < x["mfu"] < 1 for x in logged), [x["mfu"] for x in logged]
    assert all(x["peak_flops"] > 1e6 and x["peak_source"].startswith("measured") for x in logged)
    assert 0 < r.mfu < 1 and r.peak.flops == logged[-1]["peak_flops"]


def test_a_catalogue_peak_is_never_remeasured_and_an_impossible_rate_logs_no_mfu(tiny_data, tmp_path, monkeypatch):
    r, rows = _train(tmp_path, tiny_data, Peak(1e3, "h200 fp32 dense peak, catalogue", False), monkeypatch, steps=3)
    assert not [x for x in rows if x.get("event") == "peak_remeasured"]
    assert all(x["mfu"] is None and x["peak_flops"] == 1e3 for x in rows if "loss" in x)
    assert r.mfu is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_default_train_runs_on_cuda_against_the_catalogue_peak(tmp_path):
    """`flopwise train` with no device argument picks the GPU and names the catalogue peak it divides by."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flopwise",
            "train",
            "train.steps=20",
            "optim.warmup_steps=5",
            f'run.dir="{tmp_path / "run"}"',
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cuda" in out.stdout and ("catalogue" in out.stdout or "not in the catalogue" in out.stdout)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < x["mfu"] < 1 for x in rows if "loss" in x)


def test_a_cpu_ceiling_is_timed_once_per_machine_and_thread_count(monkeypatch, tmp_path):
    """Every run divides by the ceiling the first run on this machine timed (1-3 s of products per
    process on 2 cores otherwise: each torchrun rank, each restart), in this process and the ones
    after it (the cache file); another thread count times its own; a re-measurement that beats it
    raises it for the runs after; a damaged cache file is measured over, never trusted."""
    from flopwise.hardware.catalogue import CATALOGUE
    from flopwise.train import metrics

    monkeypatch.setenv("FLOPWISE_CACHE_DIR", str(tmp_path / "cache"))

    timed = []

    def fake(dtype, device, sizes=None, repeats=5):
        timed.append((dtype, torch.get_num_threads(), repeats))
        return 1e9 * len(timed)

    monkeypatch.setattr(metrics, "measure_matmul_peak", fake)
    monkeypatch.setattr(metrics, "_cpu_ceilings", {})
    cpu = torch.device("cpu")
    threads = torch.get_num_threads()
    first = metrics.device_peak(CATALOGUE, "fp32", cpu)
    assert metrics.device_peak(CATALOGUE, "fp32", cpu) == first and first.flops == 1e9 and first.measured
    assert first.source.endswith(f"once per machine: {tmp_path / 'cache' / 'cpu-ceilings.json'}")  # summary says
    assert metrics.device_peak(CATALOGUE, "bf16", cpu).flops == 2e9
    try:
        torch.set_num_threads(threads + 1)
        assert metrics.device_peak(CATALOGUE, "fp32", cpu).flops == 3e9
    finally:
        torch.set_num_threads(threads)
    assert [t[:2] for t in timed] == [("fp32", threads), ("bf16", threads), ("fp32", threads + 1)]
    raised = metrics.checked_peak(first, 1.5e9, "fp32", cpu)  # a step beat it: re-measured (4e9)
    assert raised.flops == 4e9 and metrics.device_peak(CATALOGUE, "fp32", cpu).flops == 4e9
    assert len(timed) == 4
    monkeypatch.setattr(metrics, "_cpu_ceilings", {})  # the next process: nothing timed, the file read
    assert metrics.device_peak(CATALOGUE, "fp32", cpu).flops == 4e9
    assert metrics.device_peak(CATALOGUE, "bf16", cpu).flops == 2e9 and len(timed) == 4
    for damaged in ("{not json", '{"x": 1}', "[1e99]", '{"%s": -1}'):
        monkeypatch.setattr(metrics, "_cpu_ceilings", {})
        metrics.ceilings_file().write_text(damaged.replace("%s", metrics._cpu_key("fp32")))
        assert metrics.device_peak(CATALOGUE, "fp32", cpu).flops == 1e9 * len(timed)  # timed again
    assert len(timed) == 8 and list(metrics.ceilings_file().parent.iterdir()) == [metrics.ceilings_file()]


def test_the_ceiling_stops_timing_once_its_budget_is_spent(monkeypatch):
    """bf16 on a CPU without bf16 instructions spent 5.5 minutes on the three sizes before step 1
    (an AVX2 EPYC, 2026-12-07): past the budget no further product is timed, and the first size always is."""
    from flopwise.train import metrics

    made = []
    full = torch.full
    monkeypatch.setattr(torch, "full", lambda size, *a, **k: made.append(size[0]) or full(size, *a, **k))
    cpu = torch.device("cpu")
    assert metrics.measure_matmul_peak("fp32", cpu, sizes=(64, 128, 256), budget_s=0.0) > 0
    assert made == [64, 64]  # a and b of the first size, one timed product
    made.clear()
    assert metrics.measure_matmul_peak("fp32", cpu, sizes=(64, 128, 256), repeats=2, budget_s=60.0) > 0
    assert made == [64, 64, 128, 128, 256, 256]


def test_loss_plot_of_one_logged_step_shows_it(tmp_path):
    """A run that logged one point drew an empty plot (a line through one point draws nothing): the
    point is a marker now, in the train series' colour (matplotlib's first, #1f77b4)."""
    from flopwise.files.outputs import pyplot
    from flopwise.train.metrics import plot_loss_curve

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    png = tmp_path / "loss.png"
    png.write_bytes(plot_loss_curve(metrics, title="one point"))
    pixels = pyplot().imread(png)[..., :3]
    blue = (abs(pixels - torch.tensor([0x1F, 0x77, 0xB4]).numpy() / 255).max(axis=-1) < 0.05).sum()
    assert blue > 20  # the marker's disc (the legend's sample alone would be a few pixels of line)
