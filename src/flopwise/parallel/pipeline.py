"""Pipeline parallelism with torch.distributed.pipelining.

The model is cut by layers into pp·v stages (embedding with the first, final norm + head with the
last). Each stage module is a meta-device model with the other layers deleted (nothing allocated:
it is sharded and materialised later), so parameter names (and checkpoint keys) are those of the
unsplit model and a checkpoint reshards across pp.
Rank r runs stages r, r+pp, ... (looped: GPipe, 1F1B, interleaved 1F1B) or r and 2·pp−1−r
(V-shape: zero-bubble ZB-V and DualPipeV).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from flopwise.config import Config
from flopwise.flops import count_params
from flopwise.model.transformer import Transformer, build_model
from flopwise.parallel.mesh import Parallel
from flopwise.plan.layout import balanced_stages

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
                    "zero-bubble": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
V_SHAPED = ("zero-bubble", "dualpipev")


def stage_ids(rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(virtual_stages)]


def layers_per_stage(cfg: Config) -> list[int]:
    """Explicit parallel.pp_layers, else balanced by parameter count (embedding counts on the first
    stage, norm + head on the last)."""
    p, m = cfg.parallel, cfg.model
    n = p.pp * p.virtual_stages
    if p.pp_layers is not None:
        return list(p.pp_layers)
    c = count_params(m)
    head = m.vocab_size * m.d_model  # untied under pipelining
    block = (c.total - c.embedding) / m.n_layers  # blocks (and the final norm, a rounding error)
    return list(balanced_stages(m.n_layers, n, block, c.embedding - head, head))


def split_stages(cfg: Config, par: Parallel) -> list[tuple[int, Transformer]]:
    """(stage id, meta-device stage module) for each stage this rank runs."""
    lo = par.layout
    sizes = layers_per_stage(cfg)
    n = len(sizes)
    starts = [sum(sizes[:i]) for i in range(n)]
    out = []
    for sid in stage_ids(par.rank("pp"), lo.pp, lo.virtual_stages, lo.pp_schedule):
        part = build_model(cfg.model, "meta")
        keep = {str(i) for i in range(starts[sid], starts[sid] + sizes[sid])}
        for key in list(part.layers.keys()):
            if key not in keep:
                del part.layers[key]
        if sid != 0:
            part.tok_embeddings = part.pos_embeddings = part.embed_norm = None
        if sid != n - 1:
            part.norm = part.output = None
        out.append((sid, part))
    return out


def build_schedule(parts: list[tuple[int, nn.Module]], par: Parallel, n_microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    lo = par.layout
    n = lo.pp * (2 if lo.pp_schedule in V_SHAPED else lo.virtual_stages)
    stages = [PipelineStage(mod, sid, n, par.device, group=par.group("pp")) for sid, mod in parts]
    cls = SCHEDULE_CLASSES[lo.pp_schedule]
    if cls in (ScheduleGPipe, Schedule1F1B):
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
