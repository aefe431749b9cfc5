"""`flopwise hardware calibrate`: measure the machine it runs on, for the planner's time model.

    parent:  calibrate(cfg, device, nproc, progress) -> Hardware (its `calibration` filled)
    ranks:   python -m flopwise.calibrate OUT.json BACKEND   (collectives, under torchrun)

Measured in the run's training dtype (train.dtype), for the GEMM and attention shapes the given
config's model produces (default: the embedded demo) at the micro-batches and tensor-parallel
degrees a layout search on this machine tries, plus a coarse grid so other models interpolate:
- the dense peak: the best square product (train.metrics.measure_matmul_peak, the MFU ceiling);
- each GEMM (M×K)·(K×N), forward and both backward transposes, as a share of that peak;
- SDPA causal attention forward and backward by sequence length and head dim;
- element-wise work: the config's model forward + backward (train.engine.lm_loss) at several
  token counts, less what the GEMM and attention tables predict for it, over the planner's own
  element-wise bytes (plan.perf): the bandwidth streaming work reaches in this engine here;
- one fused AdamW step with gradient clipping (train.optim) by parameter count;
- all-reduce, all-gather, reduce-scatter and send/recv by message size over N local ranks
  (gloo on CPU, NCCL on GPU), in a torchrun of this module;
- the checkpoint write and restart times (flopwise.calibrate_recovery), for the reliability account.
Timings are medians of repeats after a warm-up; the GPU is synchronised around each.
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

from flopwise.calibrate_recovery import measure_recovery
from flopwise.calibration import COLLECTIVES, Calibration
from flopwise.config import Config, load_config, to_toml, validate
from flopwise.errors import ConfigError, FlopwiseError
from flopwise.hardware import CATALOGUE, Hardware, hardware_toml, identify_gpu
from flopwise.model.layers import CoreAttention
from flopwise.model.transformer import build_model
from flopwise.outputs import check_writable, write_text
from flopwise.plan.layout import Layout, check_layout, config_layout
from flopwise.plan.perf import (
    STACKS,
    eager_precision,
    estimate,
    layer_elementwise_bytes,
    loss_bytes,
    model_shape,
    weight_cast_bytes,
)
from flopwise.train.engine import lm_loss
from flopwise.train.metrics import DTYPES, measure_matmul_peak
from flopwise.train.optim import build_optimizer

Progress = Callable[[str], None]
CPU_FLOP_CAP = 2e10  # largest product timed on a CPU (a few tenths of a second each)
MESSAGE_BYTES = {"cpu": [2**k for k in range(12, 25, 3)], "cuda": [2**k for k in range(16, 31, 2)]}


def timed(
    fn: Callable[[], object],
    device: torch.device,
    repeats: int = 5,
    warmup: int = 1,
    before: Callable[[], object] | None = None,
) -> float:
    """Median seconds of `fn` over `repeats` after `warmup` calls (the GPU synchronised around each;
    `before` runs untimed ahead of each, e.g. a barrier that starts all ranks together)."""
    for _ in range(warmup):
        fn()
    times = []
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
    return statistics.median(times)


def gemm_shapes(cfg: Config, tps: tuple[int, ...], micro_batches: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(m, n, k) of every product one layer and the output layer run, forward and both backward
    transposes, at the given tensor-parallel degrees and micro-batches, plus a coarse grid."""
    m = cfg.model
    hq, hkv, seq = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim, cfg.data.seq_len
    out = set()
    for tp in tps:
        for mb in micro_batches:
            t = mb * seq
            for k, n in (
                (m.d_model, (hq + 2 * hkv) // tp),
                (hq // tp, m.d_model),
                (m.d_model, (2 if m.mlp == "swiglu" else 1) * m.ffn_dim // tp),
                (m.ffn_dim // tp, m.d_model),
                (m.d_model, m.vocab_size // tp),
            ):
                out |= {(t, n, k), (t, k, n), (k, n, t)}  # forward (t×k)·(k×n); data grad; weight grad
    for d in (256, 1024, 4096):
        for e in (256, 1024, 4096):
            for t in (512, 4096, 32768):
                out.add((t, e, d))
    return sorted(s for s in out if min(s) >= 1)


def measure_gemms(shapes, dtype: torch.dtype, device: torch.device, peak: float, progress: Progress) -> list:
    rows = []
    for m, n, k in shapes:
        flops = 2 * m * n * k
        a = torch.full((m, k), 0.5, dtype=dtype, device=device)
        b = torch.full((k, n), 0.25, dtype=dtype, device=device)
        sec = timed(partial(torch.matmul, a, b), device, repeats=3 if flops > 1e9 else 7)
        rows.append([m, n, k, round(flops / sec / peak, 4)])
        progress(f"gemm {m}x{k}x{n}")
    return rows


def measure_attention(
    head_dims, seqs, dtype: torch.dtype, device: torch.device, peak: float, progress: Progress
) -> list:
    """The engine's attention core (model.layers.CoreAttention: SDPA, causal; in fp32 on a CPU)
    forward and backward; shares of peak in the planner's FLOPs (forward: 4·s²·d per head over
    the full context, backward: three times that, as plan.perf counts a fused kernel)."""
    rows = []
    core = CoreAttention(0.0)
    budget = 2**21 if device.type == "cpu" else 2**26  # query elements per call
    gen = torch.Generator(device=device).manual_seed(0)

    def fwd_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(core(q, k, v, None, True), (q, k, v), grad)

    for d in head_dims:
        for s in seqs:
            bh = max(1, budget // (s * d))
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


def elementwise_row(cfg: Config, partial: Hardware, tp: int, mb: int, seconds: float) -> list:
    """(tp, activation bytes, achieved bandwidth) from a measured forward + backward of one
    micro-batch: what the planner's GEMM, attention and tensor-parallel all-reduce time for it
    (from the tables and fits just measured) leaves, over the planner's element-wise bytes (with
    autocast's weight casts: the model runs with fp32 parameters)."""
    m, seq = cfg.model, cfg.data.seq_len
    sh = model_shape(m, seq)
    lo, stack = Layout(tp=tp, micro_batch=mb), STACKS["flopwise"]
    t = estimate(sh, partial, lo, seq, mb, stack, compile=False, dtype=cfg.train.dtype).time
    other = max(seconds - t["matmul"] - t["attention"] - t["tp_comm"], 0.05 * seconds)
    eager = eager_precision(stack, False, math.inf, lo, cfg.train.dtype)  # model_seconds runs the blocks eager
    fwd, bwd, tensor = layer_elementwise_bytes(sh, mb * seq, tp, False, eager)
    casts = weight_cast_bytes(m, tp, m.n_layers, True, 1, False)
    nbytes = m.n_layers * (fwd + bwd) + loss_bytes(sh, mb * seq, tp, eager) + casts
    return [tp, tensor, round(nbytes / other)]


def model_seconds(cfg: Config, device: torch.device, micro_batches: tuple[int, ...], progress: Progress) -> dict:
    """Seconds of the config's model forward + backward (train.engine.lm_loss) per micro-batch."""
    m = cfg.model
    model = build_model(m, device)
    out = {}

    def step(batch: torch.Tensor) -> None:
        lm_loss(model, batch, device, cfg.train.dtype).backward()
        model.zero_grad(set_to_none=True)

    for mb in micro_batches:
        batch = torch.randint(0, m.vocab_size, (mb, cfg.data.seq_len + 1), generator=torch.Generator().manual_seed(0))
        out[mb] = timed(partial(step, batch), device, repeats=3)
        progress(f"model forward + backward at micro-batch {mb}")
    return out


def tp_config(cfg: Config, tp: int) -> Config | None:
    """The config at tensor-parallel degree `tp`, one micro-batch per step, or None if its model
    does not split that way."""
    d = cfg.model_dump(mode="json", exclude_none=True, by_alias=True)
    d["parallel"] = {**d["parallel"], "tp": tp, "dp": 1, "pp": 1, "cp": 1, "zero": 0, "sequence_parallel": False}
    mb = cfg.train.micro_batch or 1
    d["train"] = {**d["train"], "global_batch": mb, "micro_batch": mb}
    try:
        tp_cfg = validate(d)
        check = check_layout(config_layout(tp_cfg, tp), tp_cfg.model, tp_cfg.data.seq_len, mb, tp)
    except (ConfigError, ValueError):
        return None
    return None if check else tp_cfg


def _tp_seconds(config: str, device: torch.device) -> float:
    """One rank of the engine's tensor-parallel forward + backward of one micro-batch (flopwise.build)."""
    import torch.distributed as dist

    from flopwise.build import build_engine
    from flopwise.parallel import mesh

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

    return timed(step, device, repeats=3, before=dist.barrier)


def measure_optimizer(cfg: Config, device: torch.device, sizes, progress: Progress) -> list:
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


def measure_ranks(nproc: int, threads: int, device: torch.device, tp_cfg: Config | None, progress: Progress) -> dict:
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
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(nproc),
                "-m",
                "flopwise.calibrate",
                str(out),
                backend,
                str(config) if tp_cfg else "",
            ],
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

    for nbytes in MESSAGE_BYTES[device.type]:
        n = nbytes // 4
        ops = collectives(torch.ones(n, device=device), torch.ones(n // world, device=device))
        for kind, op in ops.items():
            rows[kind].append([world if kind != "send_recv" else 2, nbytes, timed(op, device, before=dist.barrier)])
    hidden = overlap(device)
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # as flopwise.build runs a CPU rank
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
    reps = max(
        1, int(timed(lambda: dist.all_reduce(buf), device, before=dist.barrier) / timed(lambda: a @ a, device))
    )  # as much compute as communication

    def compute():
        for _ in range(reps):
            a @ a

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    t_c = timed(compute, device, before=dist.barrier)
    t_m = timed(lambda: dist.all_reduce(buf), device, before=dist.barrier)
    t_both = timed(both, device, before=dist.barrier)
    return max(0.0, min(1.0, (t_c + t_m - t_both) / min(t_c, t_m)))


def device_entry(device: torch.device) -> tuple[str, Hardware]:
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


def host_memory_bytes() -> float:
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


def require_bf16(cfg: Config) -> None:
    """Only bf16 is measured: the planner reads every table as a share of the 16-bit peak
    (`Hardware.peak_16bit`), so fp32 tables would be misread, and a CPU entry with only an fp32 peak
    is refused by `plan` (an fp32 calibration crashed after a minute of measuring)."""
    if cfg.train.dtype != "bf16":
        raise ConfigError(
            f"train.dtype={cfg.train.dtype}: hardware calibrate measures the bf16 tables the planner "
            "reads (it times every run's compute against the 16-bit peak); drop train.dtype or set "
            'train.dtype="bf16"'
        )


def calibrate(cfg: Config, device: torch.device, nproc: int, progress: Progress) -> Hardware:
    """A hardware entry for `device` with a calibration measured here (see the module docstring).
    On a CPU one device is one of `nproc` ranks: the compute is measured on its share of the cores.
    """
    require_bf16(cfg)
    threads = max(1, (os.cpu_count() or 1) // nproc) if device.type == "cpu" else 0
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(True)  # as flopwise.build runs a CPU rank
    try:
        hw = _calibrate(cfg, device, nproc, threads, progress)
        return replace(hw, recovery=measure_recovery(cfg, device, progress))
    finally:
        torch.set_num_threads(before)


def sweep(cfg: Config, nproc: int, device: torch.device) -> dict:
    """What calibrate measures for `cfg` on `nproc` ranks of `device`: micro-batches, the GEMM
    shapes (capped on a CPU), attention's sequence lengths and head dims."""
    mb = cfg.train.micro_batch or 1
    micro_batches = tuple(sorted({max(1, mb // 4), max(1, mb // 2), mb}))
    tps = tuple(t for t in (1, 2, 4, 8) if t <= max(nproc, 1))
    gemms = [
        s
        for s in gemm_shapes(cfg, tps, micro_batches)
        if device.type != "cpu" or 2 * s[0] * s[1] * s[2] <= CPU_FLOP_CAP
    ]
    seqs = sorted(
        {s for s in (128, 256, 512, 1024, 2048, 4096) if device.type == "cuda" or s <= 1024} | {cfg.data.seq_len}
    )
    return {
        "micro_batches": micro_batches,
        "gemms": gemms,
        "seqs": seqs,
        "head_dims": sorted({cfg.model.head_dim, 64, 128}),
    }


def steps_of(cfg: Config, nproc: int, device: torch.device) -> int:
    """How many measurements calibrate takes (for the progress bar)."""
    s = sweep(cfg, nproc, device)
    return 1 + len(s["gemms"]) + len(s["seqs"]) * len(s["head_dims"]) + len(s["micro_batches"]) + 5 + (nproc >= 2)


def _calibrate(cfg: Config, device: torch.device, nproc: int, threads: int, progress: Progress) -> Hardware:
    dtype_name = cfg.train.dtype
    dtype = DTYPES[dtype_name]
    _, base = device_entry(device)
    peak = measure_matmul_peak(dtype_name, device)
    progress(f"peak {peak / 1e12:.3g} TFLOP/s")
    mb = cfg.train.micro_batch or 1
    s = sweep(cfg, nproc, device)
    micro_batches = s["micro_batches"]
    gemm = measure_gemms(s["gemms"], dtype, device, peak, progress)
    attention = measure_attention(s["head_dims"], s["seqs"], dtype, device, peak, progress)
    bw = stream_bandwidth(device)
    tp_cfg = tp_config(cfg, nproc) if nproc >= 2 else None
    measured = measure_ranks(nproc, threads, device, tp_cfg, progress)
    collectives = measured["collectives"]
    hw = replace(
        base,
        peak_flops={**base.peak_flops, dtype_name: peak},
        memory_bw=bw,
        devices_per_node=max(nproc, 1),
        memory_bytes=base.memory_bytes or host_memory_bytes(),
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
        collectives=tuple((k, tuple(map(tuple, v))) for k, v in sorted(collectives.items()) if v),
    )
    partial = replace(hw, calibration=stub)
    elementwise = [
        elementwise_row(cfg, partial, 1, mb, sec)
        for mb, sec in model_seconds(cfg, device, micro_batches, progress).items()
    ]
    if tp_cfg is not None and measured["tp_seconds"]:
        elementwise.append(elementwise_row(tp_cfg, partial, nproc, mb, measured["tp_seconds"]))
    sizes = [2**20, 2**22, 2**24] if device.type == "cpu" else [2**24, 2**26, 2**28]
    optimizer = measure_optimizer(cfg, device, sizes, progress)
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
    )
    return replace(hw, calibration=cal)


def save(hw: Hardware, path: str | Path) -> Path:
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
