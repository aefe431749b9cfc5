"""A model's whole life in device-hours: training at a stated MFU, serving at the utilisation the
serving plan (`plan.serve`) predicts for a stated regime, and the allocation that minimises their
sum at the compute-optimal model's loss (Sardana & Frankle 2024, priced as they do in their cost
section, but with a planned serving cost instead of 2·N FLOPs per token at training's MFU).

Each candidate N is the shape `choose_shape` gives it (the one the allocation reports and
`--out-config` writes: multi-head attention, so every head keeps its own KV cache), planned on
`cluster.gpus` devices of `--hardware` (default: one node) in the `serve.*` regime; its cost per
served token is the cheapest qualifying layout's device-hours. A shape with no qualifying layout
(too big for the devices, or over serve.latency_ms) cannot serve: its cost is infinite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flopwise.config.schema import Config, ServeConfig, load_config
from flopwise.errors import ConfigError
from flopwise.flops import scaling_flops
from flopwise.hardware.catalogue import Hardware, get_hardware
from flopwise.plan.serve import ServeLayout, plan_serve
from flopwise.scale.fit import fitted_law
from flopwise.scale.laws import Allocation, ChosenShape, Pricing, allocate, choose_shape

# Golden-section steps of the search: its bracket [n_min, N_opt] (a factor of ~10) narrows to
# 0.618^16, 0.05% of N, finer than the shapes themselves (d_model moves in steps of 128)
_SEARCH_STEPS = 16
_SERVE_KEYS = ("cluster.gpus", "cluster.price_per_gpu_hour")


def flops_per_device_hour(hw: Hardware, mfu: float, option: str) -> float:
    """What one device-hour of `hw` computes at `mfu` of its 16-bit dense peak."""
    if not (peak := hw.peak_16bit):
        raise ConfigError(
            f"--hardware {hw.name}: no 16-bit dense peak in the catalogue to turn {option} into device-hours; "
            "choose an accelerator (e.g. h100-sxm)"
        )
    return 3600 * peak * mfu


def _serving_config(overrides: list[str], hardware: str) -> Config:
    """The serving regime: `serve.*`, cluster.gpus (default: one node) and price_per_gpu_hour, on --hardware."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if "=" not in item or not (key.startswith("serve.") or key in _SERVE_KEYS):
            raise ConfigError(
                f"{item!r}: scale optimal takes serve.KEY=VALUE, cluster.gpus=G and cluster.price_per_gpu_hour=P "
                "(the model is the allocation's, the device --hardware)"
            )
    hw = get_hardware(hardware, option="--hardware")
    return load_config(None, [f"cluster.hardware={hw.name}", f"cluster.gpus={hw.devices_per_node}", *overrides])


@dataclass(frozen=True, kw_only=True)
class Lifetime:
    """One allocation's life: its training and serving device-hours, and the compute-optimal
    (Chinchilla) model's at the same demand."""

    allocation: Allocation
    inference_tokens: float
    hardware: str
    mfu: float  # training's
    serve: ServeConfig  # the regime
    gpus: int
    layout: ServeLayout  # the cheapest qualifying serving layout of the allocation's shape
    train_gpu_hours: float
    serve_gpu_hours: float
    chinchilla: Allocation  # the same law and budget with no inference demand
    chinchilla_gpu_hours: float  # its training plus serving the same tokens
    price_per_gpu_hour: float | None

    @property
    def total_gpu_hours(self) -> float:
        return self.train_gpu_hours + self.serve_gpu_hours

    @property
    def saving(self) -> float:
        """The share of the compute-optimal model's lifetime device-hours this allocation saves."""
        return 1 - self.total_gpu_hours / self.chinchilla_gpu_hours

    def to_json(self) -> dict:
        lay, price = self.layout, self.price_per_gpu_hour
        hours = {"train": self.train_gpu_hours, "serve": self.serve_gpu_hours, "total": self.total_gpu_hours}
        return {
            **self.allocation.to_json(),
            "inference_tokens": self.inference_tokens,
            "serving": {
                "hardware": self.hardware,
                "gpus": self.gpus,
                **self.serve.model_dump(),
                "tp": lay.tp,
                "pp": lay.pp,
                "batch": lay.batch,
                "decode_bound": lay.decode_bound,
                "tokens_per_s": lay.tokens_per_s,
                "gpu_hours_per_million": lay.gpu_hours_per_million,
            },
            "gpu_hours": hours,
            "cost": {k: v * price for k, v in hours.items()} if price else None,
            "chinchilla": {
                "params": self.chinchilla.params,
                "tokens": self.chinchilla.tokens,
                "total_gpu_hours": self.chinchilla_gpu_hours,
            },
            "saving": self.saving,
        }


def _serving(cfg: Config, shape: ChosenShape) -> ServeLayout | None:
    """The cheapest qualifying layout serving `shape` in cfg's regime; None where none qualifies."""
    s = cfg.serve
    context = s.cached_tokens + s.prompt_tokens + s.output_tokens
    m = shape.model.model_copy(update={"max_seq_len": max(shape.model.max_seq_len, context)})
    best = plan_serve(cfg.model_copy(update={"model": m})).layouts[0]
    return best if best.fits else None


def lifetime_allocations(
    flops: float,
    laws: list[str],
    inference_tokens: list[float],
    unique_tokens: float | None,
    vocab_size: int,
    hardware: str,
    mfu: float,
    overrides: list[str],
) -> list[Lifetime]:
    """For each law and each demand T: the allocation at the compute-optimal model's loss whose
    training plus serving device-hours are least, and the compute-optimal model's for comparison."""
    cfg = _serving_config(overrides, hardware)
    rate = flops_per_device_hour(get_hardware(hardware, option="--hardware"), mfu, "--inference-tokens")
    layouts: dict[ChosenShape, ServeLayout | None] = {}

    def layout(shape: ChosenShape) -> ServeLayout | None:
        if shape not in layouts:
            layouts[shape] = _serving(cfg, shape)
        return layouts[shape]

    def hours_per_token(shape: ChosenShape) -> float:
        lay = layout(shape)
        return lay.gpu_hours_per_million / 1e6 if lay else math.inf

    pricing = Pricing(
        train=lambda n, d: scaling_flops(n, d) / rate,
        serve=lambda n: hours_per_token(choose_shape(n, vocab_size, count_embeddings=True)),
        unit=f"{cfg.cluster.hardware} device-hours",
        iters=_SEARCH_STEPS,
    )
    out = []
    for name in laws:
        chin = allocate(flops, name, 0.0, unique_tokens, vocab_size, fitted_law(name))
        if layout(chin.shape) is None:
            raise ConfigError(_cannot_serve(cfg, chin))
        for t in inference_tokens:
            a = allocate(flops, name, t, unique_tokens, vocab_size, fitted_law(name), pricing)
            if (lay := layout(a.shape)) is None:
                raise ConfigError(_cannot_serve(cfg, a))
            out.append(
                Lifetime(
                    allocation=a,
                    inference_tokens=t,
                    hardware=cfg.cluster.hardware,
                    mfu=mfu,
                    serve=cfg.serve,
                    gpus=cfg.cluster.gpus,
                    layout=lay,
                    train_gpu_hours=a.flops / rate,
                    serve_gpu_hours=t * hours_per_token(a.shape),
                    chinchilla=chin,
                    chinchilla_gpu_hours=chin.flops / rate + t * hours_per_token(chin.shape),
                    price_per_gpu_hour=cfg.cluster.price_per_gpu_hour,
                )
            )
    return out


def _cannot_serve(cfg: Config, a: Allocation) -> str:
    return (
        f"--inference-tokens: no layout of cluster.gpus={cfg.cluster.gpus} {cfg.cluster.hardware} serves the "
        f"{a.shape.params / 1e9:.3g}B-parameter {a.law} model in the serve.* regime (memory or "
        "serve.latency_ms); raise cluster.gpus or relax the regime"
    )
