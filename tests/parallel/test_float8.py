"""float8 training (train.float8, torchao) on CPUs through torchao's emulation: the whole path a GPU
takes (conversion in `parallelize`, dynamic scaling, FSDP2's float8 all-gather) except the float8
matmul kernels. Training against bf16 (both runs real, same seed), where the float8 linears sit,
the device and torchao checks, composition with recompute and compile, FSDP2 and tensor parallel
(two ranks against one process), and the planner's bytes against SavedBytes' and PeakMemory's.
"""

import json
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")

from torchao.float8.float8_linear import Float8Linear

from flopwise.config.schema import ModelConfig, load_config, validate  # noqa: E402
from flopwise.errors import ConfigError  # noqa: E402
from flopwise.layout.linears import unconverted_linears  # noqa: E402
from flopwise.layout.rules import layout_of  # noqa: E402
from flopwise.measure.bytes import SavedBytes  # noqa: E402
from flopwise.model.transformer import build_model  # noqa: E402
from flopwise.parallel.apply import apply_compile, parallelize  # noqa: E402
from flopwise.parallel.mesh import Parallel  # noqa: E402
from flopwise.plan.memory import activation_bytes_per_layer, autocast_weight_copy_bytes, engine_precision  # noqa: E402
from flopwise.train.engine import autocast  # noqa: E402
from flopwise.train.launch import train  # noqa: E402
from tests.conftest import run_jobs, tiny_overrides  # noqa: E402

CPU = torch.device("cpu")
SEQ, BATCH = 64, 2


def run(tmp, data, **kw):
    base = {
        "train.dtype": '"bf16"',
        "train.steps": 20,
        "train.eval_every": 0,
        "checkpoint.interval": 0,
        "checkpoint.resume": '"none"',
        "log.every": 5,
    }
    return train(load_config(None, tiny_overrides(tmp, data, **{**base, **kw})))


def emulated(recipe: str) -> dict:
    return {"train.float8": f'"{recipe}"', "train.float8_emulate": "true"}


def parallelized(m: ModelConfig, recipe: str, **train_keys) -> nn.Module:
    """The one-process model `parallelize` builds for this model and train.float8 recipe, on a CPU."""
    cfg = validate({"model": m.model_dump(), "data": {"seq_len": SEQ}, "train": {"float8": recipe, **train_keys}})
    return parallelize(build_model(cfg.model, "meta"), cfg, Parallel(layout_of(cfg, 1), None, CPU))


@pytest.fixture(scope="module")
def bf16(tiny_data, tmp_path_factory):
    return run(tmp_path_factory.mktemp("bf16"), tiny_data)


@pytest.fixture(scope="module")
def one_process(tiny_data, tmp_path_factory):
    """`one_process(recipe)`: 6 steps of emulated float8 on one process, trained once per recipe (the
    eager reference of the compile test and of the two-rank tests alike)."""
    runs = {}

    def get(recipe: str):
        if recipe not in runs:
            out = tmp_path_factory.mktemp(f"one_{recipe}") / "run"
            runs[recipe] = run(out, tiny_data, **emulated(recipe), **{"train.steps": 6})
        return runs[recipe]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_emulated_float8_trains_like_bf16(tiny_data, tmp_path, recipe, bf16):
    """20 steps of the tiny model, same seed and data: the final loss within 2% of bf16's."""
    f8 = run(tmp_path / recipe, tiny_data, **emulated(recipe))
    assert f8.train_loss == pytest.approx(bf16.train_loss, rel=0.02)
    assert f8.losses[-1] < f8.losses[0] - 0.5  # it learned
    rows = [json.loads(line) for line in (tmp_path / recipe / "metrics.jsonl").read_text().splitlines()]
    assert {r["mfu_basis"] for r in rows if "mfu" in r} == {f"bf16 dense peak (float8 {recipe} linears)"}


def test_float8_needs_a_float8_gpu_unless_emulated(tmp_path, cli):
    """Refused before the run folder or its data exist."""
    r = cli("train", "train.float8=rowwise", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: train.float8 needs a CUDA GPU of compute capability >= 8.9; found cpu; "
        "set train.float8=none (or train.float8_emulate=true to emulate)"
    )
    assert list(tmp_path.iterdir()) == []


def test_float8_without_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what an environment without torchao imports
    m = ModelConfig(n_layers=1, d_model=64, n_heads=2, vocab_size=256, max_seq_len=SEQ)
    with pytest.raises(ConfigError, match=r"pip install 'flopwise\[float8\]'"):
        parallelized(m, "rowwise", float8_emulate=True)


def test_float8_linears_are_the_blocks_eligible_ones():
    """The blocks' linears become Float8Linear; the embedding and head stay nn.Linear/nn.Embedding;
    an MLP whose width is not a multiple of 16 stays in bf16 and is what the banner lists."""
    m = ModelConfig(n_layers=2, d_model=64, n_heads=2, ffn_dim=200, vocab_size=256, max_seq_len=SEQ)
    model = parallelized(m, "rowwise", float8_emulate=True)
    f8 = {n for n, mod in model.named_modules() if isinstance(mod, Float8Linear)}
    assert f8 == {f"layers.{i}.attention.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")}
    assert type(model.output) is nn.Linear and type(model.layers["0"].feed_forward.w1) is nn.Linear
    assert unconverted_linears(m) == ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]


@pytest.mark.slow  # compiling on a CPU: ~1 min on 2 cores
@pytest.mark.compile
def test_float8_composes_with_recompute_and_compile(tiny_data, tmp_path, one_process):
    """Full recompute and per-block compile over emulated float8 linears: the same losses as eager
    float8 without recompute, within compile's reordering of float sums."""
    torch._dynamo.reset()
    eager = one_process("rowwise")
    both = run(
        tmp_path / "both",
        tiny_data,
        **emulated("rowwise"),
        **{"train.steps": 6, "parallel.recompute": '"full"', "train.compile": "true"},
    )
    assert both.losses == pytest.approx(eager.losses, rel=0.01)


TWO_RANKS = {  # name: (recipe, layout)
    "fsdp2-zero3": (
        "tensorwise",
        {"parallel.zero": 3},
    ),  # FSDP2 all-gathers the weights in float8, scaled by the shards' amax
    "tp2-sp": ("rowwise", {"parallel.tp": 2, "parallel.sequence_parallel": "true"}),  # DTensor shards, bf16 collectives
}


@pytest.fixture(scope="module")
def two_ranks(tiny_data, tmp_path_factory) -> dict:
    """Both layouts' 6 steps in one torchrun launch of 2 gloo ranks (tests/dist: a launch costs 10-30 s)."""
    tmp = tmp_path_factory.mktemp("float8_two_ranks")
    jobs = [
        {
            "name": name,
            "kind": "losses",
            "overrides": tiny_overrides(
                tmp / name,
                tiny_data,
                **{
                    "train.dtype": '"bf16"',
                    "train.steps": 6,
                    "train.eval_every": 0,
                    "checkpoint.interval": 0,
                    "checkpoint.resume": '"none"',
                    "log.every": 1,
                    **layout,
                    **emulated(recipe),
                },
            ),
        }
        for name, (recipe, layout) in TWO_RANKS.items()
    ]
    return run_jobs(2, jobs, tmp)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_float8_composes_with_two_ranks(name, two_ranks, one_process):
    """Two ranks (torchrun, gloo) train as one process does, step for step within 1%."""
    recipe, _ = TWO_RANKS[name]
    one = one_process(recipe)
    assert two_ranks[name]["losses"] == pytest.approx(one.losses, rel=0.01)


# --- the planner's bytes against SavedBytes ------------------------------------------------------


def model_config(n_layers: int) -> ModelConfig:
    return ModelConfig(
        arch="llama", d_model=128, n_heads=4, n_kv_heads=2, n_layers=n_layers, vocab_size=256, max_seq_len=SEQ
    )


def measure(n_layers: int, dtype: str, compiled: bool = False) -> SavedBytes:
    model = parallelized(model_config(n_layers), "rowwise", float8_emulate=True, dtype=dtype)
    if compiled:
        torch._dynamo.reset()
        apply_compile(model)
    x = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with autocast(CPU, dtype), SavedBytes(model) as s:
        model(x)
    return s


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_planner_books_what_float8_linears_save(dtype):
    """Per layer (4 layers − 2): torchao's float8 linears keep what autocast's linears keep (the
    input in the compute dtype, the weight itself), and make no bf16 weight copies (only the head's
    remains)."""
    two, four = measure(2, dtype), measure(4, dtype)
    precision = engine_precision(dtype, fsdp=False, cpu=True, float8=True)
    assert (four.bytes - two.bytes) / 2 == pytest.approx(
        activation_bytes_per_layer(model_config(4), SEQ, BATCH, precision=precision), rel=0.05
    )
    copies = autocast_weight_copy_bytes(model_config(4), 4, head=True, float8=True) if dtype == "bf16" else 0
    assert four.weight_copies == copies
    assert copies < autocast_weight_copy_bytes(model_config(4), 4, head=True) or dtype == "fp32"


@pytest.mark.slow
def test_run_measures_what_the_planner_predicts(tiny_data, tmp_path):
    """`flopwise plan measure`'s path on one process (build_run, then measure_rank's steps under
    SavedBytes and PeakMemory) with emulated rowwise float8 under bf16 autocast: the saved
    activations and the step's high-water mark (without the blocks' bf16 weight copies) within 1%
    of predict_rank's (measured: 68 and 4,084 bytes apart)."""
    from flopwise.measure.step import measure_rank
    from flopwise.plan.rank import predict_rank
    from flopwise.train.build import build_run

    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / "run",
            tiny_data,
            **{"train.dtype": '"bf16"', "train.micro_batch": 8, "checkpoint.resume": '"none"', **emulated("rowwise")},
        ),
    )
    run = build_run(cfg)
    got = measure_rank(run, 2, collectives=False)
    want = predict_rank(run.cfg, run.par.layout, 0, 0, 0, cpu=True)
    assert got["activations"] == pytest.approx(want.activations, rel=0.01)
    assert got["peak"] == pytest.approx(want.peak, rel=0.01)


@pytest.mark.slow
@pytest.mark.compile
def test_planner_bounds_what_compiled_float8_blocks_save():
    """Compiled (2 layers − 1): the planner books a compiled bf16 block without its float8 linears'
    weight casts; the partitioner keeps no more than that (on a CPU, where the float8 matmul is
    emulated by ordinary ops, it recomputes more and keeps less)."""
    got = measure(2, "bf16", compiled=True).bytes - measure(1, "bf16", compiled=True).bytes
    booked = activation_bytes_per_layer(
        model_config(2),
        SEQ,
        BATCH,
        precision=engine_precision("bf16", fsdp=False, cpu=True, compiled=True, float8=True),
    )
    plain = activation_bytes_per_layer(
        model_config(2), SEQ, BATCH, precision=engine_precision("bf16", fsdp=False, cpu=True, compiled=True)
    )
    assert got <= booked < plain


@pytest.mark.slow
@pytest.mark.multiproc
def test_fsdp2_float8_all_gather_measures_what_the_planner_predicts(tiny_data, tmp_path, cli):
    """`flopwise plan measure` on two ranks, ZeRO-2, tensorwise: FSDP2 gathers the float8
    linears' weights in 1 byte per element; the gathered bytes equal the planner's, and the step's
    high-water mark is within 1%."""
    keys = tiny_overrides(
        tmp_path / "run",
        tiny_data,
        **{"train.dtype": '"bf16"', "train.compile": "false", "parallel.zero": 2, **emulated("tensorwise")},
    )
    r = cli("plan", "measure", *keys, "--nproc", "2", "--steps", "3", "--json")  # the ranks: torchrun's own
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in json.loads(r.stdout)["ranks"]:
        assert rank["gathered"]["measured"] == rank["gathered"]["predicted"]
        assert rank["peak"]["measured"] == pytest.approx(rank["peak"]["predicted"], rel=0.01)
