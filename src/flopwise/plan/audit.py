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

import tomllib
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from flopwise.config import ModelConfig, parse_value, validate
from flopwise.errors import ConfigError
from flopwise.flops import count_params, flops_per_token, mfu, scaling_flops
from flopwise.hardware import get_hardware

PLANNER_BAND = 0.10  # the planner's validated error on published throughput (tests/test_plan_validation.py)
CLAIM_KEYS = {"name", "preset", "params", "tokens", "hardware", "devices", "assumed_devices", "seq_len",
              "batch_tokens", "days", "device_hours", "tokens_per_s_per_device", "tflops_per_device",
              "stated_mfu", "stated_flops", "stated", "source", "status"}


def catalogue() -> dict[str, dict[str, Any]]:
    text = (resources.files("flopwise") / "plan" / "data" / "published_runs.toml").read_text(encoding="utf-8")
    return {name: {"name": name, **entry} for name, entry in tomllib.loads(text).items()}


def parse_claim(items: list[str]) -> dict[str, Any]:
    """key=value words into a claim; a bare word names a catalogue entry."""
    claim: dict[str, Any] = {"name": "claim", "stated": [], "source": "user claim", "status": "claim"}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"audit claim {item!r}: expected key=value (keys: {', '.join(sorted(CLAIM_KEYS))})")
        if key not in CLAIM_KEYS:
            raise ConfigError(f"audit claim: unknown key {key!r} (keys: {', '.join(sorted(CLAIM_KEYS))})")
        claim[key] = parse_value(value)
        claim["stated"].append(key)
    return claim


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
        return ModelConfig(preset=claim["preset"], max_seq_len=max(2048, int(claim.get("seq_len", 2048)))), None
    if "params" in claim:
        return None, float(claim["params"])
    return None, None


def audit_claim(claim: dict, predict: bool = True) -> ClaimVerdict:
    m, params = _model(claim)
    seq = int(claim.get("seq_len", 2048))
    notes: list[str] = []
    if m is not None:
        params = count_params(m).total
        fpt = flops_per_token(m, seq)
    elif params is not None:
        fpt = scaling_flops(params, 1)
        notes.append("no shape given (preset=...): FLOPs are 6·N per token, attention not counted")
    else:
        return ClaimVerdict(name=claim["name"], params=0, tokens=None, flops=None, flops_6nd=None, implied_mfu=None,
                       basis="", predicted_mfu=None, predicted_layout=None, verdict="underdetermined",
                       missing=["preset or params"], source=claim.get("source", ""), status=claim.get("status", ""))
    tokens = claim.get("tokens")
    flops = fpt * tokens if tokens else None
    missing = [] if tokens else ["tokens"]
    hw = get_hardware(claim["hardware"]) if "hardware" in claim else None
    peak = hw.peak_16bit if hw else None
    if hw is None:
        missing.append("hardware")
    devices = claim.get("devices")
    implied, basis = None, ""
    if peak:
        if "tokens_per_s_per_device" in claim:
            implied, basis = mfu(claim["tokens_per_s_per_device"], fpt, peak), "tokens/s per device"
        elif flops and "device_hours" in claim:
            implied, basis = mfu(tokens / (claim["device_hours"] * 3600), fpt, peak), "device-hours"
        elif flops and devices and "days" in claim:
            implied, basis = mfu(tokens / (claim["days"] * 86400), fpt, peak, devices), "devices × days"
        elif "stated_mfu" in claim:
            implied, basis = claim["stated_mfu"], "stated MFU"
        elif "tflops_per_device" in claim:
            implied, basis = claim["tflops_per_device"] * 1e12 / peak, "stated TFLOP/s per device (authors' convention)"
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
    if no_fit:
        verdict = "impossible"
    elif implied is None:
        verdict = "underdetermined"
    elif implied > 1:
        verdict = "impossible"
    elif predicted is not None and implied > predicted * (1 + PLANNER_BAND):
        verdict = "optimistic"
    elif predicted is None:  # no planner figure to compare with (no devices, or the planner could not plan)
        verdict = "underdetermined"
    else:
        verdict = "plausible"
    if flops and claim.get("stated_flops"):
        notes.append(f"stated {claim['stated_flops']:.3g} FLOPs vs {flops:.3g} by the convention")
    return ClaimVerdict(name=claim["name"], params=params, tokens=tokens, flops=flops,
                   flops_6nd=scaling_flops(params, tokens) if tokens else None, implied_mfu=implied, basis=basis,
                   predicted_mfu=predicted, predicted_layout=layout, verdict=verdict, missing=missing, notes=notes,
                   source=claim.get("source", ""), status=claim.get("status", ""))


def _predict(claim: dict, devices: int, seq: int) -> tuple[float | None, dict | None, str]:
    """(the planner's best MFU, its layout, why there is none)."""
    from flopwise.plan.planner import plan

    batch = claim.get("batch_tokens", seq * devices) / seq
    batch = max(64, 64 * round(batch / 64))  # published batches are rounded figures; keep dp choices open
    tree = {"model": {"preset": claim["preset"], "max_seq_len": max(2048, seq)},
            "data": {"seq_len": seq}, "train": {"global_batch": batch},
            "cluster": {"hardware": claim["hardware"], "gpus": int(devices)}}
    cfg = validate(tree)
    try:
        report = plan(cfg, {}, keep=1)
    except ConfigError as e:
        return None, None, f"planner: {e}"
    best = report.best
    if not best.fits:
        return None, None, (f"does not fit: {int(devices)} × {claim['hardware']} cannot hold it in any layout "
                            f"(closest: {best.reason})")
    return best.mfu, best.layout.to_json(), ""


def audit(claims: list[dict], predict: bool = True) -> list[ClaimVerdict]:
    return [audit_claim(c, predict) for c in claims]
