"""`flopwise hardware calibrate` -> a hardware TOML the planner reads (cluster.hardware_file).

The reference for the planner's calibrated time is a measured step of the engine (`plan
measure`, the wall clock), on a model whose shapes the calibration measured; how close it comes
on the four CPU layouts is benchmarks/throughput/plan_time_cpu.py's (a loaded CI machine would make a tight
bound here flaky, so the test asks for the right order of magnitude and a strict improvement on
nothing but the measurement itself)."""

import itertools
import json
import os
import re
import sys

import pytest

from flopwise.errors import ConfigError
from flopwise.hardware.catalogue import CATALOGUE, cpu_multiplies_bf16, load_catalogue
from flopwise.measure.calibrate import save_hardware
from flopwise.plan.step import ACT_BYTES
from tests.conftest import flopwise, run_main

TINY = [
    "model.preset=demo-tiny",
    "model.vocab_size=4096",
    "data.seq_len=64",
    "train.global_batch=8",
    "train.micro_batch=8",
]


# what calibrate measures here under train.dtype=auto: bf16 with bf16 instructions, else fp32
NATIVE = "bf16" if cpu_multiplies_bf16() else "fp32"


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "hw.toml"
    before = cpu_share_probe()
    r = flopwise("hardware", "calibrate", *TINY, "--nproc", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    _PROBE["calibrated"] = (before, cpu_share_probe())
    return out, r.stdout


_PROBE: dict[str, tuple[float, float]] = {}


def cpu_share_probe() -> float:
    """Median seconds of a fixed 1024² product in this process now (25 of them, about half a second):
    how much of the CPU a process gets at this moment, beside other test workers or users. Its ratio
    between two moments is the factor by which a CPU-bound wall clock stretched between them. (The
    1-minute load average, used before, lags: it saw 1.3x where a measurement stretched 4.6x, when a
    neighbour's 4-rank launch began after the calibration, 2026-12-06.)"""
    import statistics
    import time

    import torch

    a = torch.full((1024, 1024), 0.5)
    times = []
    for _ in range(25):
        t0 = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@pytest.mark.slow
@pytest.mark.multiproc  # the calibration's collectives run on 2 ranks
def test_calibrate_writes_an_entry_the_planner_plans_with(calibrated, tmp_path):
    out, stdout = calibrated
    assert f"wrote {out}" in stdout
    hw = load_catalogue(out)["cpu"]
    cal = hw.calibration
    assert hw.peak_flops[NATIVE] > 1e9 and hw.memory_bw > 1e8 and hw.devices_per_node == 2
    assert cal.dtype == NATIVE and cal.threads >= 1 and 0 < cal.layer_overhead < 1  # seconds a decode layer
    # the demo-tiny block's products are in the table: d_model 64 -> q/k/v 64+2*32, at 8 x 64 tokens
    assert any(r[:3] == (512.0, 128.0, 64.0) for r in cal.gemm)
    assert {r[0] for r in cal.attention} >= {64.0, 128.0}
    # element-wise rates at tp 1 (3 micro-batches) and of the engine's tensor parallel on the 2 ranks
    assert sorted(r[0] for r in cal.elementwise) == [1.0, 1.0, 1.0, 2.0] and all(r[2] > 1e6 for r in cal.elementwise)
    assert {k for k, _ in cal.collectives} == {"all_reduce", "all_gather", "reduce_scatter", "send_recv"}
    rec = hw.recovery  # a save's fixed cost and rate, a restart's fixed part and read rate: physical
    assert rec is not None and 0 <= rec.write_latency_s < 10 and 1e6 < rec.write_bytes_per_s < 1e12
    assert 0.5 < rec.restart_fixed_s < 300 and 1e5 < rec.read_bytes_per_s < 1e12 and "calibrate on" in rec.source
    for kind, _ in cal.collectives:  # latency and bandwidth fitted to the measurements are physical
        alpha, beta = cal.collective(kind)
        assert 0 <= alpha < 0.1 and 1e6 < beta < 1e12
    r = flopwise("plan", "demo", *TINY, f'cluster.hardware_file="{out}"', "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    best, rel = json.loads(r.stdout)["layouts"][0], json.loads(r.stdout)["reliability"]
    assert best["step_time_s"] > 0 and 0 < best["mfu"] < 1
    assert rel["write_source"].startswith("measured") and rel["restart_source"].startswith("measured")


@pytest.mark.slow
@pytest.mark.multiproc
def test_calibrated_prediction_is_the_measured_step_to_a_factor(calibrated, tmp_path, demo_data):
    """One process, the calibrated shapes: predicted within a factor 2 of the measured median step
    (the ±10% target is the benchmark's, on a quiet machine). The calibration and the measurement
    may meet different loads (xdist's other worker, a shared machine): the band widens by how much
    less of the CPU this process got around the measurement than around the calibration (probed,
    cpu_share_probe), so a busy neighbour moves the bound, never the verdict on a quiet one; a
    measurement outside it is taken again, up to 3 times (a neighbour's burst passes)."""
    out, _ = calibrated
    for attempt in range(3):
        before = cpu_share_probe()
        r = flopwise(
            "plan",
            "measure",
            "demo",
            *TINY,
            f'cluster.hardware_file="{out}"',
            f'run.dir="{tmp_path / f"run{attempt}"}"',
            f'data.path="{demo_data}"',
            "--steps",
            "3",
            "--json",
        )
        assert r.returncode == 0, r.stderr[-2000:]
        st = json.loads(r.stdout)["step_time_s"]
        now, then = (before, cpu_share_probe()), _PROBE["calibrated"]
        low, high = min(now) / max(then), max(now) / min(then)
        if 0.5 * min(1.0, low) < st["measured"] / st["predicted"] < 2 * max(1.0, high):
            break
    else:
        raise AssertionError(f"measured / predicted outside 0.5-2x, widened by {low:.2f}-{high:.2f}: {st}")


@pytest.mark.slow
@pytest.mark.multiproc
def test_save_replaces_its_own_entry_and_keeps_the_others(calibrated, tmp_path):
    out, _ = calibrated
    target = tmp_path / "cluster.toml"
    save_hardware(CATALOGUE["h200"], target)
    save_hardware(load_catalogue(out)["cpu"], target)
    both = load_catalogue(target)
    assert both["h200"] == CATALOGUE["h200"] and both["cpu"].calibration == load_catalogue(out)["cpu"].calibration
    mine = tmp_path / "notes.toml"
    mine.write_text("[cpu]\n# my own notes\n")
    r = flopwise("hardware", "calibrate", "--out", str(mine))
    assert r.returncode == 2 and "flopwise did not write" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert mine.read_text() == "[cpu]\n# my own notes\n"


@pytest.mark.slow
@pytest.mark.multiproc  # the calibrated file it edits comes from a 2-rank calibration
@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda t: t.replace("threads = ", "gemx = 1\nthreads = "), "unknown field(s) gemx"),
        (lambda t: t.replace("attention = [", "attention_old = ["), "missing attention"),
        (lambda t: t.replace("  [", "  [0.0, ", 1), ".gemm[0]"),
        (lambda t: t.replace("memory_bw = ", "memory_bw = -"), ".memory_bw"),
        (lambda t: t.replace("threads = ", "threads = -"), ".threads"),
        (lambda t: t[: t.index("[cpu.peak_flops]")], ".peak_flops"),
    ],
)
def test_a_bad_or_partial_file_fails_in_one_line_naming_the_field(
    calibrated, tmp_path, edit, field, capsys, monkeypatch
):
    out, _ = calibrated
    bad = tmp_path / "bad.toml"
    bad.write_text(edit(out.read_text()))
    with pytest.raises(ConfigError, match=re.escape(f"hardware file {bad}: [cpu]") + ".*" + re.escape(field)):
        load_catalogue(bad)
    monkeypatch.setenv("COLUMNS", "400")  # the one line unwrapped, however long the path
    code, err = run_main(["plan", "demo", f'cluster.hardware_file="{bad}"'], capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error:"), err


# SmolLM-135M's config.json (tied 49,152-token vocabulary, 2,048-token context): a model users import
SMOL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
}


@pytest.mark.slow
@pytest.mark.multiproc  # calibrate in a process of its own (its peak RSS), which starts the restart probes
def test_a_135m_model_is_timed_at_what_the_machine_does_in_a_second(tmp_path):
    """Calibrating for an imported 135M model took 345 s and 8.9 GB: its forward + backward
    was timed at the config's own micro-batch 16 x 2,048 tokens (the continued-pretraining defaults),
    three times after a warm-up, where one call's fp32 logits alone are 16 * 2048 * 49152 * 4 bytes
    (6.4 GB). Now it is timed at the largest size the tables measured before it put under CALL_S
    (on this 2-core CPU a few dozen tokens), so the process stays far below those logits (the OS's
    peak RSS is the reference), and the rows the planner reads say which sizes were timed."""
    from tests.train.test_preflight import max_rss_of

    hf = tmp_path / "smol"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(SMOL))
    out = tmp_path / "hw.toml"
    cmd = [sys.executable, "-m", "flopwise", "hardware", "calibrate", f'model.init_from="hf:{hf}"', "--nproc", "1"]
    r, peak = max_rss_of([*cmd, "--out", str(out)], tmp_path, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    logits = 16 * 2048 * 49152 * 4
    assert peak < logits / 2, peak  # the old sizes needed those logits and more: 8.9 GB measured
    cal = load_catalogue(out)["cpu"].calibration
    tokens = sorted(row[1] / (ACT_BYTES * 576) for row in cal.elementwise)  # one activation: tokens x d_model
    assert tokens[-1] < 16 * 2048 and all(a == b / 2 for a, b in itertools.pairwise(tokens)), tokens  # halves


def test_a_busy_machine_is_said_before_timing(monkeypatch):
    """calibrate and plan measure warn when the 1-minute load average reaches the core count
    (another process holds the cores; what they time is then slower than the machine)."""
    from flopwise.hardware.catalogue import busy_note

    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (cores + 0.5, 1.0, 1.0))
    assert f"load average {cores + 0.5:.1f} on {cores} cores" in busy_note("the tables")
    monkeypatch.setattr(os, "getloadavg", lambda: (cores - 0.5, 9.0, 9.0))
    assert busy_note("the tables") is None


@pytest.mark.parametrize("bf16_instructions, native", [(True, "bf16"), (False, "fp32")])
def test_calibration_measures_the_dtype_runs_here_train_in(monkeypatch, bf16_instructions, native):
    """train.dtype=auto is what a run here trains in (train.build: bf16 with AMX or AVX512-BF16, fp32
    on an AVX2 EPYC or a laptop), so that is what calibrate measures; a dtype given is measured."""
    import torch

    from flopwise.hardware.catalogue import CATALOGUE, auto_dtype
    from flopwise.measure import calibrate

    monkeypatch.setattr(calibrate, "cpu_multiplies_bf16", lambda cpuinfo=None: bf16_instructions)
    monkeypatch.setattr("flopwise.hardware.catalogue.cpu_multiplies_bf16", lambda cpuinfo=None: bf16_instructions)
    cpu = torch.device("cpu")
    assert calibrate.calibration_config("demo", TINY, cpu).train.dtype == native == auto_dtype(CATALOGUE["cpu"])
    assert calibrate.calibration_config("demo", [*TINY, 'train.dtype="fp32"'], cpu).train.dtype == "fp32"
    assert calibrate.calibration_config("demo", TINY, torch.device("cuda")).train.dtype == "bf16"


def test_an_fp32_calibration_is_planned_against_its_fp32_peak(tmp_path, cli):
    """An entry measured in fp32 (a CPU without bf16 instructions) has no 16-bit peak: the planner
    states its tables, time and MFU against the fp32 peak it measured, and train.dtype=auto on it is
    fp32 (what it was measured in)."""
    from dataclasses import replace

    from flopwise.hardware.calibration import Calibration
    from flopwise.hardware.catalogue import auto_dtype

    cal = Calibration(
        dtype="fp32",
        gemm=((512.0, 512.0, 512.0, 0.5),),
        attention=((256.0, 64.0, 0.25, 0.25),),
        elementwise=((1.0, 1e6, 2e9),),
        optimizer=((1e6, 0.01),),
        threads=1,
    )
    hw = replace(CATALOGUE["cpu"], peak_flops={"fp32": 1e11}, memory_bytes=16 * 2.0**30, memory_bw=1e10)
    hw = replace(hw, intra_node_bw=1e10, inter_node_bw=1e10, calibration=cal)
    assert hw.peak_16bit == 1e11 and auto_dtype(hw) == "fp32"
    assert replace(hw, calibration=None).peak_16bit is None  # an uncalibrated fp32 figure is not planned against
    save_hardware(hw, tmp_path / "hw.toml")
    r = cli("plan", "demo", *TINY, f'cluster.hardware_file="{tmp_path / "hw.toml"}"', "--json", "--top", "1")
    assert r.returncode == 0, r.stderr
    best = json.loads(r.stdout)["layouts"][0]
    assert best["step_time_s"] > 0 and 0 < best["mfu"] <= 0.5  # no product faster than half the fp32 peak


def test_a_slow_peak_shrinks_the_products_calibrate_times():
    """The GEMM sizes follow the peak measured first: on a CPU that multiplies bf16 at 1.4 GFLOP/s
    (an AVX2 EPYC) no product takes more than ~0.1 s of it, where the fixed size alone took ~14 s;
    a fast one keeps the fixed per-thread limit (the grid and the model's own shapes)."""
    import torch

    from flopwise.measure.calibrate import calibration_config, steps_of, sweep

    cpu = torch.device("cpu")
    cfg = calibration_config("demo", [*TINY, 'train.dtype="bf16"'], cpu)
    slow, fast = sweep(cfg, 2, cpu, 1.4e9), sweep(cfg, 2, cpu, 1e15)
    assert (
        max(2 * m * n * k for m, n, k in slow["gemms"]) / 1.4e9
        <= 0.1
        < max(2 * m * n * k for m, n, k in fast["gemms"]) / 1.4e9
    )
    assert set(slow["gemms"]) < set(fast["gemms"]) and steps_of(cfg, 2, cpu, 1.4e9) < steps_of(cfg, 2, cpu, 1e15)


def test_bf16_on_a_cpu_without_bf16_instructions_is_refused_before_anything_is_measured(monkeypatch, tmp_path, cli):
    """On an AVX2 EPYC (2026-12-07) the bf16 tables came out below the fp32 work beside them (square
    products 1.4 GFLOP/s, the planned MFU of the demo from them 1.7): train.dtype=bf16 there is
    refused in one line, nothing written (auto measures fp32, above)."""
    from flopwise.hardware import catalogue as hardware
    from flopwise.measure import calibrate

    monkeypatch.setattr(calibrate, "cpu_multiplies_bf16", lambda cpuinfo=None: False)
    monkeypatch.setattr(hardware, "busy_note", lambda what: pytest.fail("the load looked at before refusing"))
    monkeypatch.setattr(calibrate, "measure_matmul_peak", lambda *a, **k: pytest.fail("measured before refusing"))
    out = str(tmp_path / "hw.toml")
    r = cli("hardware", "calibrate", 'train.dtype="bf16"', "--device", "cpu", "--out", out, cwd=tmp_path)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "train.dtype=bf16: this CPU has no bf16 matrix instructions (AMX or AVX512-BF16)" in r.stderr
    assert not (tmp_path / "hw.toml").exists()


def test_serving_products_are_measured_and_a_decode_steps_cold():
    """`plan serve` reads a decode step's products (serve.batch rows, 1/4/16 unset) and a prefill's
    (serve.prompt_tokens rows), which no training shape reaches; the decode rows are the ones timed
    cold (each weight read from memory, as a decode step reads it)."""
    import torch

    from flopwise.measure.calibrate import calibration_config, decode_rows, sweep

    cpu = torch.device("cpu")
    cfg = calibration_config("demo", [*TINY, "serve.batch=3", "serve.prompt_tokens=40"], cpu)
    rows = {m for m, _, _ in sweep(cfg, 2, cpu, 1e12)["gemms"]}
    assert decode_rows(cfg) == {3} and {3, 40} <= rows
    assert decode_rows(calibration_config("demo", TINY, cpu)) == {1, 4, 16}
