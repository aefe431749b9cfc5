"""Layout search: enumerate every valid layout for a world size, drop what does not fit, rank by
predicted tokens/s, and say why each runner-up loses. Pure Python.

Given keys are fixed; the rest are enumerated: tp over powers of two that divide the heads (up to
a node unless tp is given), cp over powers of two that divide the sequence, pp over divisors of
what is left, zero 0-3, dp_replicate over powers of two (hybrid sharding), every schedule and
virtual-stage count for pp > 1, micro-batches dividing the per-rank batch, and recompute. Sequence
parallelism is on whenever tp > 1 (it never costs time, Korthikanti et al. 2022 Table 4) unless
given; on the megatron stacks the model's backward re-gather of it can cost a small layer more in
latency than it saves in norm and dropout traffic, which this rule does not look for. For one
(layout minus recompute), recompute is tried none → selective → op → full and the first that fits
is kept: a heavier recompute with everything else equal is never faster (parallel.recompute=auto
is this choice, for the config's own layout in the engine). ZeRO-0
is searched only when dp = 1: with dp > 1 stage 1 moves the same bytes (reduce-scatter +
16-bit all-gather instead of an all-reduce) and shards the optimizer, so it is never slower and
always smaller. Under pipelining only micro-batches that leave at least pp micro-batches are
tried (GPipe, ZB-V and interleaved 1F1B take fewer, but then the stages idle most of the step);
where none does, micro-batch 1 is judged (check_layout's torch rule, then this floor, unless the
schedule or micro-batch is fixed) so the refusal is counted. Hybrid sharding is tried with the shard group that
fills one node, never with shard groups of one rank (dp_replicate = dp, cp = 1), which replicate
everything under a ZeRO-2/3 label and pay FSDP2's costs (asked for explicitly, the engine runs it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from flopwise.hardware.catalogue import Hardware
from flopwise.layout.rules import FIXED_VIRTUAL_STAGES, SCHEDULES, Layout, check_layout
from flopwise.plan.shape import Shape
from flopwise.plan.stack import Stack
from flopwise.plan.step import Estimate, estimate

RECOMPUTE_ORDER = ("none", "selective", "op", "full")
_MAX_MICRO_BATCH = 64


@dataclass(kw_only=True)
class SearchResult:
    ranked: list[Estimate]  # fitting layouts, fastest first (or the closest misses if none fits)
    evaluated: int
    fitting: int
    # why `check_layout` refused layouts: (count, an example) per kind of reason, most common first
    refused: list[tuple[int, str]] = field(default_factory=list)
    best_by_float8: dict = field(default_factory=dict)  # recipe -> its fastest fitting estimate

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def _pow2_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def _divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending, in O(sqrt n) steps: paired below and above its square root
    (counting to n itself took minutes at cluster.gpus=1e9)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0] if n > 0 else []
    return low + [n // d for d in reversed(low) if d * d != n]


def candidates(sh: Shape, hw: Hardware, world: int, seq: int, global_batch: int, fixed: dict, balanced: bool = True):
    """Yield layouts (recompute left to the caller when not fixed) that pass `check_layout`."""
    m = sh.config
    tps = (
        [fixed["tp"]]
        if "tp" in fixed
        else [t for t in _pow2_upto(min(hw.devices_per_node, m.n_heads)) if m.n_heads % t == 0 and m.ffn_dim % t == 0]
    )
    cps = [fixed["cp"]] if "cp" in fixed else [c for c in _pow2_upto(16) if seq % (2 * c) == 0 or c == 1]
    for tp in tps:
        for cp in cps:
            if world % (tp * cp):
                continue
            rest = world // (tp * cp)
            pps = [fixed["pp"]] if "pp" in fixed else [p for p in _divisors(rest) if p <= m.n_layers]
            for pp in pps:
                if rest % pp:
                    continue
                dp = rest // pp
                if "dp" in fixed and fixed["dp"] != dp:
                    continue
                per_rank = global_batch // dp
                # at least pp micro-batches; none can: micro-batch 1 alone, for check_layout to judge by the schedule
                mbs = [b for b in _divisors(per_rank) if b <= _MAX_MICRO_BATCH and per_rank // b >= pp] or [1]
                if "micro_batch" in fixed or global_batch % dp:  # a dp that does not divide the batch is
                    mbs = [fixed.get("micro_batch", 1)]  # yielded once, for check_layout to name
                sps = [fixed["sequence_parallel"]] if "sequence_parallel" in fixed else [tp > 1]
                zeros = [fixed["zero"]] if "zero" in fixed else ([0] if dp == 1 else [1, 2, 3])
                reps = [fixed["dp_replicate"]] if "dp_replicate" in fixed else _replicas(dp, tp * cp, hw)
                for sched, v in _schedules(pp, m.n_layers, fixed, balanced):
                    for zero in zeros:
                        for rep in reps:
                            if rep > 1 and zero == 0:
                                continue  # replicated DP is already "all replicas"
                            if "dp_replicate" not in fixed and rep == dp and cp == 1 and zero >= 2:
                                continue  # shard groups of one rank
                            for mb in mbs:
                                for sp in sps:
                                    yield Layout(
                                        dp=dp,
                                        tp=tp,
                                        pp=pp,
                                        cp=cp,
                                        dp_replicate=rep,
                                        zero=zero,
                                        pp_schedule=sched,
                                        virtual_stages=v,
                                        micro_batch=mb,
                                        sequence_parallel=sp,
                                        recompute=fixed.get("recompute", "none"),
                                        recompute_every=fixed.get("recompute_every", 1),
                                    )


def _replicas(dp: int, inner: int, hw: Hardware) -> list[int]:
    """Plain sharding, and the hybrid whose shard group is the smallest that leaves a node."""
    reps = [1]
    for r in _pow2_upto(dp):
        if dp % r == 0 and r > 1 and (dp // r) * inner <= hw.devices_per_node:
            reps.append(r)
            break
    return reps


def _schedules(pp: int, n_layers: int, fixed: dict, balanced: bool = True) -> list[tuple[str, int]]:
    """(schedule, v) pairs. Even-split stacks (Megatron-LM) run v only where it divides the layers
    per rank, so they are offered every such v; balanced stacks a fixed few."""
    if pp == 1:
        return [(fixed.get("pp_schedule", "1f1b"), fixed.get("virtual_stages", 1))]
    out = []
    for s in [fixed["pp_schedule"]] if "pp_schedule" in fixed else SCHEDULES:
        if s in FIXED_VIRTUAL_STAGES:
            vs = [FIXED_VIRTUAL_STAGES[s]]
        elif s == "interleaved-1f1b":
            vs = (
                [v for v in (2, 3, 4, 6, 8) if pp * v <= n_layers]
                if balanced
                else [v for v in _divisors(n_layers // pp) if v > 1 and n_layers % pp == 0]
            )
        else:
            vs = [1]
        if "virtual_stages" in fixed:
            vs = [v for v in vs if v == fixed["virtual_stages"]]
        out += [(s, v) for v in vs]
    return out


def search_layouts(
    sh: Shape,
    hw: Hardware,
    world: int,
    seq: int,
    global_batch: int,
    stack: Stack,
    fixed: dict | None = None,
    keep: int = 50,
    compile: bool | str = "auto",
    steps: float = math.inf,
    dtype: str = "bf16",
    float8: tuple[str, ...] = ("none",),
    loss_chunk: int | str = "auto",
) -> SearchResult:
    """Every valid layout's estimate under each float8 recipe of `float8`, the fitting ones fastest
    first (`compile`, `steps`, `dtype`, `loss_chunk`: the run's, as plan.step.estimate)."""
    fixed = dict(fixed or {})
    cache: dict = {}
    fits: list[Estimate] = []
    misses: list[Estimate] = []
    evaluated = 0
    recomputes = [fixed["recompute"]] if "recompute" in fixed else list(RECOMPUTE_ORDER)
    kinds: dict[str, list] = {}  # a refusal's rule (before its ": ", numbers blanked) -> [count, first example]
    for base in candidates(sh, hw, world, seq, global_batch, fixed, stack.balanced_stages):
        reason = check_layout(base, sh.config, seq, global_batch, engine=stack.name == "flopwise")
        if (
            reason is None
            and base.pp > 1
            and base.microbatches(global_batch) < base.pp
            and not {"micro_batch", "pp_schedule"} & fixed.keys()
        ):
            reason = (
                f"{base.microbatches(global_batch)} micro-batches for pp={base.pp}: searched with at least pp "
                "(fewer idle the stages most of the step); raise train.global_batch, or fix "
                "parallel.pp_schedule=gpipe to plan with fewer"
            )
        if reason is not None:
            kinds.setdefault(re.sub(r"\d+", "#", reason.split(": ")[0]), [0, reason])[0] += 1
            continue
        for f8 in float8:
            for rc in recomputes:
                est = estimate(
                    sh,
                    hw,
                    replace(base, recompute=rc),
                    seq,
                    global_batch,
                    stack,
                    cache=cache,
                    compile=compile,
                    steps=steps,
                    dtype=dtype,
                    float8=f8,
                    loss_chunk=loss_chunk,
                )
                evaluated += 1
                if est.fits:
                    fits.append(est)
                    break
                if not fits:
                    misses.append(est)
    fits.sort(key=lambda e: (-e.tokens_per_s, e.memory["total"]))  # on a tie, the headroom
    refused = sorted(((n, why) for n, why in kinds.values()), key=lambda r: -r[0])
    if fits:
        best_by: dict[str, Estimate] = {}
        for e in fits:
            best_by.setdefault(e.float8, e)
        return SearchResult(
            ranked=fits[:keep], evaluated=evaluated, fitting=len(fits), refused=refused, best_by_float8=best_by
        )
    misses.sort(key=lambda e: e.memory["total"])
    return SearchResult(ranked=misses[:keep], evaluated=evaluated, fitting=0, refused=refused)


def why_slower(e: Estimate, best: Estimate) -> str:
    """The time-breakdown terms that make `e` slower than `best`, largest first."""
    if e is best:
        return "fastest"
    loss = e.step_time / best.step_time - 1
    deltas = sorted(((e.time[k] - best.time[k], k) for k in e.time), reverse=True)
    parts = [f"{k} +{d:.3g} s" for d, k in deltas[:2] if d > 0]
    return f"{loss:+.1%} step time: " + (", ".join(parts) if parts else "equal terms")
