"""The built-in H100/H200 efficiency tables, derived from the one H200 profile this project recorded
(benchmarks/gpu/results/gpu_llama1b_z3_b8.json; `python benchmarks/published/hopper_tables.py` prints them beside
every recorded H200 run), and the planner's step time of those runs.

Source: `benchmarks/gpu/llama1b.py --zero 3 --profile` on a lent H200 (2026-12-04, torch 2.11.0+cu130,
cuBLAS nvjet GEMM kernels, cuDNN SDPA; benchmarks/gpu/results/gpu_llama1b_z3_b8.json): one compiled step of
a 1.1B Llama (16 x 2048, 32 heads of 64, 8 kv heads, SwiGLU 8192, vocab 32000) at 8 x 2048 tokens,
208.96 ms of kernels. Each kernel class's measured time is set beside the planner's time for the same
work at unit efficiency (GEMMs, attention forward and backward) or at the nominal HBM bandwidth
(element-wise work: the planner's byte count of the layers and the loss), so each table row is the
share of the peak (or the bytes/s) this chip and its libraries really gave on this model's shapes:
- GEMMs: aten::mm, all 339 products of the step (7 per layer forward, 14 backward, the head's 3);
- attention: cuDNN flash forward and backward, at seq 2048, head dim 64 (causal; shares of the peak in
  the planner's full-score FLOP count, as `hardware calibrate` measures them);
- element-wise: the kernels left after GEMMs, attention, the fused AdamW and FSDP2's copies on its
  one-rank mesh (`aten::copy_`, a cost the planner does not book for a one-rank run);
- optimizer: the fused AdamW kernel over the model's 1.104B fp32 parameters.
One shape per table: these are points, not curves (`flopwise hardware calibrate --device cuda` on a GPU
measures the curves). The H100 SXM has the same GH100 compute (132 SMs, 989.4 TFLOP/s dense bf16) and
libraries, so it shares the compute shares; its memory-bound rates scale with HBM bandwidth (3.35 vs
4.8 TB/s). Published large-GEMM ceilings agree on the compute side: H100 SXM 792.1 TFLOP/s = 80.1% of
989 at its best shape (S. Bekman, ml-engineering, "Maximum Achievable Matmul FLOPS", CUDA 12.1),
torchao's roofline 0.78 for large inputs (torchao/testing/training/roofline_utils.py), and this H200's
own 742-820 TFLOP/s on 4096^2 and 8192^2 products (75-83%).
"""

from __future__ import annotations

import re
from dataclasses import replace

from flopwise.config.schema import Config, load_config
from flopwise.errors import ConfigError
from flopwise.flops import count_params
from flopwise.hardware.calibration import Calibration
from flopwise.hardware.catalogue import Hardware, get_hardware
from flopwise.layout.rules import Layout, check_layout, config_layout
from flopwise.plan.comm import dp_collectives, fsdp_copy_bytes
from flopwise.plan.shape import model_shape
from flopwise.plan.stack import STACKS
from flopwise.plan.step import ACT_BYTES, MEM_EFFICIENCY, evaluate_layout, layer_times, stream_time

# Llama 3.2 1B's blocks (16 layers, d 2048, 32 heads, 8 kv heads, SwiGLU 8192) with a 32K vocabulary:
# the recorded runs' model (benchmarks/gpu/llama1b.py)
SHAPE_1B = [
    "model.n_layers=16",
    "model.d_model=2048",
    "model.n_heads=32",
    "model.n_kv_heads=8",
    "model.ffn_dim=8192",
    "model.vocab_size=32000",
    "model.max_seq_len=2048",
    "data.seq_len=2048",
]
# engine.clip_grad_norm's foreach kernels per fp32 gradient element: the norm reads it (4), the clip
# multiplies it in place (4 + 4); `hardware calibrate` times them with the AdamW step, as one row
_CLIP_BYTES = 12
_KERNELS = {
    "mm": "aten::mm",
    "attn_fwd": "aten::_cudnn_attention_forward",
    "attn_bwd": "aten::_cudnn_attention_backward",
    "adamw": "aten::_fused_adamw_",
    "copy": "aten::copy_",
}


def _one_rank(cfg: Config) -> Layout:
    """The config's layout on one device, checked by the rule the engine enforces."""
    lo = config_layout(cfg, 1)
    reason = check_layout(lo, cfg.model, cfg.data.seq_len, cfg.train.global_batch, 1, pp_layers=cfg.parallel.pp_layers)
    if reason:
        raise ConfigError(reason)
    return lo


def _self_cuda_ms(table: str) -> dict[str, float]:
    """Self CUDA time (ms) of the kernel classes in a torch.profiler key_averages table, and the total."""
    out = {}
    for key, name in _KERNELS.items():
        row = next(line for line in table.splitlines() if line.strip().startswith(name + " "))
        cells = re.split(r"\s{2,}", row.strip())
        out[key] = _ms(cells[6])  # Name, Self CPU %, Self CPU, CPU total %, CPU total, CPU time avg, Self CUDA
    total = re.search(r"Self CUDA time total: (\S+)", table)
    assert total is not None, "no 'Self CUDA time total' line in the profile table"
    out["total"] = _ms(total.group(1))
    return out


def _ms(cell: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s)", cell)
    assert match is not None, f"not a time: {cell!r}"
    value, unit = match.groups()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def run_config(batch: int, zero: int, compile_: bool) -> Config:
    return load_config(
        None,
        [
            *SHAPE_1B,
            f"train.global_batch={batch}",
            f"train.micro_batch={batch}",
            'train.dtype="bf16"',
            f"train.compile={'true' if compile_ else 'false'}",
            f"parallel.zero={zero}",
            'train.device="cuda"',
            'cluster.hardware="h200"',
        ],
    )


def predict(cfg: Config, hw: Hardware) -> tuple[float, float]:
    """(planner's step time, its FSDP2 copy bytes) for a recorded run. The benchmark runs FSDP2 on a
    one-rank mesh, which the engine never does (layout.rules.Layout.fsdp2 needs two ranks): there its
    copies (plan.comm's rule for one rank, streamed at the rate of the planner's other memory-bound
    work) replace autocast's weight casts (its parameters are bf16 already)."""
    lo = _one_rank(cfg)
    est = evaluate_layout(
        cfg.model,
        hw,
        lo,
        cfg.data.seq_len,
        cfg.train.global_batch,
        compile=cfg.train.compile,
        steps=cfg.train.steps,
        dtype=cfg.train.dtype,
    )
    if cfg.parallel.zero < 2:
        return est.step_time, 0.0
    n_micro = lo.microbatches(cfg.train.global_batch)
    copies = fsdp_copy_bytes(
        dp_collectives(count_params(cfg.model).total, cfg.parallel.zero, gather_per_micro=True),
        1,
        n_micro,
        compute_bytes=ACT_BYTES,
        reduce_bytes=STACKS["flopwise"].grad_reduce_bytes,
    )
    nbytes = n_micro * copies["micro"] + copies["step"]
    block = ACT_BYTES * model_shape(cfg.model, cfg.data.seq_len).layer_params
    return est.step_time - est.time["weight_casts"] + stream_time(nbytes, hw, block), nbytes


def derive(run: dict) -> Calibration:
    """The H200 table from the recorded profile `run` (benchmarks/gpu/results/gpu_llama1b_z3_b8.json; see
    the module docstring)."""
    k = _self_cuda_ms(run["profile_top_kernels"])
    cfg = run_config(run["batch"], 3, True)
    unit = replace(get_hardware("h200"), calibration=None, matmul_efficiency=1.0)
    lo = _one_rank(cfg)
    # the recorded run's engine computed its head and loss whole (no loss chunks)
    at_unit = evaluate_layout(
        cfg.model, unit, lo, cfg.data.seq_len, cfg.train.global_batch, compile=True, loss_chunk=0
    ).time
    # GEMMs at the full peak; element-wise at MEM_EFFICIENCY x HBM
    sh = model_shape(cfg.model, cfg.data.seq_len)
    lt = layer_times(sh, unit, STACKS["flopwise"], cfg.data.seq_len, run["batch"], 1, 1, False)
    n = cfg.model.n_layers
    memory_bound_ms = k["total"] - k["mm"] - k["attn_fwd"] - k["attn_bwd"] - k["adamw"]
    clip_bytes = _CLIP_BYTES * run["params"]
    stream_bytes = at_unit["other_compute"] * MEM_EFFICIENCY * unit.memory_bw + predict(cfg, unit)[1] + clip_bytes
    rate = float(f"{1e3 * stream_bytes / memory_bound_ms:.3g}")
    tokens = run["batch"] * cfg.data.seq_len
    return Calibration(
        dtype="bf16",
        gemm=((tokens, cfg.model.ffn_dim, cfg.model.d_model, round(1e3 * at_unit["matmul"] / k["mm"], 3)),),
        attention=(
            (
                cfg.data.seq_len,
                cfg.model.head_dim,
                round(1e3 * n * lt.attn_fwd / k["attn_fwd"], 3),
                round(1e3 * n * lt.attn_bwd / k["attn_bwd"], 3),
            ),
        ),
        elementwise=((1, ACT_BYTES * tokens * cfg.model.d_model, rate),),
        optimizer=((run["params"], round(k["adamw"] * 1e-3 + clip_bytes / rate, 5)),),
        source="derived from benchmarks/gpu/results/gpu_llama1b_z3_b8.json (benchmarks/published/hopper_tables.py)",
    )
