"""Multi-process equivalence on CPU/gloo: every layout's per-step losses equal one process's.

Each torchrun launch runs many layouts (tests/dist/worker.py); the single-process references run
in this process. fp32 throughout, so the tolerance is 1e-5 relative (reduction order only).
"""

import os
import subprocess
import sys

import pytest
import torch

from flopwise.checkpoints import checkpoint
from flopwise.config.schema import load_config
from flopwise.errors import CheckpointError
from flopwise.flops import count_params
from flopwise.layout.rules import Layout
from flopwise.parallel.mesh import Parallel
from flopwise.plan.comm import dp_elements_per_step, pp_boundary_elements, tp_allreduce_elements
from flopwise.plan.memory import model_state_bytes
from flopwise.train.build import build_engine
from flopwise.train.launch import train
from tests.conftest import run_jobs, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
STEPS = 3


def base(run_dir, data, **extra) -> list[str]:
    """A 4-layer untied Llama (so pp2 × 2 virtual stages fits) on 8 × 32-token sequences."""
    kw = {
        "model.n_layers": 4,
        "model.tie_embeddings": "false",
        "train.steps": STEPS,
        "train.micro_batch": 2,
        "train.eval_every": 0,
        "checkpoint.interval": 0,
        "train.eval_batches": 1,
    }
    kw.update(extra)
    return tiny_overrides(run_dir, data, **kw)


LAYOUTS = {
    2: {
        "dp2-zero0": {"parallel.zero": 0},
        "dp2-zero1": {"parallel.zero": 1},
        "dp2-zero2": {"parallel.zero": 2},
        "dp2-zero3": {"parallel.zero": 3},
        "tp2": {"parallel.tp": 2},
        "tp2-sp": {"parallel.tp": 2, "parallel.sequence_parallel": "true"},
        "pp2-gpipe": {"parallel.pp": 2, "parallel.pp_schedule": '"gpipe"'},
        "pp2-1f1b": {"parallel.pp": 2, "parallel.pp_schedule": '"1f1b"'},
        "pp2-interleaved-v2": {
            "parallel.pp": 2,
            "parallel.pp_schedule": '"interleaved-1f1b"',
            "parallel.virtual_stages": 2,
        },
        "pp2-zero-bubble": {"parallel.pp": 2, "parallel.pp_schedule": '"zero-bubble"', "parallel.virtual_stages": 2},
        "pp2-dualpipev": {"parallel.pp": 2, "parallel.pp_schedule": '"dualpipev"', "parallel.virtual_stages": 2},
        "cp2": {"parallel.cp": 2},
        "dp2-zero3-recompute-full": {"parallel.zero": 3, "parallel.recompute": '"full"'},
        "tp2-sp-recompute-selective": {
            "parallel.tp": 2,
            "parallel.sequence_parallel": "true",
            "parallel.recompute": '"selective"',
        },
        "pp2-1f1b-recompute-full": {"parallel.pp": 2, "parallel.recompute": '"full"'},
        "dp2-zero3-compile": {"parallel.zero": 3, "train.compile": "true"},  # per-block compile under FSDP2
        # the chunked head + loss (Transformer.head_loss) under FSDP2, vocab-parallel and a pipeline's last stage
        "dp2-zero3-loss-chunks": {"parallel.zero": 3, "train.loss_chunk_tokens": 24},
        "tp2-sp-loss-chunks": {"parallel.tp": 2, "parallel.sequence_parallel": "true", "train.loss_chunk_tokens": 24},
        "pp2-interleaved-loss-chunks": {
            "parallel.pp": 2,
            "parallel.pp_schedule": '"interleaved-1f1b"',
            "parallel.virtual_stages": 2,
            "train.loss_chunk_tokens": 24,
        },
    },
    4: {
        "hsdp2x2": {"parallel.zero": 3, "parallel.dp_replicate": 2},
        "tp2xdp2": {"parallel.tp": 2, "parallel.zero": 3, "parallel.sequence_parallel": "true"},
        "tp2xdp2-zero0": {"parallel.tp": 2, "parallel.zero": 0},  # FSDP2's replicate, not DDP
        "cp2xdp2": {"parallel.cp": 2, "parallel.zero": 3},
        # the engine hands a later stage its span: 1/tp of the sequence arrives, or a cp shard
        "pp2xtp2-sp": {"parallel.pp": 2, "parallel.tp": 2, "parallel.sequence_parallel": "true"},
        "pp2xcp2": {"parallel.pp": 2, "parallel.cp": 2},
        "pp2xtp2-sp-loss-chunks": {
            "parallel.pp": 2,
            "parallel.tp": 2,
            "parallel.sequence_parallel": "true",
            "train.loss_chunk_tokens": 24,
        },
    },
    8: {
        "pp2xtp2xdp2": {"parallel.pp": 2, "parallel.tp": 2, "parallel.zero": 3},
        "pp2xtp2xdp2-zero0": {"parallel.pp": 2, "parallel.tp": 2, "parallel.zero": 0},
    },
}


# bf16: FSDP2's policy (bf16 parameters, fp32 reduce and master weights) and DDP under autocast
# against one process under autocast; the stated tolerance is 1e-3 relative (measured: ≤ 4e-5).
BF16 = {"dp2-zero0-bf16": {"parallel.zero": 0}, "dp2-zero3-bf16": {"parallel.zero": 3}}
MEMORY_MODEL = {
    "model.n_layers": 8,
    "model.ffn_dim": 768,
}  # no tensor a large share, so ZeRO-1's per-tensor split balances
COMM = {
    "comm-zero0": {"parallel.zero": 0},
    "comm-zero1": {"parallel.zero": 1},
    "comm-zero2": {"parallel.zero": 2},
    "comm-zero3": {"parallel.zero": 3},
    "comm-tp2": {"parallel.tp": 2},
    "comm-tp2-sp": {"parallel.tp": 2, "parallel.sequence_parallel": "true"},
    "comm-pp2": {"parallel.pp": 2},
}
# parallel.layout=auto: the planner picks the layout for the world size (planning for H100s), the
# engine runs it, and the losses are one process's. Two families: GQA Llama and MHA GPT-2.
MHA = {
    "model.preset": '"gpt2-124m"',
    "model.n_layers": 4,
    "model.d_model": 64,
    "model.n_heads": 4,
    "model.n_kv_heads": 4,
    "model.ffn_dim": 256,
    "model.vocab_size": 512,
    "model.max_seq_len": 128,
    "model.tie_embeddings": "false",
}
AUTO = {"parallel.layout": '"auto"', "cluster.hardware": '"h100-sxm"'}
CHAIN_STEPS = 5  # zero3·dp4 steps 1-2 -> tp2·dp2 step 3 -> pp2·tp2·dp2 step 4 -> one process step 5


MIX_LAYOUTS = {"dp2-zero3": {"parallel.zero": 3}, "pp2": {"parallel.pp": 2}}
# data.document_mask under every kind of split: documents ids travel to each pipeline stage and
# are indexed by each context-parallel rank's true positions
MASK = {"data.document_mask": "true", "data.reset_positions": "true"}
MASK_LAYOUTS = {
    "dp2-zero3": {"parallel.zero": 3},
    "tp2-sp": {"parallel.tp": 2, "parallel.sequence_parallel": "true"},
    "cp2": {"parallel.cp": 2},
    "pp2-1f1b": {"parallel.pp": 2, "parallel.pp_schedule": '"1f1b"'},
    "pp2-interleaved": {"parallel.pp": 2, "parallel.pp_schedule": '"interleaved-1f1b"', "parallel.virtual_stages": 2},
}
# ALiBi: each tensor-parallel rank attends with its own heads' slopes (a head-sharded buffer), each
# context-parallel rank with its queries' true distances to the gathered keys
ALIBI = {"model.pos": '"alibi"'}
ALIBI_LAYOUTS = {
    2: {
        "tp2": {"parallel.tp": 2},
        "tp2-sp": {"parallel.tp": 2, "parallel.sequence_parallel": "true"},
        "cp2": {"parallel.cp": 2},
    },
    4: {"cp2xtp2": {"parallel.cp": 2, "parallel.tp": 2}},
}


@pytest.fixture(scope="module")
def runs(tiny_data, tiny_mix, tiny_docs, tmp_path_factory) -> dict:
    """All launches, in order (the resharding chain runs through them); results by job name."""
    tmp = tmp_path_factory.mktemp("dist")
    chain = tmp / "chain"

    def job(name, kind, **extra):
        return {"name": name, "kind": kind, "overrides": base(tmp / name, tiny_data, **extra)}

    def chain_job(name, stop, **extra):
        return {
            "name": name,
            "kind": "losses",
            "overrides": base(
                chain,
                tiny_data,
                **{
                    "train.steps": CHAIN_STEPS,
                    "train.stop_after": stop,
                    "checkpoint.interval": 1,
                    "checkpoint.keep": 10,
                    **extra,
                },
            ),
        }

    def reshard_job(name, **extra):
        return {
            "name": name,
            "kind": "reshard",
            "overrides": base(
                tmp / name, tiny_data, **{"checkpoint.resume": f'"{chain / "checkpoints" / "step-00000002"}"', **extra}
            ),
        }

    def mix_jobs(name, **extra):
        """A data mixture run whole, and the same run stopped after step 2 and resumed."""
        kw = {"data.sources": tiny_mix, "train.steps": 4, "checkpoint.interval": 1, **extra}
        return [
            job(f"mix-{name}-full", "losses", **kw),
            {
                "name": f"mix-{name}-part",
                "kind": "losses",
                "overrides": base(tmp / f"mix-{name}-cut", tiny_data, **{**kw, "train.stop_after": 2}),
            },
            {"name": f"mix-{name}-rest", "kind": "losses", "overrides": base(tmp / f"mix-{name}-cut", tiny_data, **kw)},
        ]

    launches = {
        2: [job(n, "losses", **x) for n, x in LAYOUTS[2].items()]
        + [j for n, x in MIX_LAYOUTS.items() for j in mix_jobs(n, **x)]
        + [
            {"name": f"mask-{n}", "kind": "losses", "overrides": base(tmp / f"mask-{n}", tiny_docs, **x, **MASK)}
            for n, x in MASK_LAYOUTS.items()
        ]
        + [job(f"alibi-{n}", "losses", **x, **ALIBI) for n, x in ALIBI_LAYOUTS[2].items()]
        + [job(n, "losses", **x, **{"train.dtype": '"bf16"'}) for n, x in BF16.items()]
        + [
            job(f"memory-zero{z}", "memory", **MEMORY_MODEL, **{"parallel.zero": z, "train.micro_batch": 4})
            for z in range(4)
        ]
        + [
            job(
                n,
                "comm",
                **x,
                **{"train.micro_batch": 4 if "pp" not in n else 2, "train.global_batch": 8 if "tp" not in n else 4},
            )
            for n, x in COMM.items()
        ],
        4: [job(n, "losses", **x) for n, x in LAYOUTS[4].items()]
        + [job(f"alibi-{n}", "losses", **x, **ALIBI) for n, x in ALIBI_LAYOUTS[4].items()]
        + [job("auto4-gqa", "losses", **AUTO), job("auto4-mha", "losses", **AUTO, **MHA)]
        + [
            chain_job("chain-zero3-dp4", 2, **{"parallel.zero": 3}),
            chain_job("chain-tp2-dp2", 3, **{"parallel.tp": 2, "parallel.zero": 3}),
            reshard_job("reshard-tp2-dp2", **{"parallel.tp": 2, "parallel.zero": 3}),
        ],
        8: [job(n, "losses", **x) for n, x in LAYOUTS[8].items()]
        + [job("auto8-gqa", "losses", **AUTO), job("auto8-mha", "losses", **AUTO, **MHA)]
        + [
            chain_job("chain-pp2-tp2-dp2", 4, **{"parallel.pp": 2, "parallel.tp": 2, "parallel.zero": 3}),
            reshard_job("reshard-pp2-tp2-dp2", **{"parallel.pp": 2, "parallel.tp": 2, "parallel.zero": 3}),
        ],
    }
    results = {"_chain": chain, "_tmp": tmp}
    for world, jobs in launches.items():
        results.update(run_jobs(world, jobs, tmp))
    return results


def single(run_dir, data, **extra):
    return train(load_config(None, base(run_dir, data, **extra)))


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> list[float]:
    return single(tmp_path_factory.mktemp("ref"), tiny_data).losses


@pytest.mark.parametrize("name", [n for w in sorted(LAYOUTS) for n in LAYOUTS[w]])
def test_layout_matches_single_process(name, runs, reference):
    """fp32: the per-step losses of every layout equal one process's within 1e-5 relative."""
    assert runs[name]["losses"] == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("world", [4, 8])
def test_auto_layout_trains_and_matches_single_process(world, runs, reference, tiny_data, tmp_path):
    """parallel.layout=auto on 4 and 8 ranks, for a GQA and an MHA model: the planner's choice
    passes the engine's checks, trains, and reproduces one process's losses."""
    assert runs[f"auto{world}-gqa"]["losses"] == pytest.approx(reference, rel=1e-5)
    mha = single(tmp_path, tiny_data, **MHA).losses
    assert runs[f"auto{world}-mha"]["losses"] == pytest.approx(mha, rel=1e-5)


@pytest.mark.parametrize("name", list(BF16))
def test_bf16_layout_matches_single_process(name, runs, tiny_data, tmp_path):
    ref = single(tmp_path, tiny_data, **{"train.dtype": '"bf16"'}).losses
    assert runs[name]["losses"] == pytest.approx(ref, rel=1e-3)


@pytest.mark.parametrize("zero", range(4))
def test_model_state_bytes_match_zero_formulas(zero, runs):
    """Parameters, gradients and Adam moments per rank = the ZeRO paper's sharded forms (fp32: 4Ψ
    params, 4Ψ grads, K = 8 for the two moments), the function the planner uses, within 5%."""
    r = runs[f"memory-zero{zero}"]
    want = model_state_bytes(r["psi"], zero, shard=2, k=8, param_bytes=4, grad_bytes=4)
    for rank in r["ranks"]:
        assert rank["params"] == pytest.approx(want.params, rel=0.05)
        assert rank["grads"] == pytest.approx(want.grads, rel=0.05)
        assert rank["optimizer"] == pytest.approx(want.optimizer, rel=0.05)
    assert sum(x["optimizer"] for x in r["ranks"]) == pytest.approx(8 * r["psi"] * (1 if zero else 2), rel=1e-3)


def _psi(tiny_data) -> int:
    return count_params(load_config(None, base("/tmp", tiny_data)).model).total


@pytest.mark.parametrize("zero", range(4))
def test_data_parallel_traffic_matches_zero(zero, runs, tiny_data):
    """One step's data-parallel collectives move the ZeRO paper's 2Ψ (stages 0-2) or 3Ψ (stage 3),
    counting an all-reduce as 2× its buffer (reduce-scatter + all-gather)."""
    r = runs[f"comm-zero{zero}"]
    psi = _psi(tiny_data)
    grads_allreduced = sum(n for n in r["sizes"].get("all_reduce", []) if n > 1)  # not the loss/norm scalars
    volume = 2 * grads_allreduced + r["elements"].get("all_gather", 0) + r["elements"].get("reduce_scatter", 0)
    assert volume == pytest.approx(dp_elements_per_step(psi, zero), rel=1e-3)
    # torch's ZeRO-1 keeps DDP's all-reduce and then broadcasts each rank's updated parameters: +Ψ.
    assert r["elements"].get("broadcast", 0) == (psi if zero == 1 else 0)


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_traffic_matches_megatron(sp, runs, tiny_data):
    """4 all-reduces of b·s·h per layer per micro-batch (reduce-scatter + all-gather pairs under
    sequence parallel), plus the embedding's forward and the head's input-gradient reductions."""
    r = runs["comm-tp2-sp" if sp else "comm-tp2"]
    m = load_config(None, base("/tmp", tiny_data)).model
    bsh = 4 * 32 * m.d_model
    per_layer = tp_allreduce_elements(32, 4, m.d_model, m.n_layers) / bsh
    kinds = ("reduce_scatter", "all_gather") if sp else ("all_reduce",)
    for kind in kinds:
        assert r["sizes"][kind].count(bsh) == per_layer + 2 == len(r["sizes"][kind])


def test_pipeline_traffic_is_one_activation_per_microbatch(runs, tiny_data):
    """Stage 0 sends b·s·h activations and receives b·s·h gradients once per micro-batch."""
    r = runs["comm-pp2"]
    m = load_config(None, base("/tmp", tiny_data)).model
    bsh = pp_boundary_elements(32, 2, m.d_model)
    n_micro = 8 // 2
    assert r["sizes"]["send"].count(bsh) == n_micro and r["sizes"]["recv"].count(bsh) == n_micro


def _state(ckpt, data) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of a checkpoint, loaded into one process."""
    cfg = load_config(None, base("/tmp", data))
    engine, opt = build_engine(cfg, Parallel(Layout(micro_batch=2), None, torch.device("cpu")))
    checkpoint.load(checkpoint.resolve(ckpt), engine.parts, opt)
    out = {f"model.{k}": v for k, v in engine.parts[0].state_dict().items()}
    for name, p in engine.parts[0].named_parameters():
        out.update({f"optim.{name}.{k}": v for k, v in opt.state[p].items()})
    return out


def test_resharding_chain_continues_the_run(runs, reference, tiny_data, tmp_path):
    """zero3·dp4 -> tp2·dp2 -> pp2·tp2·dp2 -> one process, resuming the same run dir each time:
    every step's loss equals the uninterrupted single process (no batch repeated or skipped while
    dp goes 4 -> 2 -> 2 -> 1), and the exported checkpoint resumes too."""
    full = single(tmp_path / "full", tiny_data, **{"train.steps": CHAIN_STEPS}).losses
    chain = runs["_chain"]
    got = runs["chain-zero3-dp4"]["losses"] + runs["chain-tp2-dp2"]["losses"] + runs["chain-pp2-tp2-dp2"]["losses"]
    last = single(chain, tiny_data, **{"train.steps": CHAIN_STEPS, "checkpoint.keep": 10}).losses
    assert got + last == pytest.approx(full, rel=1e-5)


@pytest.mark.parametrize("name", MIX_LAYOUTS)
def test_mixture_resume_is_bitwise_under_the_layout(name, runs, tiny_data, tiny_mix, tmp_path):
    """A two-source mixture stopped after step 2 and resumed gives the uninterrupted run's losses
    bit for bit, and both equal one process's."""
    full = runs[f"mix-{name}-full"]["losses"]
    assert runs[f"mix-{name}-part"]["losses"] + runs[f"mix-{name}-rest"]["losses"] == full
    one = single(tmp_path, tiny_data, **{"data.sources": tiny_mix, "train.steps": 4}).losses
    assert full == pytest.approx(one, rel=1e-5)


@pytest.fixture(scope="module")
def masked_reference(tiny_docs, tmp_path_factory) -> list[float]:
    return single(tmp_path_factory.mktemp("masked"), tiny_docs, **MASK).losses


@pytest.mark.parametrize("name", MASK_LAYOUTS)
def test_document_mask_layout_matches_single_process(name, runs, masked_reference, tiny_docs, tmp_path):
    assert runs[f"mask-{name}"]["losses"] == pytest.approx(masked_reference, rel=1e-5)
    unmasked = single(tmp_path, tiny_docs).losses  # the data has boundaries in its windows: the mask matters
    assert unmasked != pytest.approx(masked_reference, rel=1e-5)


@pytest.fixture(scope="module")
def alibi_reference(tiny_data, tmp_path_factory) -> list[float]:
    return single(tmp_path_factory.mktemp("alibi"), tiny_data, **ALIBI).losses


@pytest.mark.parametrize("name", [n for w in sorted(ALIBI_LAYOUTS) for n in ALIBI_LAYOUTS[w]])
def test_alibi_layout_matches_single_process(name, runs, alibi_reference):
    assert runs[f"alibi-{name}"]["losses"] == pytest.approx(alibi_reference, rel=1e-5)


@pytest.mark.parametrize("layout", ["tp2-dp2", "pp2-tp2-dp2"])
def test_resharded_state_is_exactly_equal(layout, runs, tiny_data):
    """A checkpoint loaded into another layout and written back holds bit-identical model and
    optimizer state."""
    runs[f"reshard-{layout}"]
    src = _state(runs["_chain"] / "checkpoints" / "step-00000002", tiny_data)
    back = _state(runs["_tmp"] / f"reshard-{layout}", tiny_data)
    assert src.keys() == back.keys() and any(k.endswith("exp_avg") for k in src)
    assert all(torch.equal(src[k], back[k]) for k in src)


def test_export_consolidates_and_refuses_a_mismatched_model(runs, tiny_data, tmp_path):
    ckpt = runs["_chain"] / "checkpoints" / "step-00000002"
    r = subprocess.run(
        [sys.executable, "-m", "flopwise", "checkpoint", "export", str(ckpt), "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    src, out = _state(ckpt, tiny_data), _state(tmp_path / "x", tiny_data)
    assert all(torch.equal(src[k], out[k]) for k in src)
    state = checkpoint.read_state(checkpoint.resolve(tmp_path / "x"))
    assert state["layout"]["world_size"] == 1 and state["step"] == 2
    cfg = load_config(None, base("/tmp", tiny_data, **{"model.d_model": 32}))
    engine, opt = build_engine(cfg, Parallel(Layout(micro_batch=2), None, torch.device("cpu")))
    with pytest.raises(CheckpointError, match="does not fit this model/layout"):
        checkpoint.load(ckpt, engine.parts, opt)


def test_flopwise_train_under_torchrun(tiny_data, tmp_path):
    """The CLI itself as a 2-rank job: rank 0 alone reports, each rank writes its own shard."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "flopwise",
            "train",
            *base(tmp_path, tiny_data, **{"parallel.zero": 3}),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("run summary") == 1 and "layout dp2 zero3 on 2 processes (gloo)" in r.stdout
    ckpt = checkpoint.latest(tmp_path)
    assert ckpt.name == f"step-{STEPS:08d}" and len(list(ckpt.glob("*.distcp"))) == 2
