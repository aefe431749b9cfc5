"""`flopwise plan serve --measure`: the planned workload generated here, beside the plan. Timing
is not asserted (benchmarks/throughput/serve_cpu.md holds planned against measured); what is: the
measurement runs the stated regime on the plan's device and says what it ran, and what it cannot
run is one line."""

import json
import re

import pytest

from flopwise.config.schema import load_config
from flopwise.errors import ConfigError
from flopwise.measure.serve import measure_serve
from flopwise.plan.serve import plan_serve

TINY = ["model.preset=demo-tiny", "data.seq_len=64", "cluster.hardware=cpu", "cluster.gpus=1"]
REGIME = ["serve.batch=2", "serve.prompt_tokens=8", "serve.cached_tokens=4", "serve.output_tokens=5"]


def test_the_json_adds_the_measured_prefill_and_decode(cli):
    out = json.loads(cli("plan", "serve", *TINY, *REGIME, "--measure", "--json").stdout)
    measured = out["measured"]
    assert {"prefill_s", "decode_s_per_token"} <= set(measured)
    assert measured["prefill_s"] > 0 and measured["decode_s_per_token"] > 0
    assert (measured["device"], measured["batch"]) == ("cpu", 2)
    assert len(out["layouts"]) == 1 and (out["layouts"][0]["tp"], out["layouts"][0]["batch"]) == (1, 2)


def test_the_table_sets_measured_beside_planned(cli):
    out = cli("plan", "serve", *TINY, *REGIME, "--measure").stdout
    assert "measured here: cpu" in out and "decode (ms/token)" in out


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster.gpus=2"], "cluster.gpus=2: --measure runs one device here"),
        (["serve.weights_dtype=int8"], "serve.weights_dtype=int8: --measure runs 16-bit weights only"),
        (["serve.output_tokens=1"], "serve.output_tokens=1: --measure times decode steps"),
        (["cluster.hardware=h100-sxm"], "cluster.hardware=h100-sxm: --measure runs on this machine"),
        (["serve.batch=100000000"], "serve.batch=100000000: the plan says it does not fit here (needs"),
    ],
)
def test_what_cannot_run_here_is_one_line(overrides, message):
    cfg = load_config(None, [*TINY, *REGIME, *overrides])
    plan = plan_serve(cfg)
    with pytest.raises(ConfigError, match=re.escape(message)):
        measure_serve(cfg, plan.hardware, plan.layouts[0])


def test_an_unstated_batch_is_refused_with_the_plans_own():
    cfg = load_config(None, [*TINY, "serve.prompt_tokens=8", "serve.output_tokens=4"])
    plan = plan_serve(cfg)
    with pytest.raises(ConfigError, match=f"serve.batch: .*largest here: {plan.layouts[0].batch}"):
        measure_serve(cfg, plan.hardware, plan.layouts[0])


# a hand-written calibrated `cpu` entry (the format `hardware calibrate` writes), its per-layer
# decode overhead stated
CALIBRATED = """[{name}]
peak_flops = {{bf16 = 300e9}}
memory_bytes = 24e9
memory_bw = 20e9
intra_node_bw = 5e9
inter_node_bw = 5e9
devices_per_node = 1
source = "hand-written for tests/plan/test_serve_measure.py"

[{name}.calibration]
dtype = "bf16"
layer_overhead = {overhead}
gemm = [[1, 768, 768, 0.1], [16, 2304, 768, 0.3], [128, 3072, 768, 0.5]]
attention = [[128, 64, 0.2, 0.2]]
elementwise = [[1, 1e5, 5e9]]
optimizer = [[1e6, 0.01]]
"""


def _gpt2_decode(tmp_path, overhead: float, name: str = "cpu"):
    hw = tmp_path / f"{name}-{overhead}.toml"
    hw.write_text(CALIBRATED.format(overhead=overhead, name=name))
    cfg = load_config(
        None,
        ["model.preset=gpt2-124m", f"cluster.hardware={name}", "cluster.gpus=1", f'cluster.hardware_file="{hw}"']
        + ["serve.batch=4", "serve.prompt_tokens=128", "serve.output_tokens=16"],
    )
    return plan_serve(cfg).layouts[0]


def test_a_decode_step_pays_the_per_layer_overhead_the_calibration_measured(tmp_path):
    """On a CPU one core issues and runs every op in turn, so a decode step is its bound plus the
    engine's fixed work per layer the calibration measured: GPT-2's 12 layers × 2 ms = 24 ms more."""
    bare, paid = _gpt2_decode(tmp_path, 0.0), _gpt2_decode(tmp_path, 2e-3)
    assert paid.decode_terms["overhead"] == pytest.approx(12 * 2e-3)
    assert paid.decode_s_per_token - bare.decode_s_per_token == pytest.approx(12 * 2e-3)
    assert paid.decode_bound == bare.decode_bound != "overhead"  # added after the bound, not one of them
    assert paid.prefill_s == bare.prefill_s  # a prefill's element-wise table already holds its per-op cost


def test_on_a_gpu_the_overhead_is_a_bound_not_a_sum(tmp_path):
    """A GPU's host launches the next kernels while the device runs these: the overhead bounds the
    step (GPT-2's 12 layers × 1 s dominate) instead of adding to it (a small one changes nothing)."""
    slow, small = _gpt2_decode(tmp_path, 1.0, "gpu-x"), _gpt2_decode(tmp_path, 1e-9, "gpu-x")
    assert (slow.decode_bound, slow.decode_s_per_token) == ("overhead", pytest.approx(12.0))
    assert small.decode_bound != "overhead"
    assert small.decode_s_per_token == max(v for k, v in small.decode_terms.items() if k != "overhead")


def test_the_overhead_is_a_measurement_of_this_engine():
    """measure.serve.layer_overhead times a real decode step of the architecture at width 64: a
    positive, finite time per layer, that `hardware calibrate` records (calibration TOML round trip)."""
    import dataclasses
    import math

    import torch

    from flopwise.hardware.calibration import calibration_toml, parse_calibration
    from flopwise.hardware.catalogue import hopper_calibration
    from flopwise.measure.serve import layer_overhead

    cfg = load_config(None, TINY)
    seconds = layer_overhead(cfg.model, torch.device("cpu"), torch.float32)
    assert 0 < seconds < 1 and math.isfinite(seconds)
    cal = dataclasses.replace(hopper_calibration(3.35e12, "test"), layer_overhead=seconds)
    assert parse_calibration("t", calibration_toml(cal)).layer_overhead == seconds
