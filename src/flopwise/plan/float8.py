"""float8 training (train.float8, torchao's dynamic scaling) as the step-time model books it. Pure Python.

Which of a block's linears run in float8 and whether FSDP2 gathers their weights in float8 are
layout.linears' facts (the runtime converts by them too). Booked here: the HBM bytes the amax,
cast and rescale kernels around each float8 matmul move, and how fast each recipe's matmul kernels
run beside tensorwise cuBLAS. The bytes those linears keep for backward are plan.memory's
(`engine_precision(..., float8=True)`).

Which kernel each of the three matmuls of a float8 linear runs, in torchao 0.18 (float8/config.py
`recipe_name_to_linear_config`, float8/float8_ops.py `addmm_float8_unwrapped`): the forward with
fast accumulation, the two backward ones without. Tensorwise: cuBLAS's scaled matmul for all
three. Rowwise: the forward on PyTorch's own CUTLASS kernel (RowwiseScaledMM), which runs slower
than cuBLAS (`ROWWISE_FORWARD_SPEED`); the backward two on cuBLAS's tensorwise kernel with unit
scales, their outputs then multiplied by the row and column scales in a separate element-wise pass
(torchao's workaround for the slow CUTLASS kernel without fast accumulation; under compile at least
one extra kernel per matmul, pytorch/ao#2184), booked as bytes in `linear_cast_bytes`.
"""

from __future__ import annotations

from flopwise.config.schema import ModelConfig
from flopwise.layout.linears import RECIPES, float8_shapes

_SCALE_BYTES = 4  # torchao keeps every scale in fp32
# Speed of torch._scaled_mm's rowwise CUTLASS kernel beside cuBLAS's tensorwise one on Hopper, both
# with fast accumulation (the float8 forward): "most shapes are within 90-100% of tensor-wise
# efficiency, but there's a long tail going down to 50%" (pytorch/pytorch#147971, Feb 2025,
# H100, after the tile heuristics of pytorch/pytorch#134781); the low end of that range, the tail
# lying below it. A kernel-level figure, not fitted to any run this planner is checked against.
ROWWISE_FORWARD_SPEED = 0.9


def scaled_mm_speed(recipe: str) -> tuple[float, float]:
    """(forward, backward) speed of a recipe's float8 matmuls as a share of the tensorwise cuBLAS
    kernel's (which the fp8 peak and the chip's GEMM efficiency describe): rowwise runs its forward
    on the CUTLASS kernel and its backward on cuBLAS (module docstring)."""
    return (ROWWISE_FORWARD_SPEED, 1.0) if recipe == "rowwise" else (1.0, 1.0)


def _cast(n: float, rows: float, hp_bytes: float, recipe: str) -> float:
    """One dynamic float8 cast of an n-element high-precision tensor: a pass that reads it for its
    amax (torchao's tensor_to_amax: per tensor, or per row for rowwise), and a pass that reads it
    again and writes it in float8 (1 byte per element) with its fp32 scales (one, or one per row)."""
    scales = rows if recipe == "rowwise" else 1
    return 2 * hp_bytes * n + n + _SCALE_BYTES * scales


def linear_cast_bytes(
    n_out: int, k_in: int, tokens: float, recipe: str, *, weight_bytes: float = 2, hp_bytes: float = 2
) -> tuple[float, float]:
    """HBM bytes the amax, cast and rescale kernels around one float8 linear of weight N×K (`n_out`,
    `k_in`) move (forward, backward) for `tokens` input rows. `hp_bytes`: the activations' and
    gradients' element size (bf16 autocast: 2); `weight_bytes`: the weight's (fp32 master weights:
    4; FSDP2's bf16 gathered copy: 2). Each cast is `_cast`: read for the amax, read again and
    write float8. With input X (T×K) and output gradient G (T×N), from torchao.float8.float8_linear
    (matmul_with_hp_or_float8_args), which saves X and W in high precision and casts afresh in
    backward:

    - forward, both recipes: cast X (scaled per row of X under rowwise) and W (per row of W).
    - backward, tensorwise: cast G once, used by both gemms: grad_input = G·W and
      grad_weight = Gᵀ·X, the latter needing Gᵀ row-major, one more read and write of the float8
      G (torch._scaled_mm takes its first operand row-major); recast W and X (their scales are
      per tensor, so the same scale, but the float8 copies were not kept).
    - backward, rowwise: G cast twice, per row for grad_input and per column for grad_weight
      (each written in the layout its gemm reads); W recast per column (of K) for grad_input and
      X per column (of K) for grad_weight; and both gemms' outputs, grad_input (T×K) and
      grad_weight (N×K) in high precision, read and written once more to apply the scales
      (`output *= post_inverse_scale` in torchao's addmm_float8_unwrapped).

    The layer's bias adds stay in high precision and are not counted. Compiled blocks fuse the
    casts into neighbouring kernels only partly; eager ones run them as separate kernels, as
    counted here."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: expected one of {RECIPES}")
    t = tokens
    x, w, g = t * k_in, n_out * k_in, t * n_out
    fwd = _cast(x, t, hp_bytes, recipe) + _cast(w, n_out, weight_bytes, recipe)
    if recipe == "tensorwise":
        bwd = (
            _cast(g, t, hp_bytes, recipe)
            + 2 * g
            + _cast(w, n_out, weight_bytes, recipe)
            + _cast(x, t, hp_bytes, recipe)
        )
    else:
        rescale = 2 * hp_bytes * (x + w)
        bwd = (
            _cast(g, t, hp_bytes, recipe)
            + _cast(g, n_out, hp_bytes, recipe)
            + _cast(w, k_in, weight_bytes, recipe)
            + _cast(x, k_in, hp_bytes, recipe)
            + rescale
        )
    return fwd, bwd


def cast_bytes(
    model: ModelConfig, tokens: float, tp: int, recipe: str, *, weight_bytes: float = 2, hp_bytes: float = 2
) -> tuple[float, float]:
    """HBM bytes one layer's amax, cast and rescale kernels move (forward, backward) on one rank, for
    `tokens` tokens (b·s/cp of a micro-batch): `linear_cast_bytes` summed over the block's float8
    linears (tensor-parallel local shapes). Under FSDP2's float8 all-gather (tensorwise) the
    weight's cast happens on the shard before the gather instead; the bytes are the same over the
    dp ranks, so they are booked here per rank as if unsharded (an upper bound of 1/dp of the
    weight terms)."""
    fwd = bwd = 0.0
    for n_out, k_in in float8_shapes(model, tp):
        f, b = linear_cast_bytes(n_out, k_in, tokens, recipe, weight_bytes=weight_bytes, hp_bytes=hp_bytes)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd
