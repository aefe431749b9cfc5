"""Per-linear facts of this engine's blocks: tensor-parallel local shapes and float8 conversion.

Pure Python. The planner books bytes and time with these facts and the runtime (parallel.float8,
the trainer's banner) applies them, so both read them here rather than one from the other: which
parameters the tensor-parallel plan splits and along which dim, which of a block's linears run in
float8 under train.float8 (both weight dims, tensor-parallel local, multiples of 16; the rest stay
in train.dtype), and whether FSDP2 gathers their weights in float8.
"""

from __future__ import annotations

import math

from flopwise.config.schema import ModelConfig
from flopwise.flops import param_shapes
from flopwise.layout.rules import Layout

# Tensor-parallel split of each parameter in this engine's Megatron plan (parallel/tensor.py):
# column-parallel weights and biases split dim 0, row-parallel weights dim 1 (their biases and
# every norm are replicated), the vocab-parallel embedding and head split the vocabulary.
_TP_DIM0 = (
    "attention.wq.",
    "attention.wk.",
    "attention.wv.",
    "feed_forward.w1.",
    "feed_forward.w3.",
    "tok_embeddings.weight",
    "output.weight",
)
_TP_DIM1 = ("attention.wo.weight", "feed_forward.w2.weight")

# What a block's linear parameters (weights and biases) have in their names
LINEAR_KEYS = (
    "attention.wq.",
    "attention.wk.",
    "attention.wv.",
    "attention.wo.",
    "attention.pos_proj.",
    "feed_forward.w",
)

# torch._scaled_mm's operands need both dims of a float8 weight to be multiples of 16
_FLOAT8_MULTIPLE = 16

RECIPES = ("rowwise", "tensorwise")  # train.float8's recipes (torchao's dynamic scaling)


def tp_local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape of parameter `name` on one of `tp` tensor-parallel ranks."""
    if tp > 1 and any(k in name for k in _TP_DIM0):
        return (shape[0] // tp, *shape[1:])
    if tp > 1 and name.endswith(_TP_DIM1):
        return (shape[0], shape[1] // tp)
    return shape


def block_linears(m: ModelConfig, tp: int = 1) -> list[tuple[str, tuple[int, ...]]]:
    """(name in the block, tensor-parallel local (out, in) shape) of each linear one block applies to
    its tokens (the attention and MLP projections; not the relative-position table's)."""
    return [
        (n.removeprefix("layers.0.").removesuffix(".weight"), tp_local_shape(n, s, tp))
        for n, s in param_shapes(m.model_copy(update={"n_layers": 1}))
        if n.startswith("layers.0.")
        and n.endswith(".weight")
        and any(k in n for k in LINEAR_KEYS)
        and "pos_proj" not in n
    ]


def float8_eligible(shape: tuple[int, ...]) -> bool:
    """Whether a linear of this (out, in) weight runs in float8 under train.float8 (else it stays in
    train.dtype; parallel.float8 converts exactly these)."""
    return all(d % _FLOAT8_MULTIPLE == 0 for d in shape)


def float8_shapes(m: ModelConfig, tp: int = 1) -> list[tuple[int, ...]]:
    """The tensor-parallel local (out, in) shapes of the block linears that run in float8."""
    return [shape for _, shape in block_linears(m, tp) if float8_eligible(shape)]


def float8_weight_elements(m: ModelConfig, tp: int = 1) -> int:
    """Elements of one block's float8 linear weights on one tensor-parallel rank."""
    return sum(math.prod(s) for s in float8_shapes(m, tp))


def float8_all_gather(recipe: str, lo: Layout) -> bool:
    """Whether FSDP2 all-gathers the float8 linears' weights in float8 (torchao's
    enable_fsdp_float8_all_gather): tensorwise scaling only (one scale per weight, computed over
    the shards), under fully_shard (ZeRO 2/3 on more than one rank)."""
    return recipe == "tensorwise" and lo.zero >= 2 and lo.world > 1


def unconverted_linears(m: ModelConfig, tp: int = 1) -> list[str]:
    """The block linears that stay in train.dtype under train.float8 (a weight dim, tensor-parallel
    local, not a multiple of 16), named as in the banner."""
    return [name for name, shape in block_linears(m, tp) if not float8_eligible(shape)]
