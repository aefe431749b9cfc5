"""The planner's activation bytes (plan.memory, this engine's precision) against what autograd
really keeps for backward (parallel.accounting.SavedBytes), one process.

Per layer = (saved bytes of a 4-layer model − of a 2-layer one) / 2, so the embedding, the head
and the per-forward tables cancel. The model is built, wrapped for recompute and run under
autocast by the engine's own functions; the planner sees only the config.
"""

import pytest
import torch

from flopwise.config import ModelConfig
from flopwise.model.transformer import build_model
from flopwise.parallel.accounting import SavedBytes
from flopwise.parallel.apply import apply_recompute
from flopwise.plan.memory import activation_bytes_per_layer, engine_precision
from flopwise.train.engine import autocast

SEQ, BATCH = 64, 2
FAMILIES = {  # small shapes of each family: GQA/SwiGLU/RMSNorm/RoPE, MHA/GeLU/LayerNorm/learned, parallel block/partial RoPE
    "llama": dict(arch="llama", d_model=128, n_heads=4, n_kv_heads=2),
    "gpt2": dict(arch="gpt2", d_model=128, n_heads=4),
    "neox": dict(arch="neox", d_model=128, n_heads=4),
    "opt": dict(arch="opt", d_model=128, n_heads=4),  # ReLU
}


def model_config(family: str, n_layers: int) -> ModelConfig:
    return ModelConfig(**FAMILIES[family], n_layers=n_layers, vocab_size=256, max_seq_len=SEQ)


def measured_per_layer(family: str, dtype: str, recompute: str, **inputs) -> float:
    saved = []
    for n_layers in (2, 4):
        model = build_model(model_config(family, n_layers), seed=0)
        apply_recompute(model, recompute)
        x = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        with autocast(torch.device("cpu"), dtype), SavedBytes(model) as s:
            model(x, **inputs)
        saved.append(s.bytes)
    return (saved[1] - saved[0]) / 2


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_planner_books_what_the_engine_saves(family, dtype, recompute):
    got = measured_per_layer(family, dtype, recompute)
    want = activation_bytes_per_layer(model_config(family, 4), SEQ, BATCH, recompute=recompute,
                                      precision=engine_precision(dtype, fsdp=False))
    assert got == pytest.approx(want, rel=0.05)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_document_mask_term(dtype):
    """A (b, 1, s, s) document mask: SDPA keeps a compute-dtype copy per layer."""
    documents = (torch.arange(SEQ) // 16).expand(BATCH, SEQ)
    got = measured_per_layer("llama", dtype, "none", documents=documents)
    want = activation_bytes_per_layer(model_config("llama", 4), SEQ, BATCH, mask_keys=SEQ,
                                      precision=engine_precision(dtype, fsdp=False))
    assert got == pytest.approx(want, rel=0.05)


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
