"""Jobs the torchrun worker runs: each takes config overrides and returns JSON-able results."""

from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

from flopwise.config import load_config
from flopwise.train.trainer import train


def losses(overrides: list[str]) -> dict:
    r = train(load_config(None, overrides), Console(quiet=True))
    return {"losses": r.losses, "val_loss": r.val_loss}


def _setup(overrides: list[str]):
    from flopwise.parallel import mesh
    from flopwise.train.trainer import build, ensure_data

    cfg = load_config(None, overrides)
    par = mesh.init(cfg, torch.device("cpu"))
    data_dir = ensure_data(cfg, Path(cfg.run.dir), Console(quiet=True))
    return (cfg, par, *build(cfg, par, data_dir))


def memory(overrides: list[str]) -> dict:
    """Bytes of parameters (after forward), gradients (after backward), optimizer moments (after
    the step) on this rank, gathered from every rank; and Ψ."""
    from flopwise.flops import count_params
    from flopwise.parallel import accounting as acc
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
    """Collectives of one training step (forward, backward, clip, optimizer step) on rank 0."""
    from flopwise.parallel.accounting import CommCounter

    cfg, par, engine, opt, loader = _setup(overrides)
    batch = loader.next_batch()
    with CommCounter() as c:
        engine.forward_backward(batch)
        engine.clip_grad_norm(1.0)
        opt.step()
    return {"calls": dict(c.calls), "elements": dict(c.elements), "sizes": {k: v for k, v in c.sizes.items()}}


def reshard(overrides: list[str]) -> dict:
    """Load the checkpoint train.resume names into this layout and write it straight back out
    under run.dir (no step taken): a pure resharding of model + optimizer state."""
    from flopwise.train import checkpoint

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
    from flopwise.parallel import accounting as acc
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
