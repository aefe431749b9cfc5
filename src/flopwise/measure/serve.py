"""`flopwise plan serve --measure`: the planned serving workload generated on this machine, timed
beside the plan (as `plan measure` sets a training step beside its estimate).

One device, the plan's one-device layout (tp = pp = 1) at serve.batch: random prompts (the model
at its seed's initial weights: time does not depend on the values) go through the engine's own
generation path, the model with a KV cache (flopwise.model.layers.KVCache), as the plan prices
it: each request prefilled alone (its cached tokens first, untimed, then its prompt, timed; the
logits of its last token only), the requests' caches joined into one batch, then greedy decode
steps of every request together, each timed. Reported: the batch's prefill seconds (the sum of
its requests') and the mean seconds of a decode step (the plan's mean over the steps' contexts).

A shared machine moves wall time between one moment and the next, so the whole workload (prefill
then decode) runs `rounds` times, back to back, and each figure is the median over the rounds: a
row's prefill and decode are timed together, under the same load. Beside the wall seconds, the
process's CPU seconds of the same spans (`*_cpu_*`): with one thread on a CPU they are what the
work cost whatever else runs, and the load average at the end says how busy the machine was.

Weights run in the dtype the plan's hardware entry computes in (its calibration's, else
train.dtype=auto's choice for it); fp8 and int8 weights are not run here. A warm-up request and
step come first (the first products of a CPU process pay one-off kernel set-up).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from flopwise.config.schema import Config, ModelConfig
from flopwise.errors import ConfigError
from flopwise.hardware.catalogue import Hardware, auto_dtype, identify_gpu
from flopwise.model.layers import KVCache
from flopwise.model.transformer import Transformer, build_model
from flopwise.plan.serve import ServeLayout
from flopwise.train.metrics import DTYPES

_WARMUP_STEPS = 2  # decode steps of the warm-up request
_NARROW = 64  # width, head size and vocabulary of the model whose decode step is all per-op cost
_OVERHEAD_STEPS = 32  # decode steps timed for it


def serve_device(hw: Hardware) -> torch.device:
    """The device `hw` describes on this machine: a GPU of its name, or this CPU for `cpu` (the
    built-in entry or the one `hardware calibrate` wrote); one line otherwise."""
    if hw.name == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        if hw.name in (identify_gpu(props.name, props.total_memory), "-".join(props.name.lower().split())):
            return torch.device("cuda", 0)
    raise ConfigError(
        f"cluster.hardware={hw.name}: --measure runs on this machine, which has no such device; "
        "plan with cluster.hardware=cpu (or the entry `flopwise hardware calibrate` wrote for this machine)"
    )


def measure_dtype(hw: Hardware) -> str:
    """What the planned device computes in: its calibration's dtype, else train.dtype=auto's."""
    return hw.calibration.dtype if hw.calibration else auto_dtype(hw)


def measure_serve(cfg: Config, hw: Hardware, layout: ServeLayout, rounds: int = 3) -> dict:
    """Measured prefill and decode of the planned one-device `layout` (its batch of the serve.*
    regime) on this machine, the median of `rounds` (module docstring): {"prefill_s",
    "decode_s_per_token", their CPU seconds, ...how it ran}."""
    s, batch = cfg.serve, layout.batch
    if s.batch is None:
        raise ConfigError(f"serve.batch: --measure runs a stated batch; set it (the plan's largest here: {batch})")
    if cfg.cluster.gpus != 1:
        raise ConfigError(f"cluster.gpus={cfg.cluster.gpus}: --measure runs one device here; set cluster.gpus=1")
    if not layout.fits:
        raise ConfigError(f"serve.batch={batch}: the plan says it does not fit here ({layout.reason}); lower it")
    if s.weights_dtype != "bf16":
        raise ConfigError(f"serve.weights_dtype={s.weights_dtype}: --measure runs 16-bit weights only; drop it")
    if s.output_tokens < 2:
        raise ConfigError("serve.output_tokens=1: --measure times decode steps after the first token; set 2 or more")
    device, dtype = serve_device(hw), measure_dtype(hw)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads((hw.calibration.threads if hw.calibration else 0) or os.cpu_count() or 1)
    try:
        model = build_model(cfg.model, device, seed=cfg.run.seed).to(DTYPES[dtype]).eval()
        clock = _clock(device)
        _generate(model, cfg, 1, _WARMUP_STEPS + 1, clock)
        runs = [_generate(model, cfg, batch, s.output_tokens, clock) for _ in range(rounds)]
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        return {
            **median,
            "rounds": rounds,
            "batch": batch,
            "device": str(device),
            "dtype": dtype,
            "threads": torch.get_num_threads() if device.type == "cpu" else 0,
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        }
    finally:
        torch.set_num_threads(threads)


def _clock(device: torch.device) -> Callable[[], tuple[float, float]]:
    """(wall, process CPU) seconds with the device drained first."""

    def now() -> tuple[float, float]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter(), time.process_time()

    return now


@torch.no_grad()
def _generate(
    model: Transformer, cfg: Config, batch: int, new_tokens: int, clock: Callable[[], tuple[float, float]]
) -> dict[str, float]:
    """`batch` requests prefilled one by one, then decoded together for new_tokens − 1 steps: the
    prefills' seconds and the mean decode step's, wall and CPU."""
    m, s = cfg.model, cfg.serve
    device, dtype = model.tok_embeddings.weight.device, model.tok_embeddings.weight.dtype
    gen = torch.Generator().manual_seed(cfg.run.seed)
    requests = torch.randint(m.vocab_size, (batch, s.cached_tokens + s.prompt_tokens), generator=gen).to(device)
    length = s.cached_tokens + s.prompt_tokens + new_tokens
    caches, first, prefill = [], [], [0.0, 0.0]
    for row in requests:
        cache = KVCache(m, 1, length, device, dtype)
        if s.cached_tokens:
            model(row[None, : s.cached_tokens], cache, last_only=True)
        start = clock()
        first.append(model(row[None, s.cached_tokens :], cache, last_only=True)[:, -1].argmax(-1))
        prefill = [total + end - begin for total, end, begin in zip(prefill, clock(), start, strict=True)]
        caches.append(cache)
    cache, step = KVCache.join(caches), torch.stack(first, dim=0)
    start = clock()
    for _ in range(new_tokens - 1):
        step = model(step, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
    decode = [(end - begin) / (new_tokens - 1) for end, begin in zip(clock(), start, strict=True)]
    return {
        "prefill_s": prefill[0],
        "prefill_cpu_s": prefill[1],
        "decode_s_per_token": decode[0],
        "decode_cpu_s_per_token": decode[1],
    }


@torch.no_grad()
def layer_overhead(m: ModelConfig, device: torch.device, dtype: torch.dtype) -> float:
    """Seconds a decode step of this engine costs per layer beyond its FLOPs and bytes: a step of
    `m`'s architecture and depth at width, head size and vocabulary 64 (one head, one request, a
    64-token cache), whose products and reads are too small to take time, over its layers. It is
    the eager engine's fixed work per layer (Python, dispatch, a few dozen tiny kernels), which a
    decode step of a small model pays as much as its products."""
    narrow = ModelConfig(
        **{
            **m.model_dump(exclude={"preset", "init_from"}),
            "d_model": _NARROW,
            "n_heads": 1,
            "n_kv_heads": 1,
            "head_dim": _NARROW,
            "ffn_dim": 2 * _NARROW,
            "vocab_size": _NARROW,
            "max_seq_len": 2 * _NARROW + _OVERHEAD_STEPS,
            "rope_scaling": None,
            "sliding_window": None,
        }
    )
    model = build_model(narrow, device, seed=0).to(dtype).eval()
    cache = KVCache(narrow, 1, narrow.max_seq_len, device, dtype)
    step = model(torch.zeros(1, _NARROW, dtype=torch.long, device=device), cache, last_only=True)[:, -1].argmax(-1)
    clock, times = _clock(device), []
    for _ in range(_OVERHEAD_STEPS):
        start = clock()
        step = model(step[:, None], cache, last_only=True)[:, -1].argmax(-1)
        times.append(clock()[0] - start[0])
    return statistics.median(times[_WARMUP_STEPS:]) / m.n_layers
