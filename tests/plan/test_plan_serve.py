"""`flopwise plan serve`: the serving plan's bytes against published architectures, its behaviour
(bounds, the largest batch, the latency target, the JSON), and PaLM 540B on TPU v4 against Pope
et al. 2022 ("Efficiently Scaling Transformer Inference", Table 2 and §1)."""

import json

import pytest

from flopwise.config.schema import load_config
from flopwise.plan.serve import plan_serve, serve_memory
from flopwise.plan.shape import model_shape

H100x8 = ["cluster.hardware=h100-sxm", "cluster.gpus=8"]
JSON_KEYS = {
    "tp",
    "pp",
    "batch",
    "fits",
    "memory_per_device_bytes",
    "prefill_s",
    "prefill_mfu",
    "decode_s_per_token",
    "decode_bound",
    "tokens_per_s",
    "cost_per_million_tokens",
}


def serve(*overrides: str):
    return plan_serve(load_config(None, list(overrides)))


def test_kv_cache_and_weights_are_the_published_architectures_bytes():
    """Llama 3 8B's KV cache is 128 KiB a token in 16 bits (32 layers × 8 kv heads × 128 dims × K and
    V × 2 bytes: the figure serving guides quote), its weights 8.03B parameters (the model card)."""
    cfg = load_config(None, ["model.preset=llama3-8b", "serve.prompt_tokens=1000", "serve.output_tokens=24"])
    sh = model_shape(cfg.model, 1024)
    one = serve_memory(sh, cfg.serve, tp=1, pp=1, batch=3)
    assert one["kv_cache"] == 3 * 1024 * 131072
    assert one["weights"] == pytest.approx(2 * 8.03e9, rel=0.005)
    int8 = serve_memory(sh, cfg.serve.model_copy(update={"weights_dtype": "int8"}), tp=1, pp=1, batch=3)
    assert int8["weights"] == pytest.approx(one["weights"] / 2)
    # tp 8 splits the 8 kv heads, tp 16 cannot: every rank keeps the head its queries read
    assert serve_memory(sh, cfg.serve, tp=8, pp=1, batch=3)["kv_cache"] == one["kv_cache"] / 8
    assert serve_memory(sh, cfg.serve, tp=16, pp=1, batch=3)["kv_cache"] == one["kv_cache"] / 8


def test_decode_is_memory_bound_at_batch_one_and_compute_bound_at_a_large_batch():
    small = serve("model.preset=llama3-8b", *H100x8, "serve.batch=1", "serve.prompt_tokens=128")
    assert {lay.decode_bound for lay in small.layouts if lay.pp == 1} <= {"memory", "communication"}
    big = serve(
        "model.preset=llama3-8b", *H100x8, "serve.batch=1024", "serve.prompt_tokens=16", "serve.output_tokens=16"
    )
    one = next(lay for lay in big.layouts if (lay.tp, lay.pp) == (1, 1))
    assert one.decode_bound == "compute"


def test_the_largest_batch_fits_and_one_more_does_not():
    plan = serve("model.preset=llama3-70b", *H100x8)
    usable = 0.9 * plan.hardware.memory_bytes
    sh = model_shape(plan.cfg.model, 1280)
    for lay in plan.layouts[:3]:
        assert lay.fits
        assert serve_memory(sh, plan.cfg.serve, lay.tp, lay.pp, lay.batch)["total"] <= usable
        assert serve_memory(sh, plan.cfg.serve, lay.tp, lay.pp, lay.batch + 1)["total"] > usable
    assert plan.layouts[0].gpu_hours_per_million == min(lay.gpu_hours_per_million for lay in plan.layouts if lay.fits)


def test_a_latency_target_caps_the_batch_and_disqualifies_slow_layouts():
    free = serve("model.preset=llama3-8b", *H100x8).layouts
    capped = serve("model.preset=llama3-8b", *H100x8, "serve.latency_ms=10").layouts
    for lay in capped:
        assert lay.fits == (lay.decode_s_per_token <= 0.010)
    same = {(a.tp, a.pp): a.batch for a in free}
    assert all(lay.batch <= same[lay.tp, lay.pp] for lay in capped)
    assert any(lay.batch < same[lay.tp, lay.pp] for lay in capped)


def test_the_json_has_the_documented_fields_and_a_price_gives_the_cost(cli):
    args = ["plan", "serve", "model.preset=llama3-8b", *H100x8, "--top", "2", "--json"]
    out = json.loads(cli(*args).stdout)
    assert [set(lay) for lay in out["layouts"]] == [JSON_KEYS, JSON_KEYS]
    assert out["layouts"][0]["cost_per_million_tokens"] is None
    priced = json.loads(cli(*args, "cluster.price_per_gpu_hour=2").stdout)["layouts"][0]
    doubled = json.loads(cli(*args, "cluster.price_per_gpu_hour=4").stdout)["layouts"][0]
    assert doubled["cost_per_million_tokens"] == pytest.approx(2 * priced["cost_per_million_tokens"])


def test_a_request_longer_than_the_model_is_one_line(cli):
    r = cli("plan", "serve", "model.preset=llama3-8b", "serve.prompt_tokens=9000")
    assert r.returncode == 2
    assert "serve.cached_tokens + prompt_tokens + output_tokens = 9256 exceeds model.max_seq_len=8192" in r.stderr
    assert "Traceback" not in r.stderr


# Pope et al. 2022, PaLM 540B on 64 TPU v4 chips, 2048-token context. Table 2: prefill of 2048
# tokens, decode of 64 (so model.max_seq_len=2112 here); low latency: batch 64, int8 weights, decode
# 1.82 s for 64 tokens (28.4 ms/token: the abstract's "29 ms"); high throughput: batch 512, bf16,
# prefill at 76% MFU. §1: one chat turn of 64 new tokens on 1,920 cached, 64 generated, int8, 1.9 s
# (taken as one conversation: batch 1). Tolerance: ±10%, as the training rows are held on
# throughput. Each row compares the planner's own answer among the layouts that fit: the fastest
# decode, the best prefill MFU, the fastest turn.
PALM = ["model.preset=palm-540b", "model.max_seq_len=2112", "cluster.hardware=tpu-v4", "cluster.gpus=64"]
TOLERANCE = 0.10
LOW_LATENCY = [
    *PALM,
    "serve.batch=64",
    "serve.prompt_tokens=2048",
    "serve.output_tokens=64",
    "serve.weights_dtype=int8",
]
# Every row misses, each slower than published, for reasons the planner states rather than tunes:
# 1. Layouts: flopwise plans Megatron tensor parallelism, which splits whole heads, so PaLM's 48
#    heads cap tp at 16 and 64 chips need pp = 4; each pipeline stage reads its weights once per
#    micro-batch, so a decode step reads 1/16 of the weights per chip, where Pope et al.'s 2D
#    weight-stationary layout over all 64 chips reads 1/64 (and shards the multi-query KV cache
#    by batch, where tp keeps a copy of the one kv head on every rank).
# 2. TPU v4's GEMM share of the peak is the A100's assumed 0.75 (catalogue: not measured on the
#    chip), below the 76% MFU Pope et al. reached end to end; and the planner books element-wise
#    work and tensor-parallel all-reduces after the matmuls, where XLA fuses the one into them and
#    Pope et al. overlap the other with them (their looped collective einsums).
# The gaps (2026-12-07): decode 41.0 ms against 28.4 (tp 16 x pp 4); prefill MFU 60.5% against 76%
# (tp 2 x pp 32: 118 layers 4 to the busiest of 32 stages, -8%; the pipeline's 543 slots for 512
# requests, -6%; element-wise, all-reduces and scores after the products, -5%); the chat turn 2.43 s
# against 1.9 (tp 16 x pp 2). docs/planning.md says what would close each and why it is not built.
MISSES = "flopwise's layouts cannot express Pope et al.'s 2D partitions (see the comment above)"


def _within(predicted: float, published: float) -> bool:
    return abs(predicted / published - 1) <= TOLERANCE


@pytest.mark.xfail(strict=True, reason=MISSES + ": 1")
def test_palm_low_batch_decode_latency_against_pope():
    fastest = min((lay for lay in serve(*LOW_LATENCY).layouts if lay.fits), key=lambda lay: lay.decode_s_per_token)
    assert _within(fastest.decode_s_per_token, 1.82 / 64)


@pytest.mark.xfail(strict=True, reason=MISSES + ": 2")
def test_palm_large_batch_prefill_mfu_against_pope():
    plan = serve(*PALM, "serve.batch=512", "serve.prompt_tokens=2048", "serve.output_tokens=64")
    assert _within(max(lay.prefill_mfu for lay in plan.layouts if lay.fits), 0.76)


@pytest.mark.xfail(strict=True, reason=MISSES + ": 1 and 2")
def test_palm_chat_turn_against_pope():
    plan = serve(
        *PALM,
        "serve.batch=1",
        "serve.prompt_tokens=64",
        "serve.cached_tokens=1920",
        "serve.output_tokens=64",
        "serve.weights_dtype=int8",
    )
    turn = min(lay.prefill_s + 64 * lay.decode_s_per_token for lay in plan.layouts if lay.fits)
    assert _within(turn, 1.9)


def test_palm_rows_keep_pope_et_al_s_bounds():
    """What Pope et al. §2-3 say of the regimes holds in the plan: a low-batch decode step is bound by
    reading the weights (and int8 weights are faster than bf16 there), a large-batch prefill by
    compute (its MFU far above the decode's)."""
    low = serve(*LOW_LATENCY).layouts
    bf16 = {(a.tp, a.pp): a for a in serve(*LOW_LATENCY, "serve.weights_dtype=bf16").layouts}
    for lay in low:
        assert lay.decode_bound == "memory"
        assert lay.decode_s_per_token < bf16[lay.tp, lay.pp].decode_s_per_token
    big = serve(*PALM, "serve.batch=512", "serve.prompt_tokens=2048", "serve.output_tokens=64")
    best = max((lay for lay in big.layouts if lay.fits), key=lambda lay: lay.prefill_mfu)
    flops_decode = 2 * 540e9 * 512 / (best.decode_s_per_token * 64 * 275e12)
    assert best.prefill_mfu > 0.5 > 3 * flops_decode
