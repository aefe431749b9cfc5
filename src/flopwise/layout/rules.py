"""A parallel layout and the rules that make it valid for a model, a batch and a world size.

Pure Python. The same rules are used by the planner's search (to enumerate) and by the engine (to
refuse a layout before any process group exists): `check_layout` holds the rules of any layout, and,
with engine=True (the `flopwise` stack), the limits of this engine too, so the search never offers a
layout the engine refuses and the engine never meets one the planner did not foresee. The mesh
order is (pp, dp_replicate, dp_shard, cp, tp), innermost tp, so tensor-parallel ranks sit next to
each other inside a node.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from flopwise.config.schema import Config, ModelConfig
from flopwise.errors import ConfigError
from flopwise.flops import count_params

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "dualpipev")
# Schedules that place several stages on each rank (torch's ZBV and DualPipeV use exactly two).
FIXED_VIRTUAL_STAGES = {"zero-bubble": 2, "dualpipev": 2}


@dataclass(frozen=True, kw_only=True)
class Layout:
    dp: int = 1  # all data-parallel ranks: dp_replicate × dp_shard
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp_replicate: int = 1
    zero: int = 0
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    recompute_every: int = 1  # op and full: every Nth block of a stage
    sequence_parallel: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    def microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch)

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all: pp × stages per rank (two for the V-shaped schedules)."""
        return self.pp * (FIXED_VIRTUAL_STAGES.get(self.pp_schedule, self.virtual_stages) if self.pp > 1 else 1)

    @property
    def fsdp2(self) -> bool:
        """Whether this engine's data parallelism runs on FSDP2, which computes with all-gathered
        (under bf16: bf16) copies of the fp32 parameters: fully_shard for ZeRO 2/3 on more than one
        rank, or its replicate for ZeRO-0 with tensor parallel (DDP does not take DTensors)."""
        return (self.zero >= 2 and self.world > 1) or (self.zero == 0 and self.tp > 1 and self.dp * self.cp > 1)

    @property
    def reshards_params(self) -> bool:
        """Whether this engine frees gathered parameters after each forward (ZeRO-3). Under
        pipelining a stage keeps them across its micro-batches (re-gathering per micro-batch would
        multiply the traffic), so there zero 3 holds parameters as zero 2 does."""
        return self.zero >= 3 and self.pp == 1

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Layout:
        """From `to_json` output (a checkpoint's record may carry extra keys, e.g. world_size)."""
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def name(self, detail: bool = False) -> str:
        """ "pp2·dp2·tp2 zero3": the degrees above 1 ("single" for one process); with `detail` a
        second line: sequence parallel, the schedule, the micro-batch and recompute (plot labels)."""
        dims = [f"{k}{getattr(self, k)}" for k in ("pp", "dp", "cp", "tp") if getattr(self, k) > 1]
        if self.dp_replicate > 1:
            dims.append(f"hsdp{self.dp_replicate}")
        out = ("·".join(dims) or "single") + (f" zero{self.zero}" if self.zero and self.dp > 1 else "")
        if not detail:
            return out
        more = ["sp"] if self.sequence_parallel else []
        if self.pp > 1:
            more.append(self.pp_schedule + (f"×{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        return out + "\n" + " ".join(more + [f"mb{self.micro_batch}", self.policy])

    @property
    def policy(self) -> str:
        """The recompute policy as tables show it: "op", "full/2" (every second block)."""
        return self.recompute + (f"/{self.recompute_every}" if self.recompute_every > 1 else "")


@lru_cache(maxsize=4096)
def balanced_stages(n_layers: int, n_stages: int, block: float, first: float, last: float) -> tuple[int, ...]:
    """Layers per stage (contiguous, at least one each) minimising the largest stage's parameters,
    where the first stage also holds `first` (embeddings) and the last `last` (norm + head)."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"{n_stages} stages for {n_layers} layers")
    best: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {}

    def solve(stage: int, start: int) -> tuple[float, tuple[int, ...]]:
        """Best split of layers start.. over stages stage..n_stages-1."""
        if (stage, start) in best:
            return best[stage, start]
        left = n_stages - stage
        result: tuple[float, tuple[int, ...]] = (float("inf"), ())
        max_take = n_layers - start - (left - 1)
        takes = [max_take] if left == 1 else range(1, max_take + 1)
        for take in takes:
            cost = take * block + (first if stage == 0 else 0) + (last if stage == n_stages - 1 else 0)
            rest = solve(stage + 1, start + take) if left > 1 else (0.0, ())
            worst = max(cost, rest[0])
            if worst < result[0]:
                result = (worst, (take, *rest[1]))
        best[stage, start] = result
        return result

    return solve(0, 0)[1]


def stage_sizes(
    m: ModelConfig, lo: Layout, balanced: bool = True, pp_layers: tuple[int, ...] | list[int] | None = None
) -> tuple[int, ...]:
    """Layers per pipeline stage: `pp_layers` as given, else balanced by parameter count with the
    embedding on the first stage and norm + head on the last (this engine), else even with the
    remainder on the first stages (Megatron-LM, the published runs)."""
    n = lo.n_stages
    if pp_layers is not None:
        return tuple(pp_layers)
    if not balanced or n == 1:
        base, rem = divmod(m.n_layers, n)
        return tuple(base + (1 if i < rem else 0) for i in range(n))
    c = count_params(m)
    return balanced_stages(m.n_layers, n, c.per_layer, c.embed_side, c.head_side)


def stage_ids(rank: int, lo: Layout) -> list[int]:
    """The stages pipeline rank `rank` runs: r, r + pp, ... (looped schedules) or r and 2·pp−1−r
    (V-shaped: zero-bubble ZB-V and DualPipeV)."""
    if lo.pp > 1 and lo.pp_schedule in FIXED_VIRTUAL_STAGES:
        return [rank, 2 * lo.pp - 1 - rank]
    return [rank + i * lo.pp for i in range(lo.n_stages // lo.pp)]


def min_microbatches(schedule: str, pp: int) -> int:
    """The fewest micro-batches per step torch 2.13's class for `schedule` takes on pp ranks
    (torch/distributed/pipelining/schedules.py): Schedule1F1B.__init__ refuses fewer than its
    stages (one per rank: pp), ScheduleDualPipeV.__init__ fewer than its stages (two per rank:
    2·pp); ScheduleGPipe has no check (fill-drain), ScheduleZBVZeroBubble pads to 2·pp − 1 and drops
    the padding, and ScheduleInterleaved1F1B takes any count its rounds, max(1, n // pp), divide."""
    return {"1f1b": pp, "dualpipev": 2 * pp}.get(schedule, 1)


def _schedule_microbatches(lo: Layout, global_batch: int) -> str | None:
    """Why torch's schedule class would refuse this step's micro-batch count (None: it takes it),
    with the train.micro_batch or train.global_batch that fixes it."""
    n, dp, mb, sched = lo.microbatches(global_batch), lo.dp, lo.micro_batch, lo.pp_schedule
    given = f"train.global_batch={global_batch} / (dp={dp} · train.micro_batch={mb}) gives {n}"
    need = min_microbatches(sched, lo.pp)
    if n < need:
        what = {"1f1b": f"one per stage, pp={lo.pp}", "dualpipev": f"one per stage, 2·pp={need}"}[sched]
        smaller = next(
            (b for b in range(mb - 1, 0, -1) if global_batch % (dp * b) == 0 and global_batch // (dp * b) >= need), None
        )
        fix = (
            f"set train.micro_batch={smaller}"
            if smaller
            else f"raise train.global_batch to {need * dp * mb} (a multiple of dp·micro_batch={dp * mb})"
        )
        return f"parallel.pp_schedule={sched} needs at least {need} micro-batches per step ({what}): {given}; {fix}"
    rounds = max(1, n // lo.pp)  # ScheduleInterleaved1F1B.__init__'s number_of_rounds
    if sched == "interleaved-1f1b" and n % rounds:
        return (
            f"parallel.pp_schedule=interleaved-1f1b runs the micro-batches in max(1, n // pp={lo.pp}) = {rounds} "
            f"rounds, which must divide them: {given}; change train.micro_batch or train.global_batch so the "
            f"count is at most pp or a multiple of its rounds (e.g. a multiple of pp={lo.pp})"
        )
    return None


def head_split(m: ModelConfig, tp: int) -> str | None:
    """Why `tp` ranks cannot share the attention heads (None if they can): every rank the same number
    of query heads, and kv heads split or, where tp exceeds them, whole ones replicated. Training's
    layouts and the serving plan's both obey it."""
    if m.n_heads % tp:
        return f"parallel.tp={tp} does not divide model.n_heads={m.n_heads}"
    if m.n_kv_heads % tp and tp % m.n_kv_heads:
        return (
            f"parallel.tp={tp} and model.n_kv_heads={m.n_kv_heads}: one must divide the other "
            "(kv heads are replicated when tp exceeds them)"
        )
    return None


def check_layout(
    layout: Layout,
    m: ModelConfig,
    seq_len: int,
    global_batch: int,
    world: int | None = None,
    engine: bool = True,
    pp_layers: tuple[int, ...] | list[int] | None = None,
) -> str | None:
    """None if the layout can run (on this engine, unless engine=False: a published stack's layout),
    else a one-line reason naming the keys and the fix."""
    lo = layout
    if world is not None and lo.world != world:
        return (
            f"parallel degrees pp={lo.pp} × dp={lo.dp} × cp={lo.cp} × tp={lo.tp} = {lo.world} "
            f"but the world size is {world}; make their product equal the number of processes"
        )
    if lo.recompute_every > 1 and lo.recompute not in ("op", "full", "auto"):
        return f"parallel.recompute_every={lo.recompute_every} applies to parallel.recompute=op or full"
    if lo.dp % lo.dp_replicate:
        return f"parallel.dp_replicate={lo.dp_replicate} does not divide parallel.dp={lo.dp}"
    if why := head_split(m, lo.tp):
        return why
    if m.ffn_dim % lo.tp:
        return f"parallel.tp={lo.tp} does not divide model.ffn_dim={m.ffn_dim}"
    if lo.sequence_parallel and lo.tp == 1:
        return "parallel.sequence_parallel needs parallel.tp > 1"
    if seq_len % (2 * lo.cp) and lo.cp > 1:
        return f"data.seq_len={seq_len} must be divisible by 2·parallel.cp={2 * lo.cp} (head-tail chunks)"
    if lo.sequence_parallel and (seq_len // lo.cp) % lo.tp:
        return f"data.seq_len/cp={seq_len // lo.cp} must be divisible by parallel.tp={lo.tp} for sequence parallel"
    if global_batch % (lo.dp * lo.micro_batch):
        return (
            f"train.global_batch={global_batch} is not a multiple of dp·micro_batch="
            f"{lo.dp}·{lo.micro_batch}; change train.micro_batch or the dp degree"
        )
    if lo.pp_schedule not in SCHEDULES:
        return f"parallel.pp_schedule={lo.pp_schedule!r}: choose one of {', '.join(SCHEDULES)}"
    v_needed = FIXED_VIRTUAL_STAGES.get(lo.pp_schedule)
    if lo.pp > 1 and v_needed and lo.virtual_stages != v_needed:
        return (
            f"parallel.pp_schedule={lo.pp_schedule} uses {v_needed} stages per rank; "
            f"set parallel.virtual_stages={v_needed}"
        )
    if lo.virtual_stages > 1 and lo.pp_schedule in ("gpipe", "1f1b"):
        return (
            f"parallel.virtual_stages={lo.virtual_stages} needs pp_schedule interleaved-1f1b, zero-bubble or dualpipev"
        )
    if lo.pp * lo.virtual_stages > m.n_layers:
        return f"pp·virtual_stages={lo.pp * lo.virtual_stages} exceeds model.n_layers={m.n_layers}"
    if lo.pp > 1 and engine and (reason := _schedule_microbatches(lo, global_batch)):
        return reason
    n_micro = lo.microbatches(global_batch)
    if lo.pp > 1 and not engine and (n_micro < lo.pp or lo.pp_schedule == "interleaved-1f1b" and n_micro % lo.pp):
        return (
            f"{n_micro} micro-batches for pp={lo.pp}: the published stacks run at least pp, interleaved a "
            "multiple of pp (Megatron-LM's check); change train.micro_batch or train.global_batch"
        )
    if engine:
        return engine_limits(lo, m, pp_layers)
    if lo.pp > 1 and m.n_layers % lo.n_stages:
        return (
            f"Megatron-LM splits layers evenly: model.n_layers={m.n_layers} must be divisible by "
            f"pp·virtual_stages={lo.n_stages}"
        )
    return None


def engine_limits(lo: Layout, m: ModelConfig, pp_layers: tuple[int, ...] | list[int] | None = None) -> str | None:
    """Layouts valid in general that flopwise's engine does not run, each with the fix.

    ZeRO-1 with tensor parallel (Megatron's and Llama 3's layout) is refused because torch 2.13
    has no component that runs it (checked 2026-12-04, 4 gloo ranks, tp2 × dp2):
    - ZeroRedundancyOptimizer over the DTensor parameters (gradients all-reduced by FSDP2's
      replicate, which takes them) fails in its first step: `_sync_params` ->
      `_broadcast_params_from_rank` calls dist.broadcast on each DTensor
      (torch/distributed/optim/zero_redundancy_optimizer.py:803), and DTensor has no rule for it:
      "NotImplementedError: Operator c10d.broadcast_.default does not have a sharding strategy
      registered".
    - DDP(device_mesh=<the dp sub-mesh>), torch's "temporary work around to enable DDP + TP"
      (torch/nn/parallel/distributed.py:874 -> torch/distributed/tensor/parallel/ddp.py), swaps
      the DTensor parameters for local ones, but its forward pre-hook `_reconstruct_dtensor`
      sets plain DTensor attributes, so after the first forward the module has no registered
      parameters: `_localize_dtensor` then finds none, gradient clipping sees no gradients (norm
      0: the third step's loss leaves one process's, 6.18398 vs 6.18408) and DCP's
      get_model_state_dict raises "model state_dict is empty" at the first checkpoint.
    ZeRO-0 with tensor parallel runs on FSDP2's replicate (parallel/data.py).

    Two stages or more per pipeline rank (interleaved 1F1B, ZB-V, DualPipeV) under DDP (ZeRO 0 or
    1 without tensor parallel) are refused: torch 2.13's reducer fails in the first backward
    (checked 2026-12-08, 4 gloo ranks, pp2 × dp2, zero 0 and 1, interleaved and ZB-V: "params_.size()
    == rebuilt_param_indices_.size() INTERNAL ASSERT FAILED", reducer.cpp:2003); FSDP2 runs them."""
    if lo.pp > 1 and m.tie_embeddings:
        return (
            "model.tie_embeddings=true puts the embedding and the head on different pipeline stages; "
            "set model.tie_embeddings=false or parallel.pp=1"
        )
    if (
        lo.pp > 1
        and pp_layers is not None
        and (len(pp_layers) != lo.n_stages or sum(pp_layers) != m.n_layers or min(pp_layers) < 1)
    ):
        return (
            f"parallel.pp_layers={list(pp_layers)} must give every one of the pp·virtual_stages stages "
            f"at least one layer and sum to model.n_layers={m.n_layers}"
        )
    if lo.cp > 1 and m.pos == "relative":
        return "model.pos=relative (Transformer-XL) has no context-parallel form; set parallel.cp=1"
    if lo.tp > 1 and m.pos == "relative":
        return "model.pos=relative (Transformer-XL) has no tensor-parallel plan; set parallel.tp=1"
    if lo.tp > 1 and m.n_kv_heads % lo.tp:
        return (
            f"parallel.tp={lo.tp} exceeds model.n_kv_heads={m.n_kv_heads}: this engine shards kv heads and "
            "does not replicate them; use parallel.tp <= n_kv_heads"
        )
    if lo.tp > 1 and lo.sequence_parallel and m.pos == "learned":
        return "parallel.sequence_parallel with model.pos=learned is not supported; set sequence_parallel=false"
    if lo.tp > 1 and lo.zero == 1 and lo.dp * lo.cp > 1:
        return (
            f"parallel.zero=1 with parallel.tp={lo.tp}: torch's ZeroRedundancyOptimizer cannot broadcast "
            "tensor-parallel (DTensor) parameters; use parallel.zero=0, 2 or 3"
        )
    if lo.n_stages > lo.pp > 1 and not lo.fsdp2 and lo.dp * lo.cp > 1:
        return (
            f"parallel.pp_schedule={lo.pp_schedule} runs {lo.n_stages // lo.pp} stages per rank, which torch's "
            f"DDP (parallel.zero={lo.zero}) cannot; use parallel.zero=2 or 3, or parallel.dp=1"
        )
    return None


# train.compile=auto compiles runs at least this long: a cold compile costs 10-20 s on a 2-core CPU
# (warm inductor cache: ~3 s) and saves 30-50% of a ladder-shape step, so it repays itself within
# about a thousand steps; shorter runs (the demo, the tests) start at once.
COMPILE_MIN_STEPS = 1000


def compiles(setting: bool | str, steps: float, lo: Layout) -> bool:
    """Whether a run of `steps` steps with train.compile=`setting` compiles its blocks (and, without
    tensor parallel, its loss): the engine applies it, and the planner books what a compiled block
    saves for backward. `auto` keeps to the layouts whose compiled path is tested against eager
    (one process, data parallel with any ZeRO stage)."""
    if setting != "auto":
        return bool(setting)
    return steps >= COMPILE_MIN_STEPS and lo.tp == lo.pp == lo.cp == 1


# train.loss_chunk_tokens=auto chunks the head and loss of a micro-batch whose fp32 logits (this
# rank's vocabulary shard) exceed this, into chunks of at most this: beyond it the loss's fp32
# log-softmax, kept per micro-batch in flight, and its backward's working set set a large-vocabulary
# rank's peak (Llama 3 405B's last pipeline rank, an 8B Llama under FSDP); below it recomputing the
# head's forward would cost time for bytes that do not matter.
LOSS_CHUNK_BYTES = 2**28


def loss_chunk_tokens(setting: int | str, tokens: int, vocab: int, tp: int = 1) -> int:
    """Tokens per chunk of the checkpointed head + cross-entropy of a micro-batch of `tokens`
    tokens (this engine's Transformer.forward given targets; the planner books the same), or 0:
    the whole micro-batch's logits at once. `setting`: train.loss_chunk_tokens (0: never chunk)."""
    if setting != "auto":
        return min(int(setting), tokens)
    per_token = 4 * vocab / tp
    if tokens * per_token <= LOSS_CHUNK_BYTES:
        return 0
    return max(1, int(LOSS_CHUNK_BYTES // per_token))


def config_layout(cfg: Config, world: int) -> Layout:
    """The layout the config's parallel.* and train.micro_batch give on `world` devices (dp: what
    the other degrees leave), unchecked (layout_of checks it)."""
    p = cfg.parallel
    dp = p.dp if p.dp is not None else max(1, world // (p.tp * p.pp * p.cp))
    return Layout(
        dp=dp,
        tp=p.tp,
        pp=p.pp,
        cp=p.cp,
        dp_replicate=p.dp_replicate,
        zero=p.zero,
        pp_schedule=p.pp_schedule,
        virtual_stages=p.virtual_stages,
        micro_batch=cfg.train.micro_batch,
        recompute=p.recompute,
        recompute_every=p.recompute_every,
        sequence_parallel=p.sequence_parallel,
    )


def layout_of(cfg: Config, world: int) -> Layout:
    """The layout the config asks for on `world` processes (dp: what is left), checked: a layout the
    engine cannot run is refused in one line, without torch (`flopwise config check` before a job)."""
    lo = config_layout(cfg, world)
    reason = check_layout(
        lo, cfg.model, cfg.data.seq_len, cfg.train.global_batch, world, pp_layers=cfg.parallel.pp_layers
    )
    if reason and world == 1 and lo.world > 1:
        reason += f" (launch with: torchrun --nproc-per-node {lo.world} -m flopwise train ...)"
    if reason:
        raise ConfigError(reason)
    return lo
