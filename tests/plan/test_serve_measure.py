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
