"""The planner's element-wise bytes of an eager layer against the kernels the engine really runs.

Reference: every ATen op of one block's forward and backward, as dispatched (a TorchDispatchMode),
with the bytes of its tensor inputs and outputs; GEMMs, the attention core and views (outputs that
alias an input) are the planner's other terms. LayerNorm, because on a CPU RMSNorm is composite
ops where CUDA runs one fused kernel (the planner counts the fused one).
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from flopwise.config.schema import load_config
from flopwise.model.layers import Span
from flopwise.model.transformer import Transformer
from flopwise.plan.memory import engine_precision
from flopwise.plan.shape import model_shape
from flopwise.plan.step import layer_elementwise_bytes, weight_cast_bytes

SEQ, BATCH = 128, 2
OTHER_TERMS = ("mm", "addmm", "bmm", "_scaled_dot_product")


class KernelBytes(TorchDispatchMode):
    """Bytes each dispatched op reads and writes, by op name."""

    def __init__(self):
        super().__init__()
        self.bytes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in ins}
        if func.__name__.startswith(OTHER_TERMS) or all(t.untyped_storage().data_ptr() in storages for t in outs):
            return out
        self.bytes[func.__name__] += sum(t.numel() * t.element_size() for t in ins + outs)
        return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "arch",
    [[], ['model.mlp="gelu"', 'model.pos="learned"'], ["model.parallel_block=true"]],
    ids=["llama", "gpt", "parallel"],
)
def test_eager_layer_bytes_are_the_kernels_the_engine_runs(arch, dtype):
    cfg = load_config(
        None,
        [
            "model.n_layers=1",
            "model.d_model=256",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.ffn_dim=512",
            "model.vocab_size=512",
            f"model.max_seq_len={SEQ}",
            f"data.seq_len={SEQ}",
            'model.norm="layernorm"',
            f'train.dtype="{dtype}"',
            *arch,
        ],
    )
    m = cfg.model
    model = Transformer(m)
    model.init_weights(0)
    x = torch.randn(BATCH, SEQ, m.d_model, requires_grad=True)
    grad = torch.randn(BATCH, SEQ, m.d_model)
    ctx = model.context(Span.after(0, SEQ))
    with KernelBytes() as counted:
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
            y = model.layers["0"](x, ctx)
        y.backward(grad)
    tokens = BATCH * SEQ
    measured = sum(counted.bytes.values())
    if dtype == "bf16":  # a CPU's only: CoreAttention's fp32 round trip of q, k, v, output (2 + 4 bytes, both ways)
        hq, hkv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
        measured -= 2 * 6 * tokens * (2 * hq + 2 * hkv)
    precision = engine_precision(dtype, False)
    fwd, bwd, _ = layer_elementwise_bytes(
        model_shape(m, SEQ), tokens, 1, False, (precision.compute, precision.residual)
    )
    # autocast's casts of the fp32 weights and of their gradients back, booked apart
    casts = weight_cast_bytes(m, 1, 1, False, 1, False) if dtype == "bf16" else 0.0
    assert fwd + bwd + casts == pytest.approx(measured, rel=0.03)
