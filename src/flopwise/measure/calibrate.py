"""`flopwise hardware calibrate`: measure the machine it runs on, for the planner's time model.

    parent:  calibrate_device(cfg, device, nproc, progress) -> Hardware (its `calibration` filled)
    ranks:   python -m flopwise.measure.calibrate OUT.json BACKEND   (collectives, under torchrun)

Measured in the run's training dtype (train.dtype; under auto, `native_dtype`: bf16 on a GPU or a
CPU with bf16 matrix instructions, fp32 on a CPU without them, as its runs train), for the GEMM
and attention shapes the given config's model produces (default: the embedded demo) at the
micro-batches and tensor-parallel degrees a layout search on this machine tries, plus a coarse
grid so other models interpolate:
- the dense peak: the best square product (train.metrics.measure_matmul_peak, the MFU ceiling);
- each GEMM (M×K)·(K×N), forward and both backward transposes, as a share of that peak;
- SDPA causal attention forward and backward by sequence length and head dim;
- element-wise work: the config's model forward + backward (train.engine.lm_loss) at several
  token counts, less what the GEMM and attention tables predict for it, over the planner's own
  element-wise bytes (plan.step): the bandwidth streaming work reaches in this engine here;
- one fused AdamW step with gradient clipping (train.optim) by parameter count;
- all-reduce, all-gather, reduce-scatter and send/recv by message size over N local ranks
  (gloo on CPU, NCCL on GPU), in a torchrun of this module;
- the checkpoint write and restart times (flopwise.measure.restart), for the reliability account.
Timings are medians of repeats after a warm-up; the GPU is synchronised around each.

The work is shaped to the machine (timed at the config's own sizes, three times over, a 135M model at
its 2,048-token context took minutes and gigabytes): a CPU product or attention call grows with the
threads a rank has (about 0.1 s a call on a core of ~0.2 TFLOP/s; no larger than the measured peak
does in 0.1 s, which a CPU without bf16 instructions needs); the model's forward + backward
is timed at the largest micro-batch and sequence (up to the config's) that the tables measured
before it put under CALL_S, every measured workload within MEMORY_SHARE of the memory free now; and
a measurement stops repeating once its calls have taken MEASURE_S or three agree within STABLE.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import tomli_w
import torch

from flopwise.config.schema import Config, load_config, load_tree, to_toml, validate
from flopwise.errors import ConfigError, FlopwiseError
from flopwise.files.outputs import check_writable, write_text
from flopwise.hardware.calibration import COLLECTIVES, Calibration
from flopwise.hardware.catalogue import CATALOGUE, Hardware, cpu_multiplies_bf16, hardware_toml, identify_gpu
from flopwise.layout.rules import Layout, check_layout, config_layout
from flopwise.measure.restart import measure_recovery
from flopwise.measure.serve import layer_overhead
from flopwise.model.layers import CoreAttention
from flopwise.model.transformer import build_model
from flopwise.plan.rank_memory import RUNTIME_RESERVE
from flopwise.plan.shape import model_shape
from flopwise.plan.stack import STACKS
from flopwise.plan.step import eager_precision, estimate, layer_elementwise_bytes, loss_bytes, weight_cast_bytes
from flopwise.train.engine import lm_loss
from flopwise.train.metrics import DTYPES, measure_matmul_peak
from flopwise.train.optim import build_optimizer
from flopwise.train.preflight import device_memory

Progress = Callable[[str], None]
_CPU_FLOPS_PER_THREAD = 2e10  # largest product timed on a CPU, per thread of a rank (~0.1 s at 0.2 TFLOP/s a core)
_PRODUCT_S = 0.1  # ... and no larger than the measured peak does in this: in bf16 without bf16 instructions
# (1.4 GFLOP/s on 2 threads of an AVX2 EPYC, 2026-12-07) the fixed size alone made one product ~14 s
_CPU_QUERIES_PER_THREAD = 2**21  # attention's query elements per call on a CPU, per thread
_GPU_QUERIES = 2**26  # ... on a GPU
CALL_S = 1.0  # the longest one measured forward + backward may take on a CPU, as the tables before it predict
_MEASURE_S = 1.0  # a measurement stops repeating once its calls (warm-up included) have taken this long
_STABLE = 0.05  # ... or once three timed calls agree within 5%: more would not move the median
_MEMORY_SHARE = 0.5  # of the memory free now, what one measured workload may take (all its ranks together)
_MIN_SEQ = 16  # the shortest sequence a forward + backward is timed at
COLD_BYTES = 2**28  # weights a cold product cycles through: past a CPU's last-level cache, a GPU's L2
_MESSAGE_BYTES = {"cpu": [2**k for k in range(12, 25, 3)], "cuda": [2**k for k in range(16, 31, 2)]}


def timed(
    fn: Callable[[], object],
    device: torch.device,
    repeats: int = 5,
    warmup: int = 1,
    before: Callable[[], object] | None = None,
    budget_s: float | None = _MEASURE_S,
) -> float:
    """Median seconds of `fn` over `repeats` after `warmup` calls (the GPU synchronised around each;
    `before` runs untimed ahead of each, e.g. a barrier that starts all ranks together); fewer once
    the calls have taken `budget_s` (one timed call at least) or three agree within STABLE.
    `budget_s=None`: exactly `repeats` (ranks that meet in collectives must make the same calls)."""
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    times: list[float] = []
    for _ in range(repeats):
        if before:
            before()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        stable = len(times) >= 3 and max(times) <= (1 + _STABLE) * min(times)
        if budget_s is not None and (stable or time.perf_counter() - start >= budget_s):
            break
    return statistics.median(times)


def _gemm_shapes(cfg: Config, tps: tuple[int, ...], micro_batches: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(m, n, k) of every product one layer and the output layer run, forward and both backward
    transposes, at the given tensor-parallel degrees and micro-batches, plus a coarse grid; and the
    forward products of serving (`plan serve`): a decode step's serve.batch rows (1, 4 and 16 when
    unset) and a prefill's serve.prompt_tokens, which training's shapes do not reach."""
    m = cfg.model
    hq, hkv, seq = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim, cfg.data.seq_len
    serving = {cfg.serve.prompt_tokens, *decode_rows(cfg)}
    out = set()
    for tp in tps:
        for k, n in (
            (m.d_model, (hq + 2 * hkv) // tp),
            (hq // tp, m.d_model),
            (m.d_model, (2 if m.mlp == "swiglu" else 1) * m.ffn_dim // tp),
            (m.ffn_dim // tp, m.d_model),
            (m.d_model, m.vocab_size // tp),
        ):
            for t in (mb * seq for mb in micro_batches):
                out |= {(t, n, k), (t, k, n), (k, n, t)}  # forward (t×k)·(k×n); data grad; weight grad
            out |= {(t, n, k) for t in serving}
    for d in (256, 1024, 4096):
        for e in (256, 1024, 4096):
            for t in (512, 4096, 32768):
                out.add((t, e, d))
    return sorted(s for s in out if min(s) >= 1)


def decode_rows(cfg: Config) -> set[int]:
    """The rows of a decode step's products: serve.batch, or 1, 4 and 16 when it is unset."""
    return {cfg.serve.batch} if cfg.serve.batch else {1, 4, 16}


def _measure_gemms(
    shapes, cold: set[int], dtype: torch.dtype, device: torch.device, peak: float, progress: Progress
) -> list:
    """Each product's share of the peak. Those of `cold` rows (a decode step's) are timed cold,
    cycling through copies of the weight that overflow the caches (COLD_BYTES), as a decode step
    reads each weight from memory once: timed hot, GPT-2 124M's 16-row products ran at 70-130
    GFLOP/s on one core where its decode step's reached 10-20 (bf16, 2026-12-07)."""
    rows = []
    for m, n, k in shapes:
        flops = 2 * m * n * k
        a = torch.full((m, k), 0.5, dtype=dtype, device=device)
        copies = math.ceil(COLD_BYTES / (k * n * a.element_size())) if m in cold else 1
        bs = [torch.full((k, n), 0.25, dtype=dtype, device=device) for _ in range(copies)]
        sec = timed(partial(_products, a, bs), device, repeats=3 if flops > 1e9 else 7) / copies
        rows.append([m, n, k, round(flops / sec / peak, 4)])
        progress(f"gemm {m}x{k}x{n}")
    return rows


def _products(a: torch.Tensor, bs: list[torch.Tensor]) -> None:
    for b in bs:
        torch.matmul(a, b)


def _measure_attention(
    head_dims, seqs, queries: int, dtype: torch.dtype, device: torch.device, peak: float, progress: Progress
) -> list:
    """The engine's attention core (model.layers.CoreAttention: SDPA, causal; in fp32 on a CPU)
    forward and backward, `queries` query elements a call; shares of peak in the planner's FLOPs
    (forward: 4·s²·d per head over the full context, backward: three times that, as plan.step
    counts a fused kernel)."""
    rows = []
    core = CoreAttention(0.0)
    gen = torch.Generator(device=device).manual_seed(0)

    def fwd_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(core(q, k, v, None, True), (q, k, v), grad)

    for d in head_dims:
        for s in seqs:
            bh = max(1, queries // (s * d))
            q, k, v = (
                torch.randn((1, bh, s, d), generator=gen, dtype=dtype, device=device).requires_grad_() for _ in range(3)
            )
            grad = torch.ones((1, bh, s, d), dtype=dtype, device=device)
            fwd = timed(partial(core, q, k, v, None, True), device)
            both = timed(partial(fwd_bwd, q, k, v, grad), device)
            flops = 4 * bh * s * s * d
            rows.append([s, d, round(flops / fwd / peak, 4), round(3 * flops / max(both - fwd, 0.1 * fwd) / peak, 4)])
            progress(f"attention seq {s} head dim {d}")
    return rows


def _elementwise_row(cfg: Config, partial: Hardware, tp: int, seconds: float) -> list:
    """(tp, activation bytes, achieved bandwidth) from a measured forward + backward of the config's
    one micro-batch: what the planner's GEMM, attention and tensor-parallel all-reduce time for it
    (from the tables and fits just measured) leaves, over the planner's element-wise bytes (with
    autocast's weight casts: the model runs with fp32 parameters)."""
    m, seq, mb = cfg.model, cfg.data.seq_len, cfg.train.micro_batch or 1
    sh = model_shape(m, seq)
    lo, stack = Layout(tp=tp, micro_batch=mb), STACKS["flopwise"]
    # _model_seconds times train.engine.lm_loss, whose head and loss run whole (no loss chunks)
    t = estimate(sh, partial, lo, seq, mb, stack, compile=False, dtype=cfg.train.dtype, loss_chunk=0).time
    other = max(seconds - t["matmul"] - t["attention"] - t["tp_comm"], 0.05 * seconds)
    eager = eager_precision(stack, False, math.inf, lo, cfg.train.dtype)  # model_seconds runs the blocks eager
    fwd, bwd, tensor = layer_elementwise_bytes(sh, mb * seq, tp, False, eager)
    casts = weight_cast_bytes(m, tp, m.n_layers, True, 1, False)
    nbytes = m.n_layers * (fwd + bwd) + loss_bytes(sh, mb * seq, tp, eager) + casts
    return [tp, tensor, round(nbytes / other)]


def _model_seconds(sizes: list[Config], device: torch.device, progress: Progress) -> list[float]:
    """Seconds of the model's forward + backward (train.engine.lm_loss) at each config's micro-batch
    and sequence length (one model: they differ in those only)."""
    m = sizes[0].model
    model = build_model(m, device)
    out = []

    def step(batch: torch.Tensor, dtype: str) -> None:
        lm_loss(model, batch, device, dtype).backward()
        model.zero_grad(set_to_none=True)

    for c in sizes:
        mb, seq = c.train.micro_batch or 1, c.data.seq_len
        batch = torch.randint(0, m.vocab_size, (mb, seq + 1), generator=torch.Generator().manual_seed(0))
        out.append(timed(partial(step, batch, c.train.dtype), device, repeats=3))
        progress(f"model forward + backward at micro-batch {mb} x {seq} tokens")
    return out


def _at_size(cfg: Config, tp: int, mb: int, seq: int) -> Config | None:
    """The config at tensor-parallel degree `tp`, one micro-batch of `mb` sequences of `seq` tokens
    per step, or None if its model does not split that way."""
    d = cfg.model_dump(mode="json", exclude_none=True, by_alias=True)
    d["parallel"] = {**d["parallel"], "tp": tp, "dp": 1, "pp": 1, "cp": 1, "zero": 0, "sequence_parallel": False}
    d["parallel"]["dp_replicate"] = 1
    d["train"] = {**d["train"], "global_batch": mb, "micro_batch": mb}
    d["data"] = {**d["data"], "seq_len": seq}
    try:
        sized = validate(d)
        check = check_layout(config_layout(sized, tp), sized.model, seq, mb, tp)
    except (ConfigError, ValueError):
        return None
    return None if check else sized


def _tp_config(cfg: Config, tp: int) -> Config | None:
    """The config at tensor-parallel degree `tp`, one micro-batch per step, or None if its model
    does not split that way."""
    return _at_size(cfg, tp, cfg.train.micro_batch or 1, cfg.data.seq_len)


def halved(cfg: Config, tp: int) -> Config | None:
    """`cfg` with half the tokens a step: half the micro-batch, or at one sequence half its length
    (None below MIN_SEQ or where the model does not split so)."""
    mb, seq = cfg.train.micro_batch or 1, cfg.data.seq_len
    if mb == 1 and seq // 2 < _MIN_SEQ:
        return None
    return _at_size(cfg, tp, mb // 2, seq) if mb > 1 else _at_size(cfg, tp, 1, seq // 2)


def workload(cfg: Config, hw: Hardware, room: float, device: torch.device) -> Config:
    """`cfg` (one micro-batch a step, at its tensor-parallel degree) halved (`halved`) until the
    tables measured so far (`hw`) put its forward + backward within CALL_S on a CPU and its bytes
    within `room`, or as small as it goes: what calibrate times of the model (at the config's own
    16 x 2,048 tokens a 135M model took minutes a call, and 9 GB)."""
    tp = cfg.parallel.tp
    while True:
        mb, seq = cfg.train.micro_batch or 1, cfg.data.seq_len
        e = estimate(
            model_shape(cfg.model, seq),
            hw,
            Layout(tp=tp, micro_batch=mb),
            seq,
            mb,
            STACKS["flopwise"],
            compile=False,
            dtype=cfg.train.dtype,
            loss_chunk=0,  # as _model_seconds runs it
        )
        seconds = sum(t for k, t in e.time.items() if k != "optimizer")
        need = e.memory["total"] - e.memory["optimizer"] - RUNTIME_RESERVE  # no optimizer, no CUDA context
        smaller = halved(cfg, tp)
        if smaller is None or (need <= room and (device.type != "cpu" or seconds <= CALL_S)):
            return cfg
        cfg = smaller


def _tp_seconds(config: str, device: torch.device) -> float:
    """One rank of the engine's tensor-parallel forward + backward of one micro-batch (flopwise.train.build)."""
    import torch.distributed as dist

    from flopwise.parallel import mesh
    from flopwise.train.build import build_engine

    cfg = load_config(config)
    engine, _ = build_engine(cfg, mesh.init(cfg, device))
    batch = torch.randint(
        0,
        cfg.model.vocab_size,
        (cfg.train.global_batch, cfg.data.seq_len + 1),
        generator=torch.Generator().manual_seed(0),
    )

    def step():
        engine.forward_backward(batch)
        for p in engine.modules.parameters():
            p.grad = None

    return timed(step, device, repeats=3, before=dist.barrier, budget_s=None)


def _measure_optimizer(cfg: Config, device: torch.device, sizes, progress: Progress) -> list:
    rows = []

    def step(w: torch.nn.Linear, opt: torch.optim.Optimizer) -> None:
        params = [p for p in w.parameters()]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
        torch.nn.utils.clip_grads_with_norm_(params, cfg.optim.grad_clip or 1.0, norm, foreach=True)
        opt.step()

    for n in sizes:
        w = torch.nn.Linear(1024, max(1, n // 1024), bias=False, device=device)
        w.weight.grad = torch.full_like(w.weight, 1e-3)
        rows.append([w.weight.numel(), timed(partial(step, w, build_optimizer(w, cfg.optim)), device)])
        progress(f"AdamW over {w.weight.numel():,} parameters")
    return rows


def _measure_ranks(nproc: int, threads: int, device: torch.device, tp_cfg: Config | None, progress: Progress) -> dict:
    """Over `nproc` local ranks (of `threads` threads each on a CPU), in a torchrun of this module:
    each collective by message size, how much of one hides behind compute (`overlap`), and the
    engine's forward + backward at tensor-parallel degree nproc (`tp_seconds`, given `tp_cfg`)."""
    if nproc < 2:
        return {"collectives": {}, "overlap": 1.0, "tp_seconds": None}
    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="flopwise-calibrate-") as tmp:
        out, config = Path(tmp) / "collectives.json", Path(tmp) / "tp.toml"
        config.write_text(to_toml(tp_cfg) if tp_cfg else "")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads or 1)}
        from flopwise.parallel.mesh import torchrun  # as mesh above: imported where a launch needs it

        r = subprocess.run(
            torchrun(
                nproc,
                "-m",
                "flopwise.measure.calibrate",
                str(out),
                backend,
                str(config) if tp_cfg else "",
            ),
            capture_output=True,
            text=True,
            env=env,
        )
        if r.returncode != 0 or not out.exists():
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
            raise FlopwiseError(f"the collectives run on {nproc} ranks failed (exit {r.returncode}): {tail}")
        progress(f"collectives{', tensor parallel' if tp_cfg else ''} over {nproc} ranks")
        return json.loads(out.read_text())


def _collectives_rank(out: str, backend: str, config: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows: dict[str, list] = {k: [] for k in COLLECTIVES}

    def collectives(full: torch.Tensor, part: torch.Tensor) -> dict[str, Callable[[], object]]:
        return {
            "all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: dist.all_gather_into_tensor(full[: part.numel() * world], part),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full[: part.numel() * world]),
            "send_recv": lambda: (dist.send(full, 1) if rank == 0 else dist.recv(full, 0)) if rank < 2 else None,
        }

    for nbytes in _MESSAGE_BYTES[device.type]:
        n = nbytes // 4
        ops = collectives(torch.ones(n, device=device), torch.ones(n // world, device=device))
        for kind, op in ops.items():
            seconds = timed(op, device, before=dist.barrier, budget_s=None)
            rows[kind].append([world if kind != "send_recv" else 2, nbytes, seconds])
    hidden = overlap(device)
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # as flopwise.train.build runs a CPU rank
    tp_seconds = _tp_seconds(config, device) if config else None
    if rank == 0:
        Path(out).write_text(json.dumps({"collectives": rows, "overlap": hidden, "tp_seconds": tp_seconds}))
    dist.destroy_process_group()


def overlap(device: torch.device) -> float:
    """The share of an all-reduce that hides behind matmuls running meanwhile on the same rank
    (DDP/FSDP overlap gradient traffic with backward this way): 1 when the two take no longer than
    the longer alone, 0 when they take as long as one after the other. A GPU has copy engines and
    spare SMs for NCCL; a CPU rank whose cores all compute has nothing left to move the bytes."""
    import torch.distributed as dist

    n = 512 if device.type == "cpu" else 8192
    a = torch.full((n, n), 0.5, device=device)
    buf = torch.ones((16 if device.type == "cpu" else 256) * 2**20 // 4, device=device)
    alone = timed(lambda: dist.all_reduce(buf), device, before=dist.barrier, budget_s=None)
    reps = max(1, int(alone / timed(lambda: a @ a, device)))  # as much compute as communication

    def compute():
        for _ in range(reps):
            a @ a

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    t_c = timed(compute, device, before=dist.barrier, budget_s=None)
    t_m = timed(lambda: dist.all_reduce(buf), device, before=dist.barrier, budget_s=None)
    t_both = timed(both, device, before=dist.barrier, budget_s=None)
    return max(0.0, min(1.0, (t_c + t_m - t_both) / min(t_c, t_m)))


def _device_entry(device: torch.device) -> tuple[str, Hardware]:
    """The catalogue entry the calibration replaces: `cpu`, or the GPU's (identified by name and
    memory), else a new entry named after the driver's name."""
    if device.type == "cpu":
        return "cpu", CATALOGUE["cpu"]
    props = torch.cuda.get_device_properties(device)
    name = identify_gpu(props.name, props.total_memory)
    if name:
        return name, CATALOGUE[name]
    slug = "-".join(props.name.lower().replace("nvidia", "").split())
    return slug, Hardware(
        slug, {}, float(props.total_memory), 0.0, 0.0, 0.0, torch.cuda.device_count(), f"measured: {props.name}"
    )


def _host_memory_bytes() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024.0
    return 0.0


def stream_bandwidth(device: torch.device) -> float:
    """Achieved bytes/s of a large fp32 copy (read + write): the memory side of the roofline."""
    n = (1 << 26) if device.type == "cpu" else (1 << 28)
    a, b = torch.ones(n, device=device), torch.empty(n, device=device)
    return 8 * n / timed(lambda: b.copy_(a), device)


def native_dtype(device: torch.device) -> str:
    """What runs on `device` train in under train.dtype=auto, so what calibrate measures: bf16 on a GPU
    or a CPU with bf16 matrix instructions, fp32 on one without (its bf16 products run tens of times
    slower than fp32: hardware.catalogue.cpu_multiplies_bf16)."""
    return "bf16" if device.type != "cpu" or cpu_multiplies_bf16() else "fp32"


def require_native_dtype(dtype: str, device: torch.device) -> None:
    """bf16 tables of a CPU without bf16 instructions would describe no run there (its bf16 products
    run below the fp32 work beside them: a plan from such tables put MFU at 1.7): one line."""
    if dtype == "bf16" and native_dtype(device) == "fp32":
        raise FlopwiseError(
            "train.dtype=bf16: this CPU has no bf16 matrix instructions (AMX or AVX512-BF16), so its bf16 "
            "products run tens of times slower than fp32 and its runs train in fp32; drop train.dtype "
            "(calibrate then measures the fp32 tables its runs use)"
        )


def calibration_config(path: str, overrides: list[str], device: torch.device) -> Config:
    """The config whose shapes `hardware calibrate` measures, in the dtype its runs on `device` use:
    train.dtype=auto (the demo's) is `native_dtype`; bf16 or fp32 as given."""
    tree = load_tree(path, overrides)
    train = tree.setdefault("train", {})
    if isinstance(train, dict) and train.get("dtype", "auto") == "auto":  # (a non-table is validate's error)
        train["dtype"] = native_dtype(device)
    return validate(tree)


def calibrate_device(
    cfg: Config, device: torch.device, nproc: int, progress: Progress, total: Callable[[int], object] = lambda n: None
) -> Hardware:
    """A hardware entry for `device` with a calibration measured here (see the module docstring).
    On a CPU one device is one of `nproc` ranks: the compute is measured on its share of the cores.
    `total(n)`: the number of `progress` calls to expect, once the peak that sizes them is measured.
    """
    require_native_dtype(cfg.train.dtype, device)
    threads = _rank_threads(device, nproc)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(True)  # as flopwise.train.build runs a CPU rank
    try:
        hw = _calibrate(cfg, device, nproc, threads, progress, total)
        return replace(hw, recovery=measure_recovery(cfg, device, progress))
    finally:
        torch.set_num_threads(before)


def _rank_threads(device: torch.device, nproc: int) -> int:
    """The threads one of `nproc` ranks has on a CPU (its share of the cores); 0 on a GPU."""
    return max(1, (os.cpu_count() or 1) // nproc) if device.type == "cpu" else 0


def _free_memory(device: torch.device) -> float:
    """Bytes MEMORY_SHARE leaves a measured workload of all ranks together: of what the device has
    free now (a CPU's MemAvailable: the OS and its other processes keep the rest)."""
    free, _ = device_memory(device)
    return _MEMORY_SHARE * (free if free is not None else _host_memory_bytes())


def sweep(cfg: Config, nproc: int, device: torch.device, peak: float) -> dict:
    """What calibrate measures for `cfg` on `nproc` ranks of `device` whose measured peak is `peak`:
    micro-batches, the GEMM shapes, attention's sequence lengths, head dims and query elements a
    call; on a CPU a product and an attention call as large as the rank's cores do in about 0.1 s,
    and every one within the memory free now (`free_memory`)."""
    mb = cfg.train.micro_batch or 1
    micro_batches = tuple(sorted({max(1, mb // 4), max(1, mb // 2), mb}))
    tps = tuple(t for t in (1, 2, 4, 8) if t <= max(nproc, 1))
    threads, room, size = _rank_threads(device, nproc), _free_memory(device), DTYPES[cfg.train.dtype].itemsize
    flops = min(_CPU_FLOPS_PER_THREAD * threads, peak * _PRODUCT_S) if threads else math.inf
    gemms = [
        (m, n, k)
        for m, n, k in _gemm_shapes(cfg, tps, micro_batches)
        if 2 * m * n * k <= flops and (m * k + k * n + m * n) * size <= room
    ]
    seqs = sorted(
        {s for s in (128, 256, 512, 1024, 2048, 4096) if device.type == "cuda" or s <= 1024} | {cfg.data.seq_len}
    )
    queries = _CPU_QUERIES_PER_THREAD * threads if threads else _GPU_QUERIES
    return {
        "micro_batches": micro_batches,
        "gemms": gemms,
        "seqs": seqs,
        "head_dims": sorted({cfg.model.head_dim, 64, 128}),
        "queries": min(queries, int(room // (8 * 4))),  # q, k, v, output and their gradients, fp32 on a CPU
    }


_MODEL_SIZES = 3  # the model's forward + backward at its workload, a half and a quarter of it


def steps_of(cfg: Config, nproc: int, device: torch.device, peak: float) -> int:
    """How many measurements calibrate takes (for the progress bar)."""
    s = sweep(cfg, nproc, device, peak)
    return 1 + len(s["gemms"]) + len(s["seqs"]) * len(s["head_dims"]) + _MODEL_SIZES + 5 + (nproc >= 2)


def _calibrate(
    cfg: Config, device: torch.device, nproc: int, threads: int, progress: Progress, total: Callable[[int], object]
) -> Hardware:
    dtype_name = cfg.train.dtype
    dtype = DTYPES[dtype_name]
    _, base = _device_entry(device)
    peak = measure_matmul_peak(dtype_name, device)
    total(steps_of(cfg, nproc, device, peak))
    progress(f"peak {peak / 1e12:.3g} TFLOP/s")
    s = sweep(cfg, nproc, device, peak)
    gemm = _measure_gemms(s["gemms"], decode_rows(cfg), dtype, device, peak, progress)
    attention = _measure_attention(s["head_dims"], s["seqs"], s["queries"], dtype, device, peak, progress)
    bw = stream_bandwidth(device)
    hw = replace(
        base,
        peak_flops={**base.peak_flops, dtype_name: peak},
        memory_bw=bw,
        devices_per_node=max(nproc, 1),
        memory_bytes=base.memory_bytes or _host_memory_bytes(),
        intra_node_bw=base.intra_node_bw or bw,
        inter_node_bw=base.inter_node_bw or bw,
        source=f"measured by flopwise hardware calibrate on {platform.node()} "
        f"({nproc} ranks{f' of {threads} threads' if threads else ''}, torch {torch.__version__}) at "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
    )
    stub = Calibration(
        dtype=dtype_name,
        gemm=tuple(map(tuple, gemm)),
        attention=tuple(map(tuple, attention)),
        elementwise=((1.0, 1.0, bw),),
        optimizer=((1.0, 1.0),),
    )
    room = _free_memory(device)  # the model's workloads: sized by what the tables so far predict of them
    one = _tp_config(cfg, 1)
    assert one is not None  # one process: no split to refuse
    workloads = [workload(one, replace(hw, calibration=stub), room, device)]
    while len(workloads) < _MODEL_SIZES and (smaller := halved(workloads[-1], 1)) is not None:
        workloads.append(smaller)
    tp_cfg = _tp_config(cfg, nproc) if nproc >= 2 else None
    if tp_cfg is not None:
        tp_cfg = workload(tp_cfg, replace(hw, calibration=stub), room / nproc, device)  # each rank its share
    measured = _measure_ranks(nproc, threads, device, tp_cfg, progress)
    stub = replace(
        stub, collectives=tuple((k, tuple(map(tuple, v))) for k, v in sorted(measured["collectives"].items()) if v)
    )
    partial = replace(hw, calibration=stub)
    elementwise = [
        _elementwise_row(c, partial, 1, sec)
        for c, sec in zip(workloads, _model_seconds(workloads, device, progress), strict=True)
    ]
    if tp_cfg is not None and measured["tp_seconds"]:
        elementwise.append(_elementwise_row(tp_cfg, partial, nproc, measured["tp_seconds"]))
    sizes = [2**20, 2**22, 2**24] if device.type == "cpu" else [2**24, 2**26, 2**28]
    optimizer = _measure_optimizer(cfg, device, sizes, progress)
    cal = Calibration(
        dtype=dtype_name,
        gemm=stub.gemm,
        attention=stub.attention,
        elementwise=tuple(map(tuple, elementwise)),
        optimizer=tuple(map(tuple, optimizer)),
        collectives=stub.collectives,
        source=f"{cfg.model.preset or 'model'} shapes, seq {cfg.data.seq_len}",
        threads=threads,
        overlap=round(measured["overlap"], 3),
        layer_overhead=layer_overhead(cfg.model, device, dtype),
    )
    return replace(hw, calibration=cal)


def save_hardware(hw: Hardware, path: str | Path) -> Path:
    """Write `hw` into a hardware TOML, replacing its entry in a file flopwise wrote before (other
    entries kept) and refusing a file it did not write. Table rows go one per line."""
    path = check_writable(path, "--out")
    tree = {}
    if path.exists():
        try:
            tree = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"--out {path}: not a hardware TOML ({e}); choose another path") from None
    tree[hw.name] = hardware_toml(hw)
    parts = []
    for name, entry in tree.items():
        entry = dict(entry)
        cal = entry.pop("calibration", None)
        parts.append(tomli_w.dumps({name: entry}))
        if cal:
            colls = cal.pop("collectives", {})
            lines = [f"[{name}.calibration]"]
            for key, value in cal.items():
                lines.append(f"{key} = " + (_rows(value) if isinstance(value, list) else json.dumps(value)))
            if colls:
                lines.append(f"\n[{name}.calibration.collectives]")
                lines += [f"{kind} = {_rows(rows)}" for kind, rows in colls.items()]
            parts.append("\n".join(lines) + "\n")
    return write_text(path, "\n".join(parts), "--out")


def _rows(rows: list[list[float]]) -> str:
    return "[\n" + "".join(f"  [{', '.join(repr(x) for x in row)}],\n" for row in rows) + "]"


if __name__ == "__main__":
    _collectives_rank(sys.argv[1], sys.argv[2], sys.argv[3])
