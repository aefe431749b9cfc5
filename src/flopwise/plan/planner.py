"""`flopwise plan`: from a config (and which keys the user gave) to ranked layouts, days, GPU-hours,
checkpoint cost and goodput. Pure Python; the CLI only prints what this returns.

Given `parallel.*` keys and `train.micro_batch` are fixed, everything else is searched; with all
of them given, exactly that layout is evaluated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flopwise.flops import count_params
from flopwise.config import Config, validate
from flopwise.errors import ConfigError
from flopwise.hardware import Hardware, cluster_hardware
from flopwise.plan.layout import Layout
from flopwise.plan.perf import FIT_MARGIN, LINK_EFFICIENCY, MEM_EFFICIENCY, RUNTIME_RESERVE, STACKS, Estimate, model_shape
from flopwise.plan.reliability import Reliability, reliability
from flopwise.plan.search import SearchResult, search, why_slower

PARALLEL_KEYS = ("dp", "dp_replicate", "zero", "tp", "pp", "cp", "pp_schedule", "virtual_stages",
                 "sequence_parallel", "recompute")
DEFAULT_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022's rule of thumb, when plan.tokens is not given


def plan_hardware(cfg: Config) -> Hardware:
    hw = cluster_hardware(cfg.cluster)
    if not hw.peak_16bit or not hw.memory_bytes:
        raise ConfigError(f"cluster.hardware={hw.name}: no catalogue peak or memory to plan against; choose an "
                          "accelerator (e.g. cluster.hardware=h100-sxm) or add one with cluster.hardware_file")
    return hw


def fixed_keys(tree: dict[str, Any]) -> dict[str, Any]:
    """The layout keys the user set (config file or overrides), which the search must not change."""
    par = tree.get("parallel", {}) or {}
    fixed = {k: par[k] for k in PARALLEL_KEYS if k in par}
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

    @property
    def best(self) -> Estimate | None:
        return self.result.best

    def reasons(self) -> list[str]:
        best = self.best
        return [why_slower(e, best) if e.fits else e.reason for e in self.result.ranked]

    def to_json(self, top: int) -> dict:
        hw = self.hardware
        gpus = self.cfg.cluster.gpus
        layouts = []
        for e, why in list(zip(self.result.ranked, self.reasons()))[:top]:
            layouts.append({**e.to_json(self.tokens, gpus), "why": why})
        return {
            "model": {"params": self.params, "non_embedding_params": self.non_embedding,
                      "flops_per_token": self.flops_per_token, "seq_len": self.cfg.data.seq_len,
                      "global_batch": self.cfg.train.global_batch},
            "hardware": {"name": hw.name, "gpus": gpus, "devices_per_node": hw.devices_per_node,
                         "peak_bf16_flops": hw.peak_16bit, "memory_bytes": hw.memory_bytes,
                         "memory_bw": hw.memory_bw, "intra_node_bw": hw.intra_node_bw,
                         "inter_node_bw": hw.inter_node_bw, "matmul_efficiency": hw.matmul_efficiency,
                         "source": hw.source},
            "tokens": self.tokens,
            "search": {"evaluated": self.result.evaluated, "fitting": self.result.fitting, "fixed": self.fixed},
            "layouts": layouts,
            "reliability": self.reliability.to_json() if self.reliability else None,
            "assumptions": assumptions(self.cfg.plan.stack),
            "data": [d.__dict__ for d in self.data] if self.data else None,
        }


def assumptions(stack: str) -> dict:
    return {"stack": STACKS[stack].description, "fit_margin": FIT_MARGIN, "runtime_reserve_bytes": RUNTIME_RESERVE,
            "hbm_efficiency": MEM_EFFICIENCY, "link_efficiency": LINK_EFFICIENCY,
            "flop_convention": "6·(matmul params) + 12·L·s·h_attn per token (flopwise.flops); MFU excludes recompute"}


def plan(cfg: Config, tree: dict[str, Any] | None = None, keep: int = 50,
         mixture: Callable[[float], list] | None = None) -> PlanReport:
    """Search layouts for `cfg` on cluster.gpus devices of cluster.hardware. `mixture(tokens)`: what
    the run draws from each data source (the CLI passes data.mixture's draws; the planner reads no data)."""
    hw = plan_hardware(cfg)
    seq, batch = cfg.data.seq_len, cfg.train.global_batch
    sh = model_shape(cfg.model, seq, cfg.data.document_mask)
    fixed = fixed_keys(tree or {})
    tokens = cfg.plan.tokens or DEFAULT_TOKENS_PER_PARAM * sh.params
    # the planned run's length decides train.compile=auto, as train.steps does for the engine; its
    # train.dtype decides what the engine holds (fp32 or bf16 autocast)
    result = search(sh, hw, cfg.cluster.gpus, seq, batch, STACKS[cfg.plan.stack], fixed, keep,
                    compile=cfg.train.compile, steps=tokens / (seq * batch), dtype=cfg.train.dtype)
    if not result.ranked:
        why = result.refused or "check that the degrees multiply to cluster.gpus and divide train.global_batch"
        raise ConfigError(f"no valid layout for {cfg.cluster.gpus} devices with {fixed or 'nothing fixed'}: {why}")
    best = result.best
    rel = None
    if best.fits:
        c = cfg.cluster
        rel = reliability(sh.params, c.gpus, tokens / best.tokens_per_s, c.storage_gbps_per_gpu, c.gpu_mtbf_hours,
                          c.restart_minutes)
    return PlanReport(cfg=cfg, hardware=hw, result=result, tokens=tokens, params=sh.params,
                      non_embedding=count_params(cfg.model).non_embedding,
                      flops_per_token=sh.model_flops_token["none"], reliability=rel, fixed=fixed,
                      data=mixture(tokens) if mixture else None)


def layout_config(cfg: Config, lo: Layout) -> Config:
    """`cfg` with `lo` written into parallel.* and train.micro_batch (for --out-config and layout=auto)."""
    tree = cfg.model_dump(mode="json", exclude_none=True)
    tree["parallel"] = {**tree["parallel"], **{k: getattr(lo, k) for k in PARALLEL_KEYS}, "layout": "manual"}
    tree["train"]["micro_batch"] = lo.micro_batch
    return validate(tree)


def resolve_layout(cfg: Config, tree: dict[str, Any], world: int) -> Config:
    """parallel.layout=auto: fill the unset degrees with the planner's best layout for `world`."""
    if cfg.parallel.layout != "auto":
        return cfg
    if world == 1:  # the only layout there is
        return layout_config(cfg, Layout(micro_batch=cfg.train.micro_batch, recompute=cfg.parallel.recompute))
    cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"gpus": world})})
    report = plan(cfg, tree, keep=1)
    if not report.best.fits:
        raise ConfigError(f"parallel.layout=auto: no layout fits {world} × {report.hardware.name} "
                          f"({report.best.reason}); add devices or shrink the model or micro-batch")
    return layout_config(cfg, report.best.layout)

