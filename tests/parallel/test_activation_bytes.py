"""The planner's activation bytes (plan.memory, this engine's precision) against what autograd
really keeps for backward (parallel.accounting.SavedBytes), one process.

Per layer = (saved bytes of a 4-layer model − of a 2-layer one) / 2 (compiled: 2 layers − 1), so
the embedding, the head and the per-forward tables cancel. The model is built, wrapped for
recompute, compiled and run under autocast by the engine's own functions; the planner sees only the
config.
"""

import pytest
import torch

from flopwise.config.schema import ModelConfig
from flopwise.measure.bytes import PeakMemory, SavedBytes
from flopwise.model.transformer import build_model
from flopwise.parallel.apply import apply_compile, apply_recompute
from flopwise.plan.memory import activation_bytes_per_layer, autocast_weight_copy_bytes, engine_precision
from flopwise.train.engine import autocast, lm_loss
from tests.conftest import run_jobs, tiny_overrides

SEQ, BATCH = 64, 2
# Small shapes of each family: GQA/SwiGLU/RMSNorm/RoPE, MHA/GeLU/LayerNorm/learned positions,
# parallel block/partial RoPE, ReLU.
FAMILIES = {
    "llama": dict(arch="llama", d_model=128, n_heads=4, n_kv_heads=2),
    "gpt2": dict(arch="gpt2", d_model=128, n_heads=4),
    "neox": dict(arch="neox", d_model=128, n_heads=4),
    "opt": dict(arch="opt", d_model=128, n_heads=4),
}


def model_config(family: str, n_layers: int) -> ModelConfig:
    return ModelConfig(**FAMILIES[family], n_layers=n_layers, vocab_size=256, max_seq_len=SEQ)


def measure(family: str, n_layers: int, dtype: str, recompute: str, compiled: bool = False, **inputs) -> SavedBytes:
    model = build_model(model_config(family, n_layers), seed=0)
    apply_recompute(model, recompute)
    if compiled:
        torch._dynamo.reset()  # a fresh compile per model: no recompile limit across the cases
        apply_compile(model)
    x = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with autocast(torch.device("cpu"), dtype), SavedBytes(model) as s:
        model(x, **inputs)
    return s


def measured_per_layer(family: str, dtype: str, recompute: str, compiled: bool = False, **inputs) -> float:
    if compiled:  # compiling costs seconds per model: one layer against two
        one, two = (measure(family, n, dtype, recompute, True, **inputs).bytes for n in (1, 2))
        return two - one
    two, four = (measure(family, n, dtype, recompute, **inputs).bytes for n in (2, 4))
    return (four - two) / 2


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_planner_books_what_the_engine_saves(family, dtype, recompute):
    got = measured_per_layer(family, dtype, recompute)
    want = activation_bytes_per_layer(
        model_config(family, 4),
        SEQ,
        BATCH,
        recompute=recompute,
        precision=engine_precision(dtype, fsdp=False, cpu=True),
    )
    assert got == pytest.approx(want, rel=0.05)


# Compiled blocks (AOTAutograd's partitioner recomputes pointwise ops, keeps the bf16 weight casts):
# each case compiles two models (~10 s on 2 cores); llama and gpt2 without recompute run by default.
COMPILED_CASES = [
    pytest.param(
        f,
        d,
        r,
        marks=[pytest.mark.compile]
        if f in ("llama", "gpt2") and r == "none"
        else [pytest.mark.compile, pytest.mark.slow],
    )
    for f in FAMILIES
    for d in ("fp32", "bf16")
    for r in ("none", "selective", "full")
]


@pytest.mark.slow
@pytest.mark.parametrize("family, dtype, recompute", COMPILED_CASES)
def test_planner_books_what_a_compiled_block_saves(family, dtype, recompute):
    """Exact, byte for byte: the partitioner's choices scale with s·b, so the small shapes stand for large ones."""
    got = measured_per_layer(family, dtype, recompute, compiled=True)
    want = activation_bytes_per_layer(
        model_config(family, 2),
        SEQ,
        BATCH,
        recompute=recompute,
        precision=engine_precision(dtype, fsdp=False, cpu=True, compiled=True),
    )
    assert got == want


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_document_mask_term():
    """The compiled core keeps SDPA's attention-dtype copy of the document mask, as eager does."""
    documents = (torch.arange(SEQ) // 16).expand(BATCH, SEQ)
    got = measured_per_layer("llama", "bf16", "none", compiled=True, documents=documents)
    want = activation_bytes_per_layer(
        model_config("llama", 2),
        SEQ,
        BATCH,
        mask_keys=SEQ,
        precision=engine_precision("bf16", fsdp=False, cpu=True, compiled=True),
    )
    assert got == want


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_document_mask_term(dtype):
    """A (b, 1, s, s) document mask: SDPA keeps a compute-dtype copy per layer."""
    documents = (torch.arange(SEQ) // 16).expand(BATCH, SEQ)
    got = measured_per_layer("llama", dtype, "none", documents=documents)
    want = activation_bytes_per_layer(
        model_config("llama", 4), SEQ, BATCH, mask_keys=SEQ, precision=engine_precision(dtype, fsdp=False, cpu=True)
    )
    assert got == pytest.approx(want, rel=0.05)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_autocast_weight_copies(family):
    """The bf16 weight copies autocast keeps (booked once per step by the planner): the measured ones
    are those backward needs, every linear weight and the head; the planner also books the linear
    biases, which autocast caches but backward does not keep (< 1% here)."""
    got = measure(family, 4, "bf16", "none").weight_copies
    assert got == pytest.approx(autocast_weight_copy_bytes(model_config(family, 4), 4, head=True), rel=0.02)
    assert measure(family, 4, "fp32", "none").weight_copies == 0


def test_saved_bytes_counts_storages_not_views_nor_parameters():
    lin = torch.nn.Linear(8, 8, bias=False)
    x = torch.ones(4, 8)
    with SavedBytes(lin) as s:
        y = lin(x)  # keeps x and the weight (a parameter: not counted)
        y.sin()  # keeps y
        y.t().cos()  # keeps a view of y: the same storage
    assert (s.bytes, s.weight_copies) == (2 * 4 * 8 * 4, 0)
    x.requires_grad_()  # a leaf that is not a parameter (a pipeline stage's input)
    with torch.autocast("cpu", dtype=torch.bfloat16), SavedBytes(lin) as s:
        lin(x)  # keeps bf16 casts of x (an activation) and of the weight (a weight copy)
    assert (s.bytes, s.weight_copies) == (4 * 8 * 2, 8 * 8 * 2)


# --- two ranks (torchrun, gloo): tensor/sequence parallel splits and FSDP2's bf16 param dtype ---

DIST_LAYOUTS = {  # (overrides, dtype)
    "tp2": ({"parallel.tp": 2}, "bf16"),
    "tp2-sp": ({"parallel.tp": 2, "parallel.sequence_parallel": "true"}, "bf16"),
    "tp2-sp-fp32": ({"parallel.tp": 2, "parallel.sequence_parallel": "true"}, "fp32"),
    "tp2-sp-selective": (
        {"parallel.tp": 2, "parallel.sequence_parallel": "true", "parallel.recompute": '"selective"'},
        "bf16",
    ),
    "tp2-sp-full": ({"parallel.tp": 2, "parallel.sequence_parallel": "true", "parallel.recompute": '"full"'}, "bf16"),
    "cp2": ({"parallel.cp": 2}, "bf16"),
    "fsdp2": ({"parallel.zero": 2}, "bf16"),
    "fsdp2-zero3-full": ({"parallel.zero": 3, "parallel.recompute": '"full"'}, "bf16"),
}
DIST_CASES = [
    (f, lo) for f in ("llama", "gpt2", "neox") for lo in DIST_LAYOUTS if not (f == "gpt2" and "-sp" in lo)
]  # the engine refuses sequence parallel with learned positions


def _dist_overrides(family: str, layout: str, n_layers: int) -> list[str]:
    extra, dtype = DIST_LAYOUTS[layout]
    m = {f"model.{k}": f'"{v}"' if isinstance(v, str) else v for k, v in FAMILIES[family].items()}
    base = {
        **m,
        "model.n_layers": n_layers,
        "model.vocab_size": 256,
        "model.max_seq_len": SEQ,
        "data.seq_len": SEQ,
        "train.micro_batch": BATCH,
        "train.global_batch": BATCH * (2 if "fsdp" in layout else 1),
        "train.dtype": f'"{dtype}"',
        **extra,
    }
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="module")
def measured_dist(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("activations")
    jobs = [
        {"name": f"{f}-{lo}-{n}", "kind": "activations", "overrides": _dist_overrides(f, lo, n)}
        for f, lo in DIST_CASES
        for n in (2, 4)
    ]
    return run_jobs(2, jobs, tmp)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("family, layout", DIST_CASES)
def test_planner_books_what_each_rank_saves(family, layout, measured_dist):
    from flopwise.config.schema import load_config
    from flopwise.layout.rules import layout_of

    lo = layout_of(load_config(None, _dist_overrides(family, layout, 4)), 2)
    fsdp, dtype = lo.zero >= 2, DIST_LAYOUTS[layout][1]
    want = activation_bytes_per_layer(
        model_config(family, 4),
        SEQ // lo.cp,
        BATCH,
        lo.tp,
        lo.sequence_parallel,
        lo.recompute,
        precision=engine_precision(dtype, fsdp, cpu=True),
        cp=lo.cp,
    )
    two, four = (measured_dist[f"{family}-{layout}-{n}"]["ranks"] for n in (2, 4))
    for r2, r4 in zip(two, four, strict=True):
        assert (r4["bytes"] - r2["bytes"]) / 2 == pytest.approx(want, rel=0.05), (r2, r4)
        copies = dtype == "bf16" and not fsdp  # FSDP2 computes with its bf16 params
        assert (r4["weight_copies"] > 0) == copies
        if copies and lo.recompute != "full":  # (under full recompute backward keeps the head's only)
            m = model_config(family, 4)
            assert r4["weight_copies"] == pytest.approx(autocast_weight_copy_bytes(m, 4, True, lo.tp), rel=0.02)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.compile])])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_planner_books_what_the_model_keeps_outside_its_layers(family, dtype, compiled):
    """Token ids, RoPE tables, final norm, head input and what the loss keeps (eager: its fp32
    log-softmax; compiled: the logits and two per-token statistics): measured as 2·(1 layer) −
    (2 layers) with the engine's own loss, against plan.memory.end_activation_bytes."""
    from flopwise.plan.memory import end_activation_bytes
    from flopwise.train.engine import token_loss

    loss = torch.compile(token_loss) if compiled else token_loss

    def total(n_layers: int) -> int:
        model = build_model(model_config(family, n_layers), seed=0)
        if compiled:
            torch._dynamo.reset()
            apply_compile(model)
        x = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
        with autocast(torch.device("cpu"), dtype), SavedBytes(model) as s:
            loss(model(x[:, :-1]), x[:, 1:].contiguous())
        return s.bytes

    want = end_activation_bytes(
        model_config(family, 1),
        SEQ,
        BATCH,
        1,
        True,
        True,
        engine_precision(dtype, fsdp=False, cpu=True, compiled=compiled),
    )
    assert 2 * total(1) - total(2) == pytest.approx(want, rel=0.01)


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_run_measures_what_the_planner_predicts(tiny_data, tmp_path):
    """`flopwise plan measure`'s path on one process (build_run, then measure_rank's training
    steps under SavedBytes) with train.compile=true and bf16 autocast: the peak of saved activations
    equals predict_rank's within 2% (compiled blocks with their weight casts, compiled loss)."""
    from flopwise.config.schema import load_config
    from flopwise.measure.step import measure_rank
    from flopwise.plan.rank import predict_rank
    from flopwise.train.build import build_run

    torch._dynamo.reset()
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / "run",
            tiny_data,
            **{"train.compile": "true", "train.dtype": '"bf16"', "train.micro_batch": 8, "checkpoint.resume": '"none"'},
        ),
    )
    run = build_run(cfg)
    got = measure_rank(run, 2, collectives=False)["activations"]
    want = predict_rank(run.cfg, run.par.layout, 0, 0, 0, cpu=True).activations
    eager = predict_rank(
        run.cfg.model_copy(update={"train": run.cfg.train.model_copy(update={"compile": False})}),
        run.par.layout,
        0,
        0,
        0,
        cpu=True,
    ).activations
    assert got == pytest.approx(want, rel=0.02) and want < eager


def held_per_layer(family: str, dtype: str, recompute: str, every: int = 1) -> float:
    """What a forward leaves allocated per layer (PeakMemory.held, 4 layers − 2), less autocast's
    cached copies of the linears' weights (as SavedBytes measures them) and biases: per-operator
    recompute keeps its saved ops' outputs in the checkpoint's own storage, which saved-tensor
    hooks (SavedBytes) do not see."""
    held = []
    for n in (2, 4):
        model = build_model(model_config(family, n), seed=0)
        apply_recompute(model, recompute, every)
        x = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        with autocast(torch.device("cpu"), dtype), PeakMemory(torch.device("cpu")) as p:
            out = model(x)  # its graph holds what backward needs
        del out
        biases = sum(m.bias.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None)
        held.append(p.held - measure(family, n, dtype, "none").weight_copies - 2 * biases * (dtype == "bf16"))
    return (held[1] - held[0]) / 2


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_planner_books_what_per_operator_recompute_keeps(family, dtype):
    """recompute=op: the block's input, its matmuls' and attention kernel's outputs, byte for byte."""
    got = held_per_layer(family, dtype, "op")
    precision = engine_precision(dtype, fsdp=False, cpu=True)
    assert got == activation_bytes_per_layer(model_config(family, 4), SEQ, BATCH, recompute="op", precision=precision)
    assert got < 0.8 * measured_per_layer(family, dtype, "none")  # and it keeps less than no recompute


def test_recompute_every_second_block():
    """recompute_every=2: of 2 (4) blocks the first (first and third) are checkpointed, the others keep all."""
    got = held_per_layer("llama", "fp32", "full", every=2)
    layer = {rc: held_per_layer("llama", "fp32", rc) for rc in ("none", "full")}
    assert got == (layer["none"] + layer["full"]) / 2


@pytest.mark.parametrize("recompute, every", [("op", 1), ("full", 2), ("op", 2)])
def test_recompute_policies_train_the_same(recompute, every):
    """The loss and every gradient equal the run without recompute (bf16 autocast, a CPU)."""

    def loss_and_grads(rc: str, n: int):
        model = build_model(model_config("llama", 3), seed=0)
        apply_recompute(model, rc, n)
        batch = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
        loss = lm_loss(model, batch, torch.device("cpu"), "bf16")
        loss.backward()
        return loss.item(), {k.replace("._checkpoint_wrapped_module", ""): p.grad for k, p in model.named_parameters()}

    want, want_grads = loss_and_grads("none", 1)
    got, grads = loss_and_grads(recompute, every)
    assert got == pytest.approx(want, abs=1e-6)
    for k, g in grads.items():
        torch.testing.assert_close(g, want_grads[k], rtol=0, atol=1e-6)


def _chunked_forward(model, x: torch.Tensor, chunk: int) -> torch.Tensor:
    return model(x[:, :-1], targets=x[:, 1:], loss_chunk=chunk).squeeze(0)


@pytest.mark.parametrize("chunk", [5, 37, 128])
@pytest.mark.parametrize("tied", [False, True])
def test_chunked_loss_equals_the_whole_vocabulary_loss(chunk, tied):
    """Transformer.head_loss, in chunks of 5, 37 (uneven) and all 128 tokens: the loss and every
    gradient equal train.engine.lm_loss's (the whole micro-batch's logits at once) within 1e-6, fp32."""
    m = model_config("llama", 2).model_copy(update={"tie_embeddings": tied})
    batch = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(2))

    def loss_and_grads(chunk: int | None):
        model = build_model(m, seed=0)
        if chunk is None:
            loss = lm_loss(model, batch, torch.device("cpu"), "fp32")
        else:
            loss = _chunked_forward(model, batch, chunk)
        loss.backward()
        return loss.item(), {k: p.grad for k, p in model.named_parameters()}

    (want, want_grads), (got, grads) = loss_and_grads(None), loss_and_grads(chunk)
    assert got == pytest.approx(want, abs=1e-6)
    for k, g in grads.items():
        torch.testing.assert_close(g, want_grads[k], rtol=0, atol=1e-6)


# a vocabulary large beside the model (as a real LLM's head beside one block), so the loss's bytes show
LOSS_MODEL = dict(arch="llama", d_model=32, n_heads=4, n_kv_heads=2, vocab_size=8192, max_seq_len=128)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_planner_books_what_a_chunked_loss_holds(dtype):
    """A chunked loss's bytes, against plan.memory: what a forward keeps outside the layers
    (SavedBytes, 2·(1 layer) − (2 layers)) and what the backward allocates above it with the
    gradients already there (PeakMemory; an accumulating micro-batch): one chunk's log-softmax and
    gradients and the head's weight gradient of that chunk."""
    from flopwise.plan.memory import end_activation_bytes, loss_working_bytes

    seq, chunk, cpu = 128, 64, torch.device("cpu")
    x = torch.randint(0, 8192, (BATCH, seq + 1), generator=torch.Generator().manual_seed(0))
    saved, backward = [], 0
    for n in (1, 2):
        model = build_model(ModelConfig(**LOSS_MODEL, n_layers=n), seed=0)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        with autocast(cpu, dtype):
            with SavedBytes(model) as s:
                loss = _chunked_forward(model, x, chunk)
            with PeakMemory(cpu) as b:
                loss.backward()
        saved.append(s.bytes)
        backward = b.bytes
    m = ModelConfig(**LOSS_MODEL, n_layers=1)
    precision = engine_precision(dtype, fsdp=False, cpu=True)
    want = end_activation_bytes(m, seq, BATCH, 1, True, True, precision, loss_chunk=chunk)
    assert 2 * saved[0] - saved[1] == pytest.approx(want, rel=0.01)
    unchunked = end_activation_bytes(m, seq, BATCH, 1, True, True, precision)
    assert want < unchunked / 4  # no fp32 log-softmax of the micro-batch kept
    assert backward == pytest.approx(loss_working_bytes(m, seq, BATCH, 1, precision, loss_chunk=chunk), rel=0.01)
