"""Pipeline parallelism with torch.distributed.pipelining.

The model is cut by layers into pp·v stages (embedding with the first, final norm + head with the
last; how many layers each: `layout.rules.stage_sizes`, the planner's own rule). Each stage module
is a meta-device model with the other layers deleted (nothing allocated: it is sharded and
materialised later), so parameter names (and checkpoint keys) are those of the
unsplit model and a checkpoint reshards across pp.
Rank r runs `layout.rules.stage_ids`: r, r+pp, ... (looped: GPipe, 1F1B, interleaved 1F1B) or r
and 2·pp−1−r (V-shape: zero-bubble ZB-V and DualPipeV).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from flopwise.config.schema import Config
from flopwise.layout.rules import FIXED_VIRTUAL_STAGES, stage_ids, stage_sizes
from flopwise.model.transformer import Transformer, build_model
from flopwise.parallel.mesh import Parallel

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
V_SHAPED = tuple(FIXED_VIRTUAL_STAGES)  # two stages per rank, in a V


def split_stages(cfg: Config, par: Parallel) -> list[tuple[int, Transformer]]:
    """(stage id, meta-device stage module) for each stage this rank runs."""
    lo = par.layout
    sizes = stage_sizes(cfg.model, lo, pp_layers=cfg.parallel.pp_layers)
    n = len(sizes)
    starts = [sum(sizes[:i]) for i in range(n)]
    out = []
    for sid in stage_ids(par.rank("pp"), lo):
        part = build_model(cfg.model, "meta")
        keep = {str(i) for i in range(starts[sid], starts[sid] + sizes[sid])}
        for key in list(part.layers.keys()):
            if key not in keep:
                del part.layers[key]
        # a stage drops what other stages hold (Transformer checks each for None); its attributes
        # are typed as the whole model has them
        if sid != 0:
            part.tok_embeddings = part.pos_embeddings = part.embed_norm = None  # type: ignore[assignment]
        if sid != n - 1:
            part.norm = part.output = None  # type: ignore[assignment]
        out.append((sid, part))
    return out


def build_schedule(
    parts: list[tuple[int, nn.Module]],
    par: Parallel,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    lo = par.layout
    stages = [PipelineStage(mod, sid, lo.n_stages, par.device, group=par.group("pp")) for sid, mod in parts]
    cls = SCHEDULE_CLASSES[lo.pp_schedule]
    if cls in (ScheduleGPipe, Schedule1F1B):
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)


@contextmanager
def releasing_sends() -> Iterator[None]:
    """Free each pipeline send's tensor once the send is done, not when the step ends.

    torch 2.13's runtime schedules (_PipelineScheduleRuntime: interleaved 1F1B, ZB-V, DualPipeV)
    wait on their sends only as the step ends ("there isn't an obvious time when to wait for
    them", schedules.py), GPipe on its forward sends as the forwards end, and each send's Work
    keeps its tensor until then: a rank holds every activation it sent forward and every gradient
    it sent back, up to 2·m·v stage-boundary tensors (measured: `plan measure` of an interleaved
    pp 2 run held them at both ranks' high-water marks; the Llama 3 405B layout would hold 13.6 GiB
    more). While the schedule runs, each new batch of P2P ops first empties the Work lists of
    finished sends (`is_completed`: the peer has the data), which drops their tensors; the
    schedule's own wait at the end waits on what is left. torch offers no hook for this, so its
    module's `_batch_p2p` is wrapped for the step's duration."""
    original = schedules._batch_p2p
    sent: list[list[dist.Work]] = []

    def batch_p2p(p2p_ops: list[dist.P2POp], desc: str | None = None) -> list[dist.Work]:
        for works in sent:
            if all(w.is_completed() for w in works):
                works.clear()  # the schedule keeps this same list, now empty
        sent[:] = [w for w in sent if w]
        works = original(p2p_ops, desc=desc)
        if works and all(op.op is dist.isend for op in p2p_ops):
            sent.append(works)
        return works

    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = original
