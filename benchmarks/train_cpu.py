"""Training throughput on this CPU: flopwise vs Hugging Face `transformers` LlamaForCausalLM, same
shape, same AdamW, side by side, against the measured matmul ceiling.

    python benchmarks/train_cpu.py [--steps 6] [--out benchmarks/results/train_cpu.json]

Both models run the same Llama shape (RMSNorm, SwiGLU, RoPE, SDPA); model FLOPs per token come
from flopwise.flops for both, so MFU and tokens/s are directly comparable. Steps alternate between
the two implementations round by round so background load hits both alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flopwise.config import ModelConfig, OptimConfig
from flopwise.flops import count_params, flops_per_token
from flopwise.model.transformer import build_model
from flopwise.train.metrics import measure_matmul_peak
from flopwise.train.optim import build_optimizer

SHAPE = dict(arch="llama", n_layers=6, d_model=384, n_heads=6, n_kv_heads=6, ffn_dim=1024, vocab_size=8192,
             max_seq_len=256)
SEQ, BATCH = 256, 8


def hf_model(m: ModelConfig):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.ffn_dim,
                      num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads,
                      max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def make_step(model, logits_of, dtype: str):
    opt = build_optimizer(model, OptimConfig(lr=1e-4))
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype == "bf16" else contextlib.nullcontext

    def step(batch: torch.Tensor) -> float:
        t0 = time.perf_counter()
        with ctx():
            logits = logits_of(model, batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/train_cpu.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    m = ModelConfig(**SHAPE)
    fpt = flops_per_token(m, SEQ)
    n = count_params(m)
    batch = torch.randint(0, m.vocab_size, (BATCH, SEQ + 1))
    results = {"shape": SHAPE, "seq_len": SEQ, "batch": BATCH, "params": n.total, "flops_per_token": fpt,
               "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": platform.processor(), "runs": {}}
    for dtype in ("fp32", "bf16"):
        ceiling = measure_matmul_peak(dtype, torch.device("cpu"), sizes=(1024, 2048), repeats=5)
        ours = make_step(build_model(m, "cpu", seed=0), lambda mod, x: mod(x), dtype)
        peer = make_step(hf_model(m), lambda mod, x: mod(input_ids=x).logits, dtype)
        times = {"flopwise": [], "transformers": []}
        for i in range(args.warmup + args.steps):
            for name, step in (("flopwise", ours), ("transformers", peer)):
                dt = step(batch)
                if i >= args.warmup:
                    times[name].append(dt)
        row = {"ceiling_flops": ceiling}
        for name, ts in times.items():
            tps = BATCH * SEQ / statistics.median(ts)
            row[name] = {"median_step_s": statistics.median(ts), "tokens_per_s": tps, "mfu": tps * fpt / ceiling}
        row["ratio_flopwise_over_transformers"] = row["flopwise"]["tokens_per_s"] / row["transformers"]["tokens_per_s"]
        results["runs"][dtype] = row
        print(f"{dtype}: ceiling {ceiling / 1e9:.0f} GFLOP/s | flopwise {row['flopwise']['tokens_per_s']:,.0f} tok/s "
              f"(MFU {100 * row['flopwise']['mfu']:.1f}%) | transformers {row['transformers']['tokens_per_s']:,.0f} "
              f"tok/s (MFU {100 * row['transformers']['mfu']:.1f}%) | ratio {row['ratio_flopwise_over_transformers']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
