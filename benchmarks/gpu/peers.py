"""One GPU, side by side: flopwise's training step against HF transformers and nanoGPT at the same
shape and regime, one after another on the same device.

    python benchmarks/gpu/peers.py --nanogpt ~/src/nanoGPT/model.py --out benchmarks/gpu/results/gpu_peers.json
    python benchmarks/gpu/peers.py --tiny                 # the same code on CPU with tiny shapes (path check)

Regime for every peer: fp32 master weights, bf16 autocast, torch.compile, fused AdamW (lr 3e-4,
betas 0.9/0.95, wd 0.1), gradient clipping at 1.0, synthetic tokens (uniform over the vocabulary:
throughput does not depend on them), seq 2048, batch 8; tokens/s is the median step after warm-up.
- Llama: flopwise (its trainer's own `train_step`) vs `transformers.LlamaForCausalLM` (sdpa, its own
  `labels=` loss) at Llama 3.2-1B's block shape (16 x 2048, 32 heads, 8 kv heads, SwiGLU 8192; 32K vocab).
- GPT: flopwise's `gpt2` arch (bias off, as nanoGPT is run) vs nanoGPT's `GPT` (`--nanogpt PATH`,
  Karpathy's model.py from a local checkout, never downloaded or vendored) at 24 x 2048, 16 heads, 50304 vocab.
MFU divides model FLOPs (flopwise.flops, one convention for all peers) by the device's catalogue
dense bf16 peak, identified from its driver name as the trainer does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "throughput"))  # train_cpu.py's peers
from _out import report  # noqa: E402  (benchmarks/gpu/_out.py: this script's folder is on sys.path)
from flopwise.flops import flops_per_token, mfu  # noqa: E402
from flopwise.hardware.catalogue import CATALOGUE  # noqa: E402
from flopwise.train.metrics import device_peak  # noqa: E402
from train_cpu import flopwise_config, flopwise_step, fused_adamw, nanogpt_step, peer_step  # noqa: E402

SHAPES = {
    "llama": dict(
        arch="llama",
        n_layers=16,
        d_model=2048,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        ffn_dim=8192,
        vocab_size=32000,
        seq=2048,
        batch=8,
    ),
    "gpt": dict(
        arch="gpt2",
        n_layers=24,
        d_model=2048,
        n_heads=16,
        n_kv_heads=16,
        head_dim=128,
        ffn_dim=8192,
        vocab_size=50304,
        seq=2048,
        batch=8,
        bias=False,
    ),
}
TINY = dict(n_layers=2, d_model=64, n_heads=4, head_dim=16, ffn_dim=256, vocab_size=512, seq=64, batch=4)


def flopwise_overrides(shape: dict, device: torch.device) -> list[str]:
    extra = [
        f'model.arch="{shape["arch"]}"',
        f'train.device="{device.type}"',
        "train.compile=" + ("true" if device.type == "cuda" else "false"),
    ]
    return extra + ([f"model.bias={str(shape['bias']).lower()}"] if "bias" in shape else [])


def transformers_step(shape: dict, device: torch.device) -> Callable[[torch.Tensor], None]:
    from transformers import LlamaConfig, LlamaForCausalLM

    s = shape
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=s["vocab_size"],
            hidden_size=s["d_model"],
            intermediate_size=s["ffn_dim"],
            num_hidden_layers=s["n_layers"],
            num_attention_heads=s["n_heads"],
            num_key_value_heads=s["n_kv_heads"],
            head_dim=s["head_dim"],
            max_position_embeddings=s["seq"] + 1,
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
    ).to(device)
    opt = fused_adamw(model)
    compiled = torch.compile(model) if device.type == "cuda" else model
    return peer_step(model, opt, lambda x, y: compiled(input_ids=x, labels=x).loss, "bf16", device.type)


def timed(step: Callable[[torch.Tensor], None], shape: dict, device: torch.device, steps: int, warmup: int) -> dict:
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"] + 1), generator=g).to(device)
        for _ in range(4)
    ]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step(batches[i % len(batches)])  # each step ends in a host read of the loss
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[warmup:])
    return {
        "median_step_s": med,
        "tokens_per_s": shape["batch"] * shape["seq"] / med,
        "first_step_s": times[0],
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nanogpt", default=None, help="path to nanoGPT's model.py (adds the GPT pair)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median (compile, autotune)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU, no compile: checks the path, not speed")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not a.tiny else torch.device("cpu")
    peak = device_peak(CATALOGUE, "bf16", device)
    result = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "peak_flops": peak.flops,
        "peak_source": peak.source,
        "regime": "fp32 masters, bf16 autocast, "
        f"{'compiled' if device.type == 'cuda' else 'eager'}, fused AdamW, clip 1.0",
        "pairs": {},
    }
    pairs = {"llama": ("transformers", transformers_step)}
    if a.nanogpt:
        pairs["gpt"] = ("nanogpt", lambda s, d: nanogpt_step(a.nanogpt, s, "bf16", d, compile=d.type == "cuda"))
    for name, (peer, build_peer) in pairs.items():
        shape = {**SHAPES[name], **(TINY if a.tiny else {})}
        shape["n_kv_heads"] = min(shape["n_kv_heads"], shape["n_heads"])
        model_shape = {k: v for k, v in shape.items() if k not in ("arch", "bias")}
        overrides = flopwise_overrides(shape, device)
        fpt = flops_per_token(flopwise_config(model_shape, "bf16", overrides).model, shape["seq"])
        row = {"shape": shape, "model_flops_per_token": fpt}
        builders = {
            "flopwise": partial(flopwise_step, model_shape, "bf16", overrides, device),
            peer: partial(build_peer, shape, device),
        }
        for who, build in builders.items():
            torch.manual_seed(0)
            r = timed(build(), shape, device, a.steps, a.warmup)  # the step (and its model) is freed after
            r["mfu"] = mfu(r["tokens_per_s"], fpt, peak.flops)
            row[who] = r
            print(
                f"{name} {who}: {r['tokens_per_s']:,.0f} tok/s, MFU {100 * r['mfu']:.1f}%"
                + (f", peak {r['peak_memory_bytes'] / 2**30:.1f} GiB" if r["peak_memory_bytes"] else ""),
                flush=True,
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
        row["ratio"] = row["flopwise"]["tokens_per_s"] / row[peer]["tokens_per_s"]
        print(f"{name}: flopwise x{row['ratio']:.2f} vs {peer}", flush=True)
        result["pairs"][name] = row
    report(result, a.out)


if __name__ == "__main__":
    main()
