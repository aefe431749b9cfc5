"""`flopwise audit`: check a training claim (published or a user's) against the FLOP convention, the
hardware peak and what the planner can reach. Pure Python.

For each claim: FLOPs by the one convention (`flopwise.flops`) and by 6·N·D; the MFU the claim
implies from its time basis (tokens/s per device, device-hours, or devices × days; else the MFU or
TFLOP/s the authors stated); the planner's best predicted MFU for that model, hardware, device
count, sequence and batch; and a verdict:
- impossible: implied MFU above 100% of the dense peak;
- optimistic: implied MFU above the planner's best by more than its validated ±10% band;
- plausible: at or below what the planner can reach (wall-clock claims include restarts and
  downtime, so well below is normal);
- underdetermined: the claim lacks a time basis or a hardware/device count (named).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from flopwise.config.presets import PRESETS
from flopwise.config.schema import ModelConfig, parse_value, validate
from flopwise.errors import ConfigError
from flopwise.flops import count_params, flops_per_token, mfu, scaling_flops
from flopwise.hardware.catalogue import CATALOGUE, get_hardware

_PLANNER_BAND = 0.10  # the planner's validated error on published throughput (tests/test_plan_validation.py)
# What a claim may state: counts are whole numbers >= 1, amounts finite numbers > 0 (an example each)
_COUNT_KEYS = {"devices": "devices=1024", "assumed_devices": "assumed_devices=1024", "seq_len": "seq_len=8192"}
_AMOUNT_KEYS = {
    "params": "params=70e9",
    "tokens": "tokens=15e12",
    "batch_tokens": "batch_tokens=16e6",
    "days": "days=54",
    "device_hours": "device_hours=6.4e6",
    "tokens_per_s_per_device": "tokens_per_s_per_device=380",
    "tflops_per_device": "tflops_per_device=400",
    "stated_mfu": "stated_mfu=0.41",
    "stated_flops": "stated_flops=3.8e25",
}
_USER_KEYS = {"preset", "hardware", *_COUNT_KEYS, *_AMOUNT_KEYS}
_CLAIM_KEYS = _USER_KEYS | {"name", "stated", "source", "status"}  # the last four: the catalogue's bookkeeping


def catalogue() -> dict[str, dict[str, Any]]:
    text = (resources.files("flopwise") / "plan" / "data" / "published_runs.toml").read_text(encoding="utf-8")
    return {name: {"name": name, **entry} for name, entry in tomllib.loads(text).items()}


def parse_claim(items: list[str]) -> dict[str, Any]:
    """key=value words into a checked claim, or one bare word alone naming a catalogue entry
    (its published numbers are not mixed with a user's: which time basis wins would be hidden)."""
    keys = ", ".join(sorted(_USER_KEYS))
    bare = [item for item in items if "=" not in item]
    if bare:
        entries = catalogue()
        unknown = [b for b in bare if b not in entries]
        if unknown:
            raise ConfigError(
                f"audit claim {unknown[0]!r}: neither key=value (keys: {keys}) nor a catalogue entry "
                f"({', '.join(entries)})"
            )
        if len(items) > 1:
            raise ConfigError(
                f"audit {' '.join(items)}: give one catalogue entry alone (or nothing for all of them), "
                "or a claim of key=value words only"
            )
        return _validate_claim(entries[bare[0]])
    claim: dict[str, Any] = {"name": "claim", "stated": [], "source": "user claim", "status": "claim"}
    for item in items:
        key, _, value = item.partition("=")
        if key not in _USER_KEYS:
            raise ConfigError(f"audit claim: unknown key {key!r} (keys: {keys})")
        claim[key] = parse_value(value)
        claim["stated"].append(key)
    return _validate_claim(claim)


def _validate_claim(claim: dict[str, Any]) -> dict[str, Any]:
    """The claim with every stated number type- and range-checked (counts made int): a negative,
    zero, NaN or text value would otherwise turn into a wrong MFU and verdict, or a crash."""
    where = "audit claim" if claim.get("status") == "claim" else f"audit catalogue entry {claim.get('name')}"
    out = dict(claim)
    for key, value in claim.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        shown = f"{value:.6g}" if number else repr(value)
        if key in _COUNT_KEYS:
            if not (number and math.isfinite(value) and value >= 1 and float(value).is_integer()):
                raise ConfigError(f"{where}: {key}={shown}: expected a whole number >= 1, e.g. {_COUNT_KEYS[key]}")
            out[key] = int(value)
        elif key in _AMOUNT_KEYS:
            if not (number and math.isfinite(value) and value > 0):
                raise ConfigError(f"{where}: {key}={shown}: expected a finite number > 0, e.g. {_AMOUNT_KEYS[key]}")
        elif key == "preset" and (not isinstance(value, str) or value not in PRESETS):
            raise ConfigError(f"{where}: preset={value!r}: unknown preset (list them with `flopwise presets`)")
        elif key == "hardware":
            known = [name for name, hw in CATALOGUE.items() if hw.peak_16bit]
            if value not in known:
                peakless = isinstance(value, str) and value in CATALOGUE
                what = "has no 16-bit dense peak to state an MFU against" if peakless else "unknown hardware"
                raise ConfigError(f"{where}: hardware={value!r}: {what} (known: {', '.join(known)})")
    return out


@dataclass(kw_only=True)
class ClaimVerdict:
    name: str
    params: float
    tokens: float | None
    flops: float | None
    flops_6nd: float | None
    implied_mfu: float | None
    basis: str
    predicted_mfu: float | None
    predicted_layout: dict | None
    verdict: str
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    source: str = ""
    status: str = ""

    def to_json(self) -> dict:
        return self.__dict__.copy()


def _model(claim: dict) -> tuple[ModelConfig | None, float | None]:
    if "preset" in claim:
        return ModelConfig(preset=claim["preset"], max_seq_len=max(2048, claim.get("seq_len", 2048))), None
    if "params" in claim:
        return None, float(claim["params"])
    return None, None


def audit_claim(claim: dict, predict: bool = True) -> ClaimVerdict:
    """One claim's FLOPs by the convention, the MFU its numbers imply, and (`predict`) the planner's
    best MFU for it on its hardware and device count, with a verdict."""
    claim = _validate_claim(claim)
    m, params = _model(claim)
    seq = claim.get("seq_len", 2048)
    notes: list[str] = []
    if m is not None:
        params = count_params(m).total
        fpt = flops_per_token(m, seq)
    elif params is not None:
        fpt = scaling_flops(params, 1)
        notes.append("no shape given (preset=...): FLOPs are 6·N per token, attention not counted")
    else:
        return _without_model(claim)
    tokens = claim.get("tokens")
    flops = fpt * tokens if tokens else None
    missing = [] if tokens else ["tokens"]
    hw = get_hardware(claim["hardware"]) if "hardware" in claim else None
    if hw is None:
        missing.append("hardware")
    devices = claim.get("devices")
    implied, basis = _implied_mfu(claim, fpt, flops, hw.peak_16bit if hw else None)
    if implied is None and not missing:
        missing.append("time (tokens_per_s_per_device, device_hours, days or stated_mfu)")
    predicted, layout = None, None
    n_dev = devices or claim.get("assumed_devices")
    if predict and m is not None and hw is not None and n_dev:
        if not devices:
            notes.append(f"device count not published: the planner assumed {n_dev}")
        predicted, layout, why = _predict(claim, n_dev, seq)
        if why:
            notes.append(why)
    elif predict and hw is not None and not n_dev:
        missing.append("devices")
    no_fit = predict and layout is None and any(n.startswith("does not fit") for n in notes)
    verdict = _verdict(no_fit, implied, predicted)
    if flops and claim.get("stated_flops"):
        notes.append(f"stated {claim['stated_flops']:.3g} FLOPs vs {flops:.3g} by the convention")
    return ClaimVerdict(
        name=claim["name"],
        params=params,
        tokens=tokens,
        flops=flops,
        flops_6nd=scaling_flops(params, tokens) if tokens else None,
        implied_mfu=implied,
        basis=basis,
        predicted_mfu=predicted,
        predicted_layout=layout,
        verdict=verdict,
        missing=missing,
        notes=notes,
        source=claim.get("source", ""),
        status=claim.get("status", ""),
    )


def _without_model(claim: dict) -> ClaimVerdict:
    """A claim with neither a preset nor a parameter count: nothing to compute."""
    return ClaimVerdict(
        name=claim["name"],
        params=0,
        tokens=None,
        flops=None,
        flops_6nd=None,
        implied_mfu=None,
        basis="",
        predicted_mfu=None,
        predicted_layout=None,
        verdict="underdetermined",
        missing=["preset or params"],
        source=claim.get("source", ""),
        status=claim.get("status", ""),
    )


def _implied_mfu(claim: dict, fpt: float, flops: float | None, peak: float | None) -> tuple[float | None, str]:
    """The MFU the claim's own numbers imply over the 16-bit `peak`, and which numbers: the first
    of throughput, device-hours, devices × days, a stated MFU or stated TFLOP/s per device."""
    if not peak:
        return None, ""
    tokens, devices = claim.get("tokens"), claim.get("devices")
    if "tokens_per_s_per_device" in claim:
        return mfu(claim["tokens_per_s_per_device"], fpt, peak), "tokens/s per device"
    if flops and "device_hours" in claim:
        return mfu(tokens / (claim["device_hours"] * 3600), fpt, peak), "device-hours"
    if flops and devices and "days" in claim:
        return mfu(tokens / (claim["days"] * 86400), fpt, peak, devices), "devices × days"
    if "stated_mfu" in claim:
        return claim["stated_mfu"], "stated MFU"
    if "tflops_per_device" in claim:
        return claim["tflops_per_device"] * 1e12 / peak, "stated TFLOP/s per device (authors' convention)"
    return None, ""


def _verdict(no_fit: bool, implied: float | None, predicted: float | None) -> str:
    """impossible (does not fit, or MFU over 1), underdetermined, optimistic (above the planner's
    best by more than PLANNER_BAND) or plausible."""
    if no_fit:
        return "impossible"
    if implied is None:
        return "underdetermined"
    if implied > 1:
        return "impossible"
    if predicted is not None and implied > predicted * (1 + _PLANNER_BAND):
        return "optimistic"
    if predicted is None:  # no planner figure to compare with (no devices, or the planner could not plan)
        return "underdetermined"
    return "plausible"


def _predict(claim: dict, devices: int, seq: int) -> tuple[float | None, dict | None, str]:
    """(the planner's best MFU, its layout, why there is none)."""
    from flopwise.plan.planner import plan

    batch = claim.get("batch_tokens", seq * devices) / seq
    batch = max(64, 64 * round(batch / 64))  # published batches are rounded figures; keep dp choices open
    tree = {
        "model": {"preset": claim["preset"], "max_seq_len": max(2048, seq)},
        "data": {"seq_len": seq},
        "train": {"global_batch": batch},
        "cluster": {"hardware": claim["hardware"], "gpus": int(devices)},
    }
    cfg = validate(tree)
    try:
        report = plan(cfg, {}, keep=1)
    except ConfigError as e:
        return None, None, f"planner: {e}"
    best = report.best
    if not best.fits:
        return (
            None,
            None,
            (
                f"does not fit: {int(devices)} × {claim['hardware']} cannot hold it in any layout "
                f"(closest: {best.reason})"
            ),
        )
    return best.mfu, best.layout.to_json(), ""


def audit_claims(claims: list[dict], predict: bool = True) -> list[ClaimVerdict]:
    return [audit_claim(c, predict) for c in claims]
