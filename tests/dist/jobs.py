"""Jobs the torchrun worker runs: each takes config overrides and returns JSON-able results."""

from pathlib import Path

import torch
import torch.distributed as dist

from flopwise.config.schema import load_config
from flopwise.train.launch import train


def losses(overrides: list[str]) -> dict:
    r = train(load_config(None, overrides))
    return {"losses": r.losses, "val_loss": r.val_loss}


def _setup(overrides: list[str]):
    from flopwise.train.build import build_run

    run = build_run(load_config(None, overrides))
    return run.cfg, run.par, run.engine, run.optimizer, run.loader


def memory(overrides: list[str]) -> dict:
    """Bytes of parameters (after forward), gradients (after backward), optimizer moments (after
    the step) on this rank, gathered from every rank; and Ψ."""
    from flopwise.flops import count_params
    from flopwise.measure import bytes as acc
    from flopwise.parallel.data import local_optimizer

    cfg, par, engine, opt, loader = _setup(overrides)
    model = engine.parts[0]
    x = loader.next_batch()[:, :-1]
    out = model(x)
    params = acc.param_bytes(engine.parts)
    out.float().mean().backward()
    grads = acc.grad_bytes(engine.parts)
    opt.step()
    moments = acc.optimizer_bytes(local_optimizer(opt))
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"params": params, "grads": grads, "optimizer": moments})
    return {"psi": count_params(cfg.model).total, "ranks": per_rank}


def comm(overrides: list[str]) -> dict:
    """Collectives of one training step (forward, backward, clip, optimizer step) on rank 0: each
    call's elements by kind, and the volumes by kind `flopwise plan measure` reports."""
    from flopwise.measure.bytes import CommCounter

    cfg, par, engine, opt, loader = _setup(overrides)
    batch = loader.next_batch()
    with CommCounter() as c:
        engine.forward_backward(batch)
        engine.clip_grad_norm(1.0)
        opt.step()
    return {"calls": dict(c.calls), "elements": dict(c.elements), "sizes": {k: v for k, v in c.sizes.items()},
            "volumes": c.volumes()}


def reshard(overrides: list[str]) -> dict:
    """Load the checkpoint train.resume names into this layout and write it straight back out
    under run.dir (no step taken): a pure resharding of model + optimizer state."""
    from flopwise.checkpoints import checkpoint

    cfg, par, engine, opt, loader = _setup(overrides)
    src = checkpoint.resolve(cfg.checkpoint.resume)
    state = checkpoint.load(src, engine.parts, opt)
    step = state.pop("step")
    checkpoint.save(cfg.run.dir, step, engine.parts, opt, state)
    return {"step": step}


def bench(overrides: list[str]) -> dict:
    """Median step time over 5 steps after 2 warm-up steps, per-rank peak RSS and model-state bytes."""
    import resource
    import statistics
    import time

    from flopwise.flops import count_params
    from flopwise.measure import bytes as acc
    from flopwise.parallel.data import local_optimizer

    cfg, par, engine, opt, loader = _setup(overrides)
    times, states = [], {}
    for i in range(7):
        t0 = time.perf_counter()
        engine.forward_backward(loader.next_batch())
        states = {"params": acc.param_bytes(engine.parts), "grads": acc.grad_bytes(engine.parts)}
        engine.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    states["optimizer"] = acc.optimizer_bytes(local_optimizer(opt))
    mine = {**states, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    return {"step_s": statistics.median(times), "psi": count_params(cfg.model).total, "ranks": per_rank,
            "tokens_per_step": cfg.train.global_batch * cfg.data.seq_len}


def shards(overrides: list[str]) -> dict:
    """Build this rank's model shards (no step) and save each parameter's (global offset, local
    values) to <run.dir>/shards-rank{R}.pt; with model.init_from, also record the bytes read from
    the HF safetensors and the loss of the first validation batch."""
    from flopwise.interop import hf
    from flopwise.model.init import canonical_name, global_box
    from flopwise.data.loader import eval_batches

    read = [0]
    real_open = hf.safe_open

    class CountingSlice:
        def __init__(self, sl):
            self.sl = sl

        def get_shape(self):
            return self.sl.get_shape()

        def __getitem__(self, idx):
            t = self.sl[idx]
            read[0] += t.numel() * t.element_size()
            return t

    class CountingFile:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            return CountingSlice(self.f.get_slice(name))

    hf.safe_open = CountingFile
    try:
        cfg, par, engine, opt, loader = _setup(overrides)
    finally:
        hf.safe_open = real_open
    out = {}
    for m in engine.parts:
        for raw, p in m.named_parameters():
            offset, _ = global_box(p)
            local = p.to_local() if hasattr(p, "to_local") else p
            out[canonical_name(raw)] = (offset, local.detach().clone())
    torch.save(out, Path(cfg.run.dir) / f"shards-rank{dist.get_rank()}.pt")
    rows = cfg.train.micro_batch * engine.n_micro
    loss = engine.eval_loss(next(iter(eval_batches(Path(cfg.data.path), cfg.data.seq_len, rows, 1))))
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, read[0])
    return {"hf_bytes_read": per_rank, "loss": loss, "rows": rows}


def build_memory(overrides: list[str]) -> dict:
    """Peak resident memory each rank adds while building its model shards and optimizer (the
    process's high-water mark, VmHWM, after the build minus before it)."""
    from flopwise.train.build import build_engine
    from flopwise.parallel import mesh

    cfg = load_config(None, overrides)
    par = mesh.init(cfg, torch.device("cpu"))
    def hwm() -> int:
        return int(next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM")).split()[1]) * 1024

    before = hwm()
    build_engine(cfg, par)
    added = hwm() - before
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, added)
    return {"peak_added_bytes": per_rank}


def states(overrides: list[str]) -> dict:
    """What each rank holds (flopwise.measure.step): its mesh coordinates, the layers of its stages, the
    bytes of its parameters at rest, FSDP2's gathered copies and copy kernels, gradients and AdamW
    moments. One measured step and the collectives' step after it: the moments exist from the first
    step, the gradients are read in the second; no high-water mark is asked of these jobs (a step
    of a tensor-parallel layout costs about a second of a 4-rank launch here)."""
    from flopwise.train.build import build_run
    from flopwise.measure.step import gather, measure_rank

    return {"ranks": gather(measure_rank(build_run(load_config(None, overrides)), 1))}


def demo_states(overrides: list[str]) -> dict:
    """`states` for the embedded demo model (6 × 256, vocab 4096), where activations, not the
    collectives' transient buffers, set the high-water mark as they do at scale: the high-water mark
    of the last measured step, once it is steady: the first step allocates the AdamW moments, and
    DDP (ZeRO 0 and 1) rebuilds its buckets in the second, so those layouts measure three steps and
    FSDP2's two. No collectives' step: these jobs are asked the high-water mark only."""
    from flopwise.train.build import build_run
    from flopwise.measure.step import gather, measure_rank

    cfg = load_config("demo", overrides)
    steps = 3 if cfg.parallel.zero < 2 else 2
    return {"ranks": gather(measure_rank(build_run(cfg), steps, collectives=False))}


def activations(overrides: list[str]) -> dict:
    """Bytes autograd keeps for backward over one micro-batch's forward (train.micro_batch rows of
    data.seq_len random tokens, this rank's context shard) on each rank, under the engine's
    autocast, and the bf16 weight copies."""
    from flopwise.train.build import build_engine
    from flopwise.parallel import mesh
    from flopwise.measure.bytes import SavedBytes
    from flopwise.train.engine import autocast

    cfg = load_config(None, overrides)
    par = mesh.init(cfg, torch.device("cpu"))
    engine, _ = build_engine(cfg, par)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.data.seq_len),
                      generator=torch.Generator().manual_seed(0))
    x, inputs = engine.model_inputs(x)
    with autocast(par.device, cfg.train.dtype), SavedBytes(*engine.parts) as s:
        engine.parts[0](x, **inputs)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {"bytes": s.bytes, "weight_copies": s.weight_copies})
    return {"ranks": per_rank}
