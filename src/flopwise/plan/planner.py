"""`flopwise plan`: from a config (and which keys the user gave) to ranked layouts, days, GPU-hours,
checkpoint cost and goodput. Pure Python; the CLI only prints what this returns.

Given `parallel.*` keys and `train.micro_batch` are fixed, everything else is searched; with all
of them given, exactly that layout is evaluated.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flopwise.config.hf_mapping import read_hf_config, tensor_shapes
from flopwise.config.schema import Config, apply_override, hf_model_fields, load_tree, to_toml, validate
from flopwise.errors import ConfigError
from flopwise.files.outputs import check_writable, write_text
from flopwise.flops import count_params
from flopwise.hardware.catalogue import Hardware, cluster_hardware
from flopwise.layout.linears import RECIPES
from flopwise.layout.rules import COMPILE_MIN_STEPS, Layout, check_layout, compiles, config_layout
from flopwise.plan.rank_memory import FIT_MARGIN, RUNTIME_RESERVE
from flopwise.plan.reliability import Reliability, predict_reliability
from flopwise.plan.search import RECOMPUTE_ORDER, SearchResult, search_layouts, why_slower
from flopwise.plan.shape import Shape, model_shape
from flopwise.plan.stack import STACKS
from flopwise.plan.step import LINK_EFFICIENCY, MEM_EFFICIENCY, Estimate, estimate

_PARALLEL_KEYS = (
    "dp",
    "dp_replicate",
    "zero",
    "tp",
    "pp",
    "cp",
    "pp_schedule",
    "virtual_stages",
    "sequence_parallel",
    "recompute",
    "recompute_every",
)
_DEFAULT_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022's rule of thumb, when plan.tokens is not given


# Nominal rates of this CPU for a plan before `hardware calibrate` has measured it (marked
# uncalibrated wherever printed): per core, about half an AVX2 core's FMA peak (2 FMA units × 8 fp32
# lanes × 2 FLOPs × ~3 GHz ≈ 96 GFLOP/s), bf16 no faster without AMX; memory bandwidth of a few DDR
# channels shared by the cores; the machine's physical memory.
CPU_CORE_FLOPS, CPU_MEMORY_BW = 50e9, 20e9


def _nominal_cpu(hw: Hardware) -> Hardware:
    """The `cpu` entry with nominal rates of this machine (CPU_CORE_FLOPS per core, its memory)."""
    cores = os.cpu_count() or 1
    try:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # no sysconf here: a laptop's 16 GiB
        memory = 16 * 2.0**30
    peak = CPU_CORE_FLOPS * cores
    return replace(
        hw,
        peak_flops={"bf16": peak, "fp32": peak},
        memory_bytes=memory,
        memory_bw=CPU_MEMORY_BW,
        intra_node_bw=CPU_MEMORY_BW,
        inter_node_bw=CPU_MEMORY_BW,
        extra={**hw.extra, "uncalibrated": True},
        source=f"UNCALIBRATED nominal rates ({cores} cores × {CPU_CORE_FLOPS / 1e9:.0f} GFLOP/s, "
        f"{CPU_MEMORY_BW / 1e9:.0f} GB/s, {memory / 2**30:.0f} GiB); measure this machine with "
        "`flopwise hardware calibrate --out cpu.toml`, then plan with cluster.hardware_file=cpu.toml "
        "cluster.hardware=NAME (the name it prints)",
    )


def plan_hardware(cfg: Config) -> Hardware:
    hw = cluster_hardware(cfg.cluster)
    if hw.name == "cpu" and not hw.peak_16bit and hw.calibration is None:
        return _nominal_cpu(hw)
    if not hw.peak_16bit or not hw.memory_bytes:
        raise ConfigError(
            f"cluster.hardware={hw.name}: no catalogue peak or memory to plan against; choose an "
            "accelerator (e.g. cluster.hardware=h100-sxm) or add one with cluster.hardware_file"
        )
    return hw


def _fixed_keys(tree: dict[str, Any]) -> dict[str, Any]:
    """The layout keys the user set (config file or overrides), which the search must not change."""
    par = tree.get("parallel", {}) or {}
    fixed = {k: par[k] for k in _PARALLEL_KEYS if k in par}
    if fixed.get("recompute") == "auto":  # the search's own choice: the cheapest that fits
        del fixed["recompute"]
    mb = (tree.get("train", {}) or {}).get("micro_batch")
    if mb is not None:
        fixed["micro_batch"] = mb
    return fixed


@dataclass(kw_only=True)
class PlanReport:
    cfg: Config
    hardware: Hardware
    result: SearchResult
    tokens: float
    params: int
    non_embedding: int
    flops_per_token: int
    reliability: Reliability | None
    fixed: dict
    data: list | None = None  # SourceDraw per source, when data.path / data.sources are prepared folders
    hf: dict | None = None  # `hf_source` of `flopwise plan --hf PATH`

    @property
    def best(self) -> Estimate:
        """The fastest layout, or the closest miss (plan() refuses a search that ranked none)."""
        return self.result.ranked[0]

    def float8_note(self) -> str | None:
        """Whether float8 pays for this shape: with plan.float8, the fastest fitting layout with and
        without it; with train.float8 alone, its best layout beside the same layout without it."""
        searched = self.cfg.plan.float8
        if not searched and self.cfg.train.float8 == "none":
            return None
        if not self.hardware.peak("fp8"):
            return (
                f"plan.float8: {self.hardware.name} has no fp8 peak (no float8 tensor cores); not weighed"
                if searched
                else None
            )
        best = self.result.best_by_float8
        low = min((e for k, e in best.items() if k != "none"), key=lambda e: e.step_time, default=None)
        high = best.get("none")
        if not low or not high:
            return None
        gain = high.step_time / low.step_time
        verdict = "pays" if gain > 1 else "does not pay for this shape (casts cost more than the faster GEMMs save)"
        plain = f"best {self.cfg.train.dtype}" if searched else f"the same layout in {self.cfg.train.dtype}"
        return (
            f"float8 {verdict}: best float8 ({low.float8}) {low.tokens_per_s:,.0f} tok/s vs {plain} "
            f"{high.tokens_per_s:,.0f} tok/s ({gain:.2f}x)"
        )

    def reasons(self) -> list[str]:
        best = self.best
        return [why_slower(e, best) if e.fits else e.reason for e in self.result.ranked]

    def to_json(self, top: int) -> dict:
        hw = self.hardware
        gpus = self.cfg.cluster.gpus
        layouts = []
        for e, why in list(zip(self.result.ranked, self.reasons(), strict=True))[:top]:
            layouts.append({**e.to_json(self.tokens, gpus), "why": why})
        return {
            "params": self.params,
            "hf": self.hf,
            "model": {
                "params": self.params,
                "non_embedding_params": self.non_embedding,
                "flops_per_token": self.flops_per_token,
                "seq_len": self.cfg.data.seq_len,
                "global_batch": self.cfg.train.global_batch,
            },
            "hardware": {
                "name": hw.name,
                "gpus": gpus,
                "devices_per_node": hw.devices_per_node,
                "peak_bf16_flops": hw.peak_16bit,
                "memory_bytes": hw.memory_bytes,
                "memory_bw": hw.memory_bw,
                "intra_node_bw": hw.intra_node_bw,
                "inter_node_bw": hw.inter_node_bw,
                "matmul_efficiency": hw.matmul_efficiency,
                "source": hw.source,
            },
            "tokens": self.tokens,
            "search": {"evaluated": self.result.evaluated, "fitting": self.result.fitting, "fixed": self.fixed},
            "layouts": layouts,
            "reliability": self.reliability.to_json() if self.reliability else None,
            "assumptions": assumptions(self.cfg.plan.stack),
            "data": [d.__dict__ for d in self.data] if self.data else None,
            "float8": self.float8_note(),
        }


def assumptions(stack: str) -> dict:
    return {
        "stack": STACKS[stack].description,
        "fit_margin": FIT_MARGIN,
        "runtime_reserve_bytes": RUNTIME_RESERVE,
        "hbm_efficiency": MEM_EFFICIENCY,
        "link_efficiency": LINK_EFFICIENCY,
        "flop_convention": "6·(matmul params) + 12·L·s·h_attn per token (flopwise.flops); MFU excludes recompute",
    }


def plan_tree(path: str | None, overrides: list[str], hf: str | Path | None = None) -> dict[str, Any]:
    """The key tree `flopwise plan` plans: the config file, its model section replaced by the one
    a Hugging Face config.json (`hf`: a folder or the file) gives, then the overrides, so that
    model.* overrides still apply on top of the HF model (without `hf`: as `flopwise train` reads
    them, model.init_from's continued-pretraining defaults included)."""
    if hf is None:
        return load_tree(path, overrides)
    tree = load_tree(path)
    tree["model"] = hf_model_fields(hf)
    for item in overrides:
        apply_override(tree, item)
    return tree


def _hf_source(path: str | Path) -> dict:
    """What `plan --hf` read: the model_type and, for a folder with weights, its safetensors tensors
    and their elements (from the headers), which the exact parameter count must equal."""
    cfg = read_hf_config(path)
    shapes = tensor_shapes(path) if Path(path).is_dir() else {}
    elements = sum(math.prod(s) for s in shapes.values())
    return {
        "path": str(path),
        "model_type": cfg.get("model_type"),
        "architectures": cfg.get("architectures"),
        "tensors": len(shapes) if shapes else None,
        "elements": elements if shapes else None,
    }


def _float8_choices(cfg: Config, hw: Hardware) -> tuple[str, ...]:
    """The float8 recipes the search weighs: the run's train.float8, and with plan.float8 every
    recipe too where the hardware has an fp8 peak (float8 tensor cores)."""
    extra = RECIPES if cfg.plan.float8 and hw.peak("fp8") else ()
    return tuple(dict.fromkeys((cfg.train.float8, "none" if extra else cfg.train.float8, *extra)))


def _planned_tokens(cfg: Config, sh: Shape) -> float:
    """The planned run's tokens: its length decides train.compile=auto for every estimate."""
    return cfg.plan.tokens or _DEFAULT_TOKENS_PER_PARAM * sh.params


def plan(
    cfg: Config,
    tree: dict[str, Any] | None = None,
    keep: int = 50,
    mixture: Callable[[float], list] | None = None,
    hf: str | Path | None = None,
) -> PlanReport:
    """Search layouts for `cfg` on cluster.gpus devices of cluster.hardware. `mixture(tokens)`: what
    the run draws from each data source (the CLI passes data.mixture's draws; the planner reads no data);
    `hf`: the Hugging Face folder or config.json the model came from (`plan_tree`)."""
    hw = plan_hardware(cfg)
    seq, batch = cfg.data.seq_len, cfg.train.global_batch
    sh = model_shape(cfg.model, seq, cfg.data.document_mask)
    fixed = _fixed_keys(tree or {})
    tokens = _planned_tokens(cfg, sh)
    # the planned run's length decides train.compile=auto, as train.steps does for the engine; its
    # train.dtype decides what the engine holds (fp32 or bf16 autocast)
    result = search_layouts(
        sh,
        hw,
        cfg.cluster.gpus,
        seq,
        batch,
        STACKS[cfg.plan.stack],
        fixed,
        keep,
        compile=cfg.train.compile,
        steps=tokens / (seq * batch),
        dtype=cfg.train.dtype,
        float8=_float8_choices(cfg, hw),
        loss_chunk=cfg.train.loss_chunk_tokens,
    )
    if not result.ranked:
        why = (
            "; ".join(f"{n}× {reason}" for n, reason in result.refused[:3])
            if result.refused
            else "check that the degrees multiply to cluster.gpus and divide train.global_batch"
        )
        raise ConfigError(f"no valid layout for {cfg.cluster.gpus} devices with {fixed or 'nothing fixed'}: {why}")
    best = result.ranked[0]
    if cfg.train.float8 != "none" and not cfg.plan.float8 and hw.peak("fp8") and best.fits:
        # whether the float8 asked for pays: the same layout without it, beside (one estimate, no search)
        result.best_by_float8["none"] = estimate(
            sh,
            hw,
            best.layout,
            seq,
            batch,
            STACKS[cfg.plan.stack],
            compile=cfg.train.compile,
            steps=tokens / (seq * batch),
            dtype=cfg.train.dtype,
            loss_chunk=cfg.train.loss_chunk_tokens,
        )
    rel = None
    if best.fits:
        c = cfg.cluster
        rel = predict_reliability(
            sh.params,
            c.gpus,
            tokens / best.tokens_per_s,
            c.storage_gbps_per_gpu,
            c.gpu_mtbf_hours,
            c.restart_minutes,
            measured=hw.recovery,
        )
    return PlanReport(
        cfg=cfg,
        hardware=hw,
        result=result,
        tokens=tokens,
        params=sh.params,
        non_embedding=count_params(cfg.model).non_embedding,
        flops_per_token=sh.model_flops_token["none"],
        reliability=rel,
        fixed=fixed,
        data=mixture(tokens) if mixture else None,
        hf=_hf_source(hf) if hf is not None else None,
    )


def compile_note(cfg: Config, tokens: float, lo: Layout) -> str:
    """Whether the plan assumes torch.compile for layout `lo` (it changes the activation memory
    booked: a compiled block saves less for backward) and why; and where `flopwise train` with
    train.steps would decide otherwise (train.compile=auto goes by the run's length)."""
    seq, batch = cfg.data.seq_len, cfg.train.global_batch
    steps = tokens / (seq * batch)
    on = compiles(cfg.train.compile, steps, lo)
    if cfg.train.compile != "auto":
        why = f"train.compile={str(cfg.train.compile).lower()}"
    else:
        source = (
            "plan.tokens" if cfg.plan.tokens else f"plan.tokens unset: {_DEFAULT_TOKENS_PER_PARAM} tokens per parameter"
        )
        why = (
            f"train.compile=auto and the planned run is {steps:,.0f} steps ({source}); auto compiles runs of "
            f">= {COMPILE_MIN_STEPS} steps without tp, pp or cp"
        )
    note = f"torch.compile {'assumed' if on else 'not assumed'} ({why})"
    if cfg.train.compile == "auto" and compiles("auto", cfg.train.steps, lo) != on:
        note += (
            f"; `flopwise train` with train.steps={cfg.train.steps} would {'not ' if on else ''}compile: "
            f"plan that run with plan.tokens={cfg.train.steps * seq * batch} or "
            f"train.compile={str(not on).lower()}"
        )
    return note


def layout_config(cfg: Config, lo: Layout) -> Config:
    """`cfg` with `lo` written into parallel.* and train.micro_batch (for --out-config and layout=auto)."""
    tree = cfg.model_dump(mode="json", exclude_none=True)
    tree["parallel"] = {**tree["parallel"], **{k: getattr(lo, k) for k in _PARALLEL_KEYS}, "layout": "manual"}
    tree["train"]["micro_batch"] = lo.micro_batch
    return validate(tree)


def planned_run_config(report: PlanReport) -> Config:
    """The run `report` planned, as a training config (plan --out-config): its best layout, and
    train.steps for the planned tokens, so training it trains what was timed."""
    cfg = layout_config(report.cfg, report.best.layout)
    steps = max(1, round(report.tokens / (cfg.data.seq_len * cfg.train.global_batch)))
    tree = cfg.model_dump(mode="json", exclude_none=True)
    tree["train"]["steps"] = steps
    tree["optim"]["warmup_steps"] = min(cfg.optim.warmup_steps, steps)
    return validate(tree)


def resolve_layout(cfg: Config, tree: dict[str, Any], world: int, per_node: int | None = None) -> Config:
    """parallel.layout=auto: fill the unset degrees with the planner's best layout for `world`
    devices, `per_node` of them in each node (the launcher's; cluster.gpus_per_node wins where set)."""
    if cfg.parallel.layout != "auto":
        return cfg
    if world == 1:  # the only layout there is
        return layout_config(cfg, Layout(micro_batch=cfg.train.micro_batch, recompute=cfg.parallel.recompute))
    cluster = {"gpus": world, **({"gpus_per_node": per_node} if per_node and not cfg.cluster.gpus_per_node else {})}
    cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update=cluster)})
    report = plan(cfg, tree, keep=1)
    if not report.best.fits:
        raise ConfigError(
            f"parallel.layout=auto: no layout fits {world} × {report.hardware.name} "
            f"({report.best.reason}); add devices or shrink the model or micro-batch"
        )
    return layout_config(cfg, report.best.layout)


@dataclass(kw_only=True)
class _MicroBatchLimit:
    """The largest micro-batch that fits under one recompute policy, and what stops the next one."""

    recompute: str
    micro_batch: int | None  # the largest valid micro-batch that fits (None: not even the smallest)
    memory: float | None  # its bytes per device: the search's `total` (reserve included)
    next_micro_batch: int | None  # the next valid micro-batch, which does not fit (None: there is none)
    next_memory: float | None
    # when every valid micro-batch fits: the largest that would, with train.global_batch raised to
    # keep the same number of micro-batches per step (None: a valid one does not fit)
    beyond: tuple[int, int] | None = None
    beyond_capped: bool = False  # `beyond` stopped at MAX_BEYOND, not at the memory

    def to_json(self) -> dict:
        return {
            "recompute": self.recompute,
            "micro_batch": self.micro_batch,
            "memory_bytes": self.memory,
            "next_micro_batch": self.next_micro_batch,
            "next_memory_bytes": self.next_memory,
            "beyond": {"micro_batch": self.beyond[0], "global_batch": self.beyond[1], "capped": self.beyond_capped}
            if self.beyond
            else None,
        }


@dataclass(kw_only=True)
class MicroBatchReport:
    cfg: Config
    hardware: Hardware
    layout: Layout  # the config's, at its own micro-batch and recompute
    valid: list[int]  # the micro-batches the layout rules allow at train.global_batch
    usable_memory: float
    limits: list[_MicroBatchLimit]
    params: int

    def to_json(self) -> dict:
        return {
            "params": self.params,
            "layout": {**self.layout.to_json(), "name": self.layout.name()},
            "world": self.layout.world,
            "hardware": self.hardware.name,
            "memory_bytes": self.hardware.memory_bytes,
            "usable_memory_bytes": self.usable_memory,
            "global_batch": self.cfg.train.global_batch,
            "valid_micro_batches": self.valid,
            "limits": [lim.to_json() for lim in self.limits],
            "assumptions": assumptions(self.cfg.plan.stack),
        }


_MAX_BEYOND = 1 << 16  # micro-batches looked at past the global batch


def max_micro_batch(cfg: Config) -> MicroBatchReport:
    """Per recompute policy, the largest micro-batch the config's own layout fits, by the estimate
    the search ranks by (same stack, dtype, compile decision, fit margin and runtime reserve).
    Valid micro-batches divide the per-rank batch and keep the pipeline's micro-batch rules
    (layout.rules.check_layout); memory need not grow with them (one micro-batch holds no
    accumulated gradients), so every one is evaluated."""
    hw = plan_hardware(cfg)
    seq, batch, stack = cfg.data.seq_len, cfg.train.global_batch, STACKS[cfg.plan.stack]
    sh = model_shape(cfg.model, seq, cfg.data.document_mask)
    world, engine = cfg.cluster.gpus, stack.name == "flopwise"
    base = config_layout(cfg, world)
    reasons = {
        mb: check_layout(replace(base, micro_batch=mb), cfg.model, seq, batch, world, engine)
        for mb in range(1, max(1, batch // base.dp) + 1)
        if batch % (base.dp * mb) == 0
    }
    valid = [mb for mb, why in reasons.items() if why is None]
    if not valid:
        why = next(iter(reasons.values()), None) or check_layout(base, cfg.model, seq, batch, world, engine)
        raise ConfigError(f"plan max-micro-batch: no micro-batch runs {base.name()} on {world} devices: {why}")
    caches: dict[int, dict] = {}

    def total(mb: int, rc: str, gb: int = batch) -> Estimate:  # steps: the run length plan() decides compile by
        return estimate(
            sh,
            hw,
            replace(base, micro_batch=mb, recompute=rc),
            seq,
            gb,
            stack,
            cache=caches.setdefault(gb, {}),
            compile=cfg.train.compile,
            steps=_planned_tokens(cfg, sh) / (seq * gb),
            dtype=cfg.train.dtype,
            float8=cfg.train.float8,
            loss_chunk=cfg.train.loss_chunk_tokens,
        )

    def fits(mb: int, rc: str, per_step: int) -> bool:  # per_step micro-batches per step, as the batch grows
        return total(mb, rc, base.dp * mb * per_step).fits

    limits = []
    for rc in RECOMPUTE_ORDER:
        est = {mb: total(mb, rc) for mb in valid}
        fit = [mb for mb in valid if est[mb].fits]
        best = max(fit, default=None)
        above = [mb for mb in valid if best is None or mb > best]
        nxt = above[0] if above else None
        lim = _MicroBatchLimit(
            recompute=rc,
            micro_batch=best,
            memory=est[best].memory["total"] if best else None,
            next_micro_batch=nxt,
            next_memory=est[nxt].memory["total"] if nxt else None,
        )
        if best is not None and nxt is None:  # the batch, not the memory, is the limit
            per_step = batch // (base.dp * best)  # micro-batches per step, kept as the batch grows
            lo, hi = best, best + 1  # lo fits; find an hi that does not, then bisect
            while hi <= _MAX_BEYOND and fits(hi, rc, per_step):
                lo, hi = hi, 2 * hi
            capped = hi > _MAX_BEYOND
            hi = min(hi, _MAX_BEYOND + 1)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid, rc, per_step) else (lo, mid)
            if lo > best:
                lim.beyond, lim.beyond_capped = (lo, base.dp * lo * per_step), capped and lo == _MAX_BEYOND
        limits.append(lim)
    return MicroBatchReport(
        cfg=cfg,
        hardware=hw,
        layout=base,
        valid=valid,
        usable_memory=est[valid[0]].usable_memory,
        limits=limits,
        params=sh.params,
    )


Mixture = Callable[[float], list]


@dataclass(frozen=True)
class Planned:
    report: PlanReport
    out_config: Path | None  # the training TOML written: None when not asked for or nothing fits
    plot: Path | None


def model_name(cfg: Config, hf: Path | None) -> str:
    """What a plan calls its model: the Hugging Face source, else the preset."""
    return f"{hf} ({cfg.model.arch})" if hf else cfg.model.preset or "model"


def make_plan(
    path: str | None,
    overrides: list[str],
    hf: Path | None = None,
    top: int = 5,
    out_config: Path | None = None,
    plot: Path | None = None,
    mixture_of: Callable[[Config], Mixture | None] | None = None,
) -> Planned:
    """Rank every layout of the config; write the best one's training TOML to `out_config` (when one
    fits) and a memory chart of the `top` layouts to `plot`, both checked writable before the search."""
    for target, option in ((out_config, "--out-config"), (plot, "--plot")):
        if target:
            check_writable(target, option)
    tree = plan_tree(path, overrides, hf)
    cfg = validate(tree)
    report = plan(cfg, tree, mixture=mixture_of(cfg) if mixture_of else None, hf=hf)
    if out_config and report.best.fits:
        write_text(out_config, to_toml(planned_run_config(report)), "--out-config")
    if plot:
        from flopwise.plan.plot import plot_memory

        title = f"{model_name(report.cfg, hf)} on {report.cfg.cluster.gpus} × {report.hardware.name}"
        plot_memory(report.result.ranked[:top], plot, title)
    return Planned(report, out_config if out_config and report.best.fits else None, plot)


def micro_batch_limits(path: str | None, overrides: list[str], hf: Path | None = None) -> MicroBatchReport:
    """The largest micro-batch that fits the config's own layout, per recompute policy."""
    return max_micro_batch(validate(plan_tree(path, overrides, hf)))
