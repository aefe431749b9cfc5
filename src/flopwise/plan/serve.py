"""Serving cost planned like training: per tensor/pipeline layout, what a device holds, the largest
batch that fits, prefill and decode time, tokens/s and the cost per million served tokens. Pure
Python, no torch; the time terms are the training step model's (plan.step), not new constants.

The regime (`serve.*`): each request brings `prompt_tokens` new tokens on top of `cached_tokens`
already in its KV cache and generates `output_tokens` (the served tokens); a model replica (tp × pp
devices; cluster.gpus holds gpus / (tp·pp) of them) decodes `batch` requests together.

- Memory per device: the worst pipeline stage's weights at `weights_dtype`; its layers' KV cache
  (K and V of each layer, 16-bit, this rank's kv heads: plan.step.kv_width, so a rank keeps one
  whole head where tp exceeds the kv heads, as Megatron and vLLM shard multi-query attention); one
  layer's transient activations over one request's prompt or one decode micro-batch, whichever is
  larger, and the micro-batch's fp32 logits; the training account's runtime reserve and fit margin.
- Prefill admits one request at a time, its whole prompt (as a continuous-batching engine does),
  so its activations do not grow with the batch; a batch's prefill is `batch` of them.
- Pipeline: in decode the batch is split in pp micro-batches that circulate, one per stage: a step
  of every request takes pp slots of the slowest stage; a batch's prefills, batch + pp − 1 slots.
- Prefill: each layer's weight GEMMs at the roofline of plan.step.gemm_time,
  the attention scores over cached + prompt tokens at fused attention's share of the peak, the
  element-wise work at the streaming rate, the tensor-parallel all-reduces of the activations;
  logits of each request's last token only.
- Decode, one token per request per step, the slowest of three bounds (not summed: the ideal a
  serving engine approaches by overlapping): compute (the same FLOPs at the GEMM share of the
  peak: on a calibrated entry, the share measured at the decode batch's rows), memory (the
  stage's weights and its requests' KV cache read once per step, at the streaming rate; on the
  `cpu` entry the cache's fp32 copy too, which the engine's attention core makes there),
  communication (the all-reduces of b·h per layer on the intra-node link: plan.step.comm_time's
  ring, and the stage boundary's send). On a calibrated entry the engine's fixed work per layer
  (`Calibration.layer_overhead`, measured: a decode step at width 64) comes on top: on a CPU
  after the bound (one core issues and runs every op in turn), on a GPU as a fourth bound (the
  host launches the next kernels while the device runs these).
- Weight-only quantisation: fp8 and int8 weights halve the bytes stored and read; the products
  still run at the 16-bit peak, against which MFU is stated (as Pope et al. state theirs).
- FLOPs: flops.forward_flops_per_token (2N plus the attention scores over the full context, PaLM's
  convention); decode counts the mean context of its steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flopwise.config.schema import Config, ServeConfig
from flopwise.errors import ConfigError
from flopwise.flops import attention_flops_per_token, count_params, forward_flops_per_token
from flopwise.hardware.catalogue import Hardware
from flopwise.layout.rules import Layout, head_split, stage_sizes
from flopwise.plan.planner import plan_hardware
from flopwise.plan.rank_memory import FIT_MARGIN, RUNTIME_RESERVE
from flopwise.plan.shape import Shape, model_shape, rank_loads
from flopwise.plan.step import (
    ACT_BYTES,
    comm_time,
    flash_efficiency,
    gemm_efficiency,
    gemm_time,
    kv_width,
    layer_elementwise_bytes,
    linear_shapes,
    planning_peak,
    stream_time,
)

WEIGHT_BYTES = {"bf16": 2, "fp8": 1, "int8": 1}
LOGIT_BYTES = 4  # fp32 logits, as the training loss keeps them
CPU_KV_CAST = 8  # bytes per cached element on a CPU: model.layers.CoreAttention's fp32 copy, written and read
_MAX_BATCH = 2**20  # the largest batch searched


@dataclass(frozen=True, kw_only=True)
class _Stage:
    """The slowest pipeline stage of a replica: its layers, whether it holds the head, its weights."""

    layers: int
    head: bool
    params: float  # on one tensor-parallel rank


@dataclass(frozen=True, kw_only=True)
class ServeLayout:
    tp: int
    pp: int
    replicas: int
    batch: int
    fits: bool
    reason: str  # why it does not qualify ("" when it does)
    memory: dict  # bytes per device: weights, kv_cache, activations, other, total
    prefill_s: float  # one batch's prompts
    prefill_mfu: float
    decode_s_per_token: float
    decode_bound: str  # compute, memory, communication or (a GPU's) overhead
    decode_terms: dict  # seconds per token of each bound
    tokens_per_s: float  # served (generated) tokens of the whole cluster
    gpu_hours_per_million: float
    cost_per_million_tokens: float | None  # None without cluster.price_per_gpu_hour

    def to_json(self) -> dict:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "batch": self.batch,
            "fits": self.fits,
            "memory_per_device_bytes": {k: round(v) for k, v in self.memory.items()},
            "prefill_s": self.prefill_s,
            "prefill_mfu": self.prefill_mfu,
            "decode_s_per_token": self.decode_s_per_token,
            "decode_bound": self.decode_bound,
            "tokens_per_s": self.tokens_per_s,
            "cost_per_million_tokens": self.cost_per_million_tokens,
        }


@dataclass(frozen=True)
class ServePlan:
    cfg: Config
    hardware: Hardware
    params: int
    layouts: list[ServeLayout]  # best (cheapest qualifying) first

    def to_json(self, top: int | None = None) -> dict:
        return {"layouts": [lay.to_json() for lay in self.layouts[:top]]}


def serve_layouts(cfg: Config, hw: Hardware) -> list[tuple[int, int]]:
    """(tp, pp) whose product divides cluster.gpus, tp within a node and splitting the heads evenly
    (every rank the same number of query heads; kv heads split, or whole ones shared), pp at most
    one layer a stage."""
    m, gpus = cfg.model, cfg.cluster.gpus
    out = []
    for tp in range(1, min(gpus, hw.devices_per_node) + 1):
        if gpus % tp or head_split(m, tp):
            continue
        out += [(tp, pp) for pp in range(1, min(gpus // tp, m.n_layers) + 1) if (gpus // tp) % pp == 0]
    return out


def _context(s: ServeConfig) -> int:
    return s.cached_tokens + s.prompt_tokens + s.output_tokens


def _stage(sh: Shape, tp: int, pp: int) -> _Stage:
    """The stage with the most parameters (this engine's balanced split), and whether it holds the head."""
    lo = Layout(tp=tp, pp=pp)
    loads = rank_loads(sh, lo, balanced=True)
    worst = max(loads, key=lambda load: (load.params, load.head))
    return _Stage(layers=max(stage_sizes(sh.config, lo)), head=any(load.head for load in loads), params=worst.params)


def serve_memory(sh: Shape, s: ServeConfig, tp: int, pp: int, batch: int) -> dict:
    """Bytes one device of the worst stage holds (module docstring)."""
    st = _stage(sh, tp, pp)
    micro = math.ceil(batch / pp)
    kv = batch * _context(s) * st.layers * 2 * kv_width(sh, tp) * ACT_BYTES
    tokens = max(s.prompt_tokens, micro)
    layer = tokens * (2 * sh.d_model + (sh.hq + 2 * kv_width(sh, tp) * tp) / tp + sh.ffn_in * sh.ffn / tp)
    logits = micro * sh.vocab / tp * LOGIT_BYTES
    memory = {
        "weights": st.params * WEIGHT_BYTES[s.weights_dtype],
        "kv_cache": kv,
        "activations": ACT_BYTES * layer + logits,
        "other": RUNTIME_RESERVE,
    }
    return {**memory, "total": sum(memory.values())}


def _layer_comm(sh: Shape, hw: Hardware, tp: int, tokens: float) -> float:
    """Tensor-parallel all-reduces of one layer's output activations: one per branch, one for a
    parallel block (GPT-J, NeoX, PaLM add both branches' partial sums before reducing)."""
    reduces = 1 if sh.config.parallel_block else 2
    return reduces * comm_time(hw, "all_reduce", tp, ACT_BYTES * tokens * sh.d_model, tp)


def _boundary(sh: Shape, hw: Hardware, tp: int, pp: int, tokens: float) -> float:
    """The activations a stage sends its neighbour per slot (pipeline neighbours are tp ranks apart)."""
    return comm_time(hw, "send_recv", 2, ACT_BYTES * tokens * sh.d_model, tp + 1) if pp > 1 else 0.0


def prefill_time(sh: Shape, hw: Hardware, s: ServeConfig, tp: int, pp: int, batch: int) -> float:
    """Seconds to prefill one batch's prompts through the pipeline, one request at a time (module docstring)."""
    st, peak = _stage(sh, tp, pp), planning_peak(hw)
    tokens = s.prompt_tokens
    context = s.cached_tokens + s.prompt_tokens
    gemms = sum(gemm_time(mm, kk, nn, hw, peak) for mm, kk, nn in linear_shapes(sh, tokens, tp))
    scores = tokens * attention_flops_per_token(sh.config, context) / sh.n_layers / tp
    attention = scores / (flash_efficiency(hw, context, sh.head_dim)[0] * peak)
    elementwise, _, act = layer_elementwise_bytes(sh, tokens, tp, sp=False)
    layer = gemms + attention + stream_time(elementwise, hw, act, tp) + _layer_comm(sh, hw, tp, tokens)
    head = gemm_time(1, sh.d_model, sh.vocab / tp, hw, peak) if st.head else 0.0
    slot = st.layers * layer + head + _boundary(sh, hw, tp, pp, tokens)
    return (batch + pp - 1) * slot


def decode_terms(sh: Shape, hw: Hardware, s: ServeConfig, tp: int, pp: int, batch: int) -> dict[str, float]:
    """Seconds per generated token (one step of every request) under each bound (module docstring)."""
    st, peak = _stage(sh, tp, pp), planning_peak(hw)
    micro = math.ceil(batch / pp)
    context = s.cached_tokens + s.prompt_tokens + s.output_tokens / 2  # the mean over the steps
    shapes = linear_shapes(sh, micro, tp) + ([(micro, sh.d_model, sh.vocab / tp)] if st.head else [])
    per_layer = len(shapes) - st.head
    gemm = sum(
        2 * mm * kk * nn / (gemm_efficiency(mm, kk, nn, hw) * peak) * (st.layers if i < per_layer else 1)
        for i, (mm, kk, nn) in enumerate(shapes)
    )
    scores = micro * attention_flops_per_token(sh.config, round(context)) / sh.n_layers / tp * st.layers
    compute = gemm + scores / (flash_efficiency(hw, context, sh.head_dim)[0] * peak)
    read = WEIGHT_BYTES[s.weights_dtype] * (st.layers * sh.layer_params + st.head * sh.vocab * sh.d_model) / tp
    read += micro * context * st.layers * 2 * kv_width(sh, tp) * (ACT_BYTES + (CPU_KV_CAST if hw.name == "cpu" else 0))
    comm = st.layers * _layer_comm(sh, hw, tp, micro) + _boundary(sh, hw, tp, pp, micro)
    terms = {"compute": pp * compute, "memory": pp * stream_time(read, hw), "communication": pp * comm}
    overhead = pp * st.layers * hw.calibration.layer_overhead if hw.calibration else 0.0
    return {**terms, "overhead": overhead}


def decode_step(terms: dict[str, float], hw: Hardware) -> tuple[float, str]:
    """A decode step's seconds and its bound from `decode_terms`: the slowest of the bounds, the
    engine's per-layer overhead added after it on a CPU and one more bound on a GPU (module docstring)."""
    bounds = {k: v for k, v in terms.items() if k != "overhead"}
    if hw.name != "cpu":
        bounds["overhead"] = terms["overhead"]
    bound = max(bounds, key=lambda k: bounds[k])
    return bounds[bound] + (terms["overhead"] if hw.name == "cpu" else 0.0), bound


def _evaluate(cfg: Config, sh: Shape, hw: Hardware, tp: int, pp: int, batch: int, limit: int) -> ServeLayout:
    """One layout at `batch` requests per replica; `limit`: the largest batch that qualifies (0: none)."""
    s, gpus = cfg.serve, cfg.cluster.gpus
    memory = serve_memory(sh, s, tp, pp, batch)
    terms = decode_terms(sh, hw, s, tp, pp, batch)
    decode, bound = decode_step(terms, hw)
    prefill = prefill_time(sh, hw, s, tp, pp, batch)
    replicas = gpus // (tp * pp)
    tokens_per_s = replicas * batch * s.output_tokens / (prefill + s.output_tokens * decode)
    prefill_flops = batch * (
        s.prompt_tokens * forward_flops_per_token(sh.config, s.cached_tokens + s.prompt_tokens)
        - (s.prompt_tokens - 1) * 2 * count_params(sh.config).head_matmul  # logits of the last token only
    )
    gpu_hours = gpus / tokens_per_s * 1e6 / 3600
    price = cfg.cluster.price_per_gpu_hour
    return ServeLayout(
        tp=tp,
        pp=pp,
        replicas=replicas,
        batch=batch,
        fits=batch <= limit,
        reason=_reason(cfg, hw, memory, decode, limit),
        memory=memory,
        prefill_s=prefill,
        prefill_mfu=prefill_flops / (prefill * tp * pp * planning_peak(hw)),
        decode_s_per_token=decode,
        decode_bound=bound,
        decode_terms=terms,
        tokens_per_s=tokens_per_s,
        gpu_hours_per_million=gpu_hours,
        cost_per_million_tokens=price * gpu_hours if price else None,
    )


def _reason(cfg: Config, hw: Hardware, memory: dict, decode: float, limit: int) -> str:
    usable = hw.memory_bytes * (1 - FIT_MARGIN)
    if memory["total"] > usable:
        return f"needs {memory['total'] / 2**30:.1f} GiB of {usable / 2**30:.1f} GiB usable"
    latency = cfg.serve.latency_ms
    if latency and decode * 1e3 > latency:
        return f"decode {decode * 1e3:.3g} ms/token over serve.latency_ms={latency:g}"
    return "" if limit else "no batch fits"


def largest_batch(cfg: Config, sh: Shape, hw: Hardware, tp: int, pp: int) -> int:
    """The largest batch whose memory fits and whose decode step meets serve.latency_ms (0: none);
    both grow with the batch, so a bisection finds it."""
    usable, latency = hw.memory_bytes * (1 - FIT_MARGIN), cfg.serve.latency_ms

    def ok(b: int) -> bool:
        if serve_memory(sh, cfg.serve, tp, pp, b)["total"] > usable:
            return False
        return not latency or decode_step(decode_terms(sh, hw, cfg.serve, tp, pp, b), hw)[0] * 1e3 <= latency

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= _MAX_BATCH and ok(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def plan_serve(cfg: Config) -> ServePlan:
    """Every layout of cluster.gpus serving the model in the serve.* regime, best first: those that
    qualify (fit, and meet the latency target) by cost per served token, then the rest."""
    m, s = cfg.model, cfg.serve
    if _context(s) > m.max_seq_len:
        raise ConfigError(
            f"serve.cached_tokens + prompt_tokens + output_tokens = {_context(s)} exceeds "
            f"model.max_seq_len={m.max_seq_len}; shorten the request or raise model.max_seq_len"
        )
    hw = plan_hardware(cfg)
    sh = model_shape(m, _context(s))
    layouts = []
    for tp, pp in serve_layouts(cfg, hw):
        limit = largest_batch(cfg, sh, hw, tp, pp)
        layouts.append(_evaluate(cfg, sh, hw, tp, pp, s.batch or max(limit, 1), limit))
    if not layouts:
        raise ConfigError(
            f"cluster.gpus={cfg.cluster.gpus}: no tensor-parallel degree within a node splits "
            f"model.n_heads={m.n_heads} and n_kv_heads={m.n_kv_heads} evenly; choose another cluster.gpus"
        )
    layouts.sort(key=lambda lay: (not lay.fits, lay.gpu_hours_per_million, lay.decode_s_per_token))
    return ServePlan(cfg, hw, sh.params, layouts)
