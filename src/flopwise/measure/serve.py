"""`flopwise plan serve --measure`: the planned serving workload generated on this machine, timed
beside the plan (as `plan measure` sets a training step beside its estimate).

One device, the plan's one-device layout (tp = pp = 1) at serve.batch: random prompts (the model
at its seed's initial weights: time does not depend on the values) go through the engine's own
generation path, the model with a KV cache (flopwise.model.layers.KVCache), as the plan prices
it: each request prefilled alone (its cached tokens first, untimed, then its prompt, timed; the
logits of its last token only), the requests' caches joined into one batch, then greedy decode
steps of every request together, each timed. Reported: the batch's prefill seconds (the sum of
its requests') and the mean seconds of a decode step (the plan's mean over the steps' contexts).

Weights run in the dtype the plan's hardware entry computes in (its calibration's, else
train.dtype=auto's choice for it); fp8 and int8 weights are not run here. A warm-up request and
step come first (the first products of a CPU process pay one-off kernel set-up).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from flopwise.config.schema import Config
from flopwise.errors import ConfigError
from flopwise.hardware.catalogue import Hardware, auto_dtype, identify_gpu
from flopwise.model.layers import KVCache
from flopwise.model.transformer import Transformer, build_model
from flopwise.plan.serve import ServeLayout
from flopwise.train.metrics import DTYPES

_WARMUP_STEPS = 2  # decode steps of the warm-up request


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


def measure_serve(cfg: Config, hw: Hardware, layout: ServeLayout) -> dict:
    """Measured prefill and decode of the planned one-device `layout` (its batch of the serve.*
    regime) on this machine (module docstring): {"prefill_s", "decode_s_per_token", ...how it ran}."""
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
        prefill, steps = _generate(model, cfg, batch, s.output_tokens, clock)
        return {
            "prefill_s": prefill,
            "decode_s_per_token": sum(steps) / len(steps),
            "batch": batch,
            "device": str(device),
            "dtype": dtype,
            "threads": torch.get_num_threads() if device.type == "cpu" else 0,
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        }
    finally:
        torch.set_num_threads(threads)


def _clock(device: torch.device) -> Callable[[], float]:
    """Wall seconds with the device drained first."""

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


@torch.no_grad()
def _generate(
    model: Transformer, cfg: Config, batch: int, new_tokens: int, clock: Callable[[], float]
) -> tuple[float, list[float]]:
    """`batch` requests prefilled one by one, then decoded together for new_tokens − 1 steps:
    (the prefills' seconds, each decode step's seconds)."""
    m, s = cfg.model, cfg.serve
    device, dtype = model.tok_embeddings.weight.device, model.tok_embeddings.weight.dtype
    gen = torch.Generator().manual_seed(cfg.run.seed)
    requests = torch.randint(m.vocab_size, (batch, s.cached_tokens + s.prompt_tokens), generator=gen).to(device)
    length = s.cached_tokens + s.prompt_tokens + new_tokens
    caches, first, prefill = [], [], 0.0
    for row in requests:
        cache = KVCache(m, 1, length, device, dtype)
        if s.cached_tokens:
            model(row[None, : s.cached_tokens], cache, last_only=True)
        start = clock()
        first.append(model(row[None, s.cached_tokens :], cache, last_only=True)[:, -1].argmax(-1))
        prefill += clock() - start
        caches.append(cache)
    cache, step = KVCache.join(caches), torch.stack(first, dim=0)
    steps = []
    for _ in range(new_tokens - 1):
        start = clock()
        step = model(step, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
        steps.append(clock() - start)
    return prefill, steps
