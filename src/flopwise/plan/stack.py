"""The software stacks the planner books a step for: what each keeps per parameter and how it runs.

Pure Python. Three are built in because published runs used different kernels: `flopwise` (this
engine: PyTorch SDPA flash attention, FSDP2 with fp32 gradient reduction overlapped),
`megatron-2021` (fused-softmax materialised attention, 16-bit gradient all-reduce not overlapped),
which is what Narayanan 2021 ran, and `megatron-2022`, the same with gradient-accumulation fusion
(Megatron-LM commit 83b1e42, Feb 2022, on by default: the weight-gradient GEMM adds into the held
gradient), which is what Korthikanti 2022 ran. The byte account (plan.rank_memory) and the time
model (plan.step) both read them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Stack:
    """Software assumptions that change step time and bytes held but not the model's arithmetic."""

    name: str
    flash_attention: bool
    grad_reduce_bytes: int  # bytes per gradient element on the dp wire
    dp_overlap: float  # fraction of the overlap window that hides dp communication
    optimizer_bytes: int  # HBM bytes the optimizer step streams per local parameter
    balanced_stages: bool  # pipeline stages balanced by parameters (else even layers)
    param_bytes: int  # bytes per parameter held (master copy)
    grad_bytes: int  # bytes per gradient element held
    optimizer_state_bytes: int  # K: bytes of optimizer state per parameter
    zero1_broadcast: bool  # ZeRO-1 as torch's ZeroRedundancyOptimizer (all-reduce + broadcast)
    fsdp2: bool  # ZeRO-2/3 parameters re-gathered for every micro-batch (FSDP2 frees them after backward)
    engine_activations: bool  # this engine: its per-rank account (plan.rank_memory, run dtype; activations as it
    # keeps them), else the published account (Ψ formulas, Korthikanti's list, whose sequence-parallel shard of
    # the linear inputs Megatron all-gathers again in backward)
    description: str
    grad_accum_bytes: int  # HBM bytes per held gradient element to add one more micro-batch's gradient
    pp_scatter_gather: bool  # stage-boundary tensors sent as 1/t slices, all-gathered on the receiver


STACKS = {
    s.name: s
    for s in [
        Stack(
            name="flopwise",
            flash_attention=True,
            grad_reduce_bytes=4,
            dp_overlap=0.9,
            optimizer_bytes=32,
            balanced_stages=True,
            param_bytes=4,
            grad_bytes=4,
            optimizer_state_bytes=8,
            zero1_broadcast=True,
            fsdp2=True,
            engine_activations=True,
            grad_accum_bytes=12,
            pp_scatter_gather=False,
            description="this engine: PyTorch SDPA flash attention; fp32 master weights and gradients (4 + 4 bytes) "
            "and AdamW moments (8) under bf16 autocast (activations over an fp32 residual stream and a "
            "bf16 copy of every weight, or bf16 throughout under FSDP2's bf16 param_dtype); FSDP2/DDP "
            "with fp32 gradient reduction, 90% of dp traffic hidden behind backward; ZeRO-1 is DDP's all-"
            "reduce plus a broadcast of the updated parameters (ZeroRedundancyOptimizer); pipeline stages"
            " balanced by parameters; fp32 gradients accumulated across micro-batches (read held + read "
            "new + write, 12 bytes); stage-boundary tensors sent whole per rank",
        ),
        Stack(
            name="megatron-2021",
            flash_attention=False,
            grad_reduce_bytes=2,
            dp_overlap=0.0,
            optimizer_bytes=44,
            balanced_stages=False,
            param_bytes=2,
            grad_bytes=2,
            optimizer_state_bytes=12,
            zero1_broadcast=False,
            fsdp2=False,
            engine_activations=False,
            grad_accum_bytes=6,
            pp_scatter_gather=True,
            description="Megatron-LM as in Narayanan 2021: fused softmax on materialised scores; 16-bit parameters and "
            "gradients with an fp32 master copy in the optimizer state (2 + 2 + 12 bytes); 16-bit gradient "
            "all-reduce after the backward, no overlap; distributed optimizer; even stages; autograd accumulates "
            "16-bit gradients across micro-batches (6 bytes); scatter/gather of stage-boundary tensors",
        ),
        Stack(
            name="megatron-2022",
            flash_attention=False,
            grad_reduce_bytes=2,
            dp_overlap=0.0,
            optimizer_bytes=44,
            balanced_stages=False,
            param_bytes=2,
            grad_bytes=2,
            optimizer_state_bytes=12,
            zero1_broadcast=False,
            fsdp2=False,
            engine_activations=False,
            grad_accum_bytes=0,
            pp_scatter_gather=True,
            description="Megatron-LM as in Korthikanti 2022: megatron-2021 with gradient-accumulation fusion "
            "(the weight-gradient GEMM adds into the held gradient: no separate accumulation pass)",
        ),
    ]
}
