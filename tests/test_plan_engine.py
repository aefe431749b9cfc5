"""The planner's `flopwise` stack against the engine it describes (CPU, gloo, torchrun).

Per rank, the bytes of parameters, gradients and optimizer state the engine holds equal what the
planner books for that rank exactly (its own stage split, tensor-parallel slices and ZeRO shares,
computed from the config alone), and a step's data-parallel collectives move exactly the planner's
volumes. The reference is the engine, measured; the planner never sees it.
"""

import pytest

from conftest import tiny_overrides
from flopwise.config import load_config
from flopwise.flops import count_params
from flopwise.hardware import get_hardware
from flopwise.parallel.mesh import layout_of
from flopwise.plan.comm import dp_collectives
from flopwise.plan.layout import stage_ids, stage_sizes
from flopwise.plan.memory import rank_model_states
from flopwise.plan.perf import evaluate
from test_scale_true import torchrun

pytestmark = pytest.mark.slow

FAMILIES = {
    "gqa": {"model.n_layers": 4, "model.tie_embeddings": "false"},  # demo-tiny: Llama, 4 heads, 2 kv heads
    "mha": {"model.preset": '"gpt2-124m"', "model.n_layers": 4, "model.d_model": 64, "model.n_heads": 4,
            "model.n_kv_heads": 4, "model.ffn_dim": 256, "model.vocab_size": 512, "model.max_seq_len": 128,
            "model.tie_embeddings": "false"},
}
LAYOUTS = {
    "dp4-zero0": {"parallel.zero": 0}, "dp4-zero1": {"parallel.zero": 1}, "dp4-zero2": {"parallel.zero": 2},
    "dp4-zero3": {"parallel.zero": 3}, "hsdp2x2": {"parallel.zero": 3, "parallel.dp_replicate": 2},
    "tp2xdp2-zero3": {"parallel.tp": 2, "parallel.zero": 3},
    "tp2xpp2": {"parallel.tp": 2, "parallel.pp": 2},
    "cp2xdp2-zero2": {"parallel.cp": 2, "parallel.zero": 2}, "cp2xtp2-zero2": {"parallel.cp": 2, "parallel.tp": 2, "parallel.zero": 2},
    "pp2xdp2-zero1": {"parallel.pp": 2, "parallel.zero": 1},
    "pp2xdp2-interleaved-zero3": {"parallel.pp": 2, "parallel.zero": 3, "parallel.pp_schedule": '"interleaved-1f1b"',
                                  "parallel.virtual_stages": 2},
    "pp2xdp2-zbv-zero2": {"parallel.pp": 2, "parallel.zero": 2, "parallel.pp_schedule": '"zero-bubble"',
                          "parallel.virtual_stages": 2},
    "dp4-zero1-recompute": {"parallel.zero": 1, "parallel.recompute": '"full"'},
}


def _overrides(tmp, data, family, layout):
    return tiny_overrides(tmp / f"{family}-{layout}", data, **{**FAMILIES[family], **LAYOUTS[layout],
                          "train.micro_batch": 1, "train.global_batch": 8})


@pytest.fixture(scope="module")
def measured(tiny_data, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("plan_engine")
    jobs = [{"name": f"{f}-{lo}", "kind": "states", "overrides": _overrides(tmp, tiny_data, f, lo)}
            for f in FAMILIES for lo in LAYOUTS]
    jobs += [{"name": f"comm-zero{z}", "kind": "comm", "overrides": tiny_overrides(tmp / f"comm{z}", tiny_data, **{
        "parallel.zero": z, "train.micro_batch": 1, "train.global_batch": 8})} for z in range(4)]
    return {"_tmp": tmp, **torchrun(4, jobs, tmp, 29621)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rank_model_states_equal_the_engines_bytes(family, layout, measured, tiny_data):
    cfg = load_config(None, _overrides(measured["_tmp"], tiny_data, family, layout))
    lo = layout_of(cfg, 4)
    sizes = stage_sizes(cfg.model, lo, pp_layers=cfg.parallel.pp_layers)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for r in measured[f"{family}-{layout}"]["ranks"]:
        ids = stage_ids(r["pp_rank"], lo)
        layers = sorted(i for s in ids for i in range(starts[s], starts[s] + sizes[s]))
        assert layers == r["layers"]
        want = rank_model_states(cfg.model, lo, layers, 0 in ids, lo.n_stages - 1 in ids,
                                 shard_rank=r["shard_rank"], dp_rank=r["dp_rank"])
        assert (r["params"], r["grads"], r["optimizer"]) == (want.params, want.grads, want.optimizer), r
    if lo.zero == 1:
        # The step model books the busiest dp rank's whole-tensor ZeRO-1 share (not Ψ/N): the largest
        # measured, of the pipeline rank whose memory it reports.
        est = evaluate(cfg.model, get_hardware("h100-sxm"), lo, cfg.data.seq_len, cfg.train.global_batch)
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
    equal plan.comm.dp_collectives for this engine (FSDP2 re-gathers for every micro-batch; torch's
    ZeRO-1 broadcasts the stepped parameters)."""
    r = measured[f"comm-zero{zero}"]
    cfg = load_config(None, tiny_overrides("/tmp", tiny_data))
    psi, n_micro = count_params(cfg.model).total, 2
    want: dict[str, float] = {}
    for c in dp_collectives(psi, zero, zero1_broadcast=True, gather_per_micro=True):
        kind = "broadcast" if (zero == 1 and c.kind == "all_gather") else c.kind
        want[kind] = want.get(kind, 0) + c.elements * (n_micro if c.when == "micro" else 1)
    got = {k: sum(n for n in v if n > 1) for k, v in r["sizes"].items()}  # not the loss/norm/flag scalars
    assert {k: v for k, v in got.items() if v} == want
