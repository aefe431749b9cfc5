"""Training throughput on this CPU, side by side: flopwise's own step against its peers.

    python benchmarks/throughput/train_cpu.py                                  # reference shape, fp32 + bf16, 3 rounds
    python benchmarks/throughput/train_cpu.py --nanogpt ~/src/nanoGPT/model.py # add nanoGPT's model (a local checkout)
    python benchmarks/throughput/train_cpu.py --shape holdout --peers flopwise # a scaling-ladder shape, flopwise alone
    python benchmarks/throughput/train_cpu.py --shape gpt2 --peers flopwise --nanogpt PATH  # GPT-2 against nanoGPT
    python benchmarks/throughput/train_cpu.py --flopwise train.compile=false   # flopwise eager (default: compiled, as a
                                                                    # run of >= 1000 steps is)

Peers, each with the same shape, batch, AdamW hyper-parameters, gradient clipping and fp32 loss:
- flopwise: the trainer's own `train_step` (Engine, clip, fused AdamW) built from the `demo` config
  with this shape, as `flopwise train` would build it (train.* overrides via --flopwise);
- transformers: `LlamaForCausalLM` (SDPA attention), torch's AdamW (fused);
- nanoGPT (`--nanogpt PATH`, Karpathy's `model.py`, not vendored here and never downloaded): its GPT
  with `configure_optimizers`, bias=False, dropout 0. Its GeLU MLP of 4·d has the parameters and
  FLOPs of a SwiGLU MLP of 8d/3, so at the reference shape (ffn 1024 = 8·384/3) the FLOPs match.

Method: per round and dtype, a matmul calibration, then fresh models, then steps interleaved (the
order rotates every step, so background load hits all alike), then a second calibration. Tokens/s
is the median over steps 6-30; the share of the ceiling uses flopwise.flops' FLOPs per token over
the mean of the two calibrations. Use a quiet machine: other processes on these cores distort
every figure (ratios less than absolute rates).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import statistics
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from flopwise.config.schema import Config, load_config
from flopwise.flops import flops_per_token
from flopwise.parallel import mesh
from flopwise.train.build import build_engine
from flopwise.train.faults import Faults
from flopwise.train.metrics import measure_matmul_peak
from flopwise.train.trainer import train_step

SHAPES = {  # the reference shapes (Llama: against transformers; GPT-2: against nanoGPT), and the
    # scaling ladder's smallest and held-out (2e13) shapes
    "ref": dict(
        arch="llama",
        n_layers=6,
        d_model=384,
        n_heads=6,
        n_kv_heads=6,
        head_dim=64,
        ffn_dim=1024,
        vocab_size=4096,
        seq=256,
        batch=8,
    ),
    "gpt2": dict(
        arch="gpt2",
        n_layers=6,
        d_model=384,
        n_heads=6,
        n_kv_heads=6,
        head_dim=64,
        ffn_dim=1536,
        vocab_size=4096,
        tie_embeddings=True,
        bias=False,
        seq=256,
        batch=8,
    ),
    "small": dict(
        arch="llama",
        n_layers=1,
        d_model=64,
        n_heads=2,
        n_kv_heads=2,
        head_dim=32,
        ffn_dim=192,
        vocab_size=512,
        seq=128,
        batch=16,
    ),
    "holdout": dict(
        arch="llama",
        n_layers=3,
        d_model=96,
        n_heads=3,
        n_kv_heads=3,
        head_dim=32,
        ffn_dim=256,
        vocab_size=512,
        seq=128,
        batch=16,
    ),
}
LR, BETAS, WD, EPS, CLIP = 3e-4, (0.9, 0.95), 0.1, 1e-8, 1.0


def flopwise_config(shape: dict, dtype: str, overrides: list[str]) -> Config:
    s = shape
    model = [f"model.{k}={json.dumps(v)}" for k, v in s.items() if k not in ("seq", "batch")]
    return load_config(
        "demo",
        [
            *model,
            f"model.max_seq_len={s['seq']}",
            f"data.seq_len={s['seq']}",
            f"train.global_batch={s['batch']}",
            f"train.micro_batch={s['batch']}",
            f'train.dtype="{dtype}"',
            f"optim.lr={LR}",
            f"optim.beta1={BETAS[0]}",
            f"optim.beta2={BETAS[1]}",
            f"optim.weight_decay={WD}",
            f"optim.grad_clip={CLIP}",
            "optim.warmup_steps=0",
            'optim.schedule="constant"',
            "train.steps=10000",
            *overrides,
        ],
    )  # a real run's length: train.compile=auto decides as it would


def flopwise_step(
    shape: dict, dtype: str, overrides: list[str], device: torch.device = torch.device("cpu")
) -> Callable[[torch.Tensor], None]:
    cfg = flopwise_config(shape, dtype, overrides)
    engine, optimizer = build_engine(cfg, mesh.init(cfg, device))
    feed = types.SimpleNamespace(batch=None)
    run = types.SimpleNamespace(
        cfg=cfg, engine=engine, optimizer=optimizer, loader=types.SimpleNamespace(next_batch=lambda: feed.batch)
    )
    faults, count = Faults(), iter(range(10**9))

    def step(batch: torch.Tensor) -> None:
        feed.batch = batch
        out, _ = train_step(run, next(count), faults)
        out.tolist()  # the trainer reads its metrics once per log step; here every step is timed

    return step


def fused_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """torch's fused AdamW with the peers' hyper-parameters, no decay on vectors (norms, biases)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        fused=True,
    )


def peer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_of, dtype: str, device: str = "cpu"):
    """One step of a peer: fp32 weights, `dtype` autocast on `device`, clipping, its optimizer."""
    ctx = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if dtype == "bf16" else contextlib.nullcontext

    def step(batch: torch.Tensor) -> None:
        with ctx():
            loss = loss_of(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    return step


def transformers_step(shape: dict, dtype: str) -> Callable[[torch.Tensor], None]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
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
            max_position_embeddings=s["seq"],
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
    )
    opt = fused_adamw(model)

    def loss_of(x, y):
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    return peer_step(model, opt, loss_of, dtype)


def nanogpt_step(
    path: str, shape: dict, dtype: str, device: torch.device = torch.device("cpu"), compile: bool = False
) -> Callable[[torch.Tensor], None]:
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    s = shape
    with contextlib.redirect_stdout(None):  # it prints its parameter counts
        model = mod.GPT(
            mod.GPTConfig(
                block_size=s["seq"],
                vocab_size=s["vocab_size"],
                n_layer=s["n_layers"],
                n_head=s["n_heads"],
                n_embd=s["d_model"],
                dropout=0.0,
                bias=False,
            )
        ).to(device)
        opt = model.configure_optimizers(WD, LR, BETAS, device.type)  # fused AdamW on CUDA
    forward = torch.compile(model) if compile else model

    def loss_of(x, y):
        return forward(x.contiguous(), y.contiguous())[1]  # its own loss, as its train.py uses it

    return peer_step(model, opt, loss_of, dtype, device.type)


def measure(args, shape: dict, dtype: str, fpt: float) -> dict:
    builders = {
        "flopwise": lambda: flopwise_step(shape, dtype, args.flopwise),
        "transformers": lambda: transformers_step(shape, dtype),
        "nanogpt": lambda: nanogpt_step(args.nanogpt, shape, dtype),
    }
    before = measure_matmul_peak(dtype, torch.device("cpu"), sizes=(1024, 2048), repeats=5)
    torch.manual_seed(0)
    steps = {name: builders[name]() for name in args.peers}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"] + 1), generator=g) for _ in range(8)]
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for i in range(args.steps):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t0 = args.clock()
            steps[name](batches[i % len(batches)])
            times[name].append(args.clock() - t0)
    after = measure_matmul_peak(dtype, torch.device("cpu"), sizes=(1024, 2048), repeats=5)
    ceiling = (before + after) / 2
    tokens = shape["batch"] * shape["seq"]
    row = {"ceiling_flops_before": before, "ceiling_flops_after": after}
    for name, ts in times.items():
        med = statistics.median(ts[args.skip :])
        row[name] = {
            "median_step_s": med,
            "tokens_per_s": tokens / med,
            "ceiling_share": tokens / med * fpt / ceiling,
            "first_step_s": ts[0],
        }
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="ref")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--peers", default="flopwise,transformers")
    ap.add_argument("--nanogpt", default=None, help="path to nanoGPT's model.py (adds the nanogpt peer)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the median (warm-up, compile)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU time (with --threads 1, robust to other load; not a speed)",
    )
    ap.add_argument("--flopwise", nargs="*", default=[], help="config overrides for flopwise, key=value")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.clock = time.perf_counter if args.clock == "wall" else time.process_time
    args.peers = args.peers.split(",") + (["nanogpt"] if args.nanogpt else [])
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    fpt = flops_per_token(flopwise_config(shape, "fp32", args.flopwise).model, shape["seq"])
    result = {
        "shape": args.shape,
        **shape,
        "flops_per_token": fpt,
        "peers": args.peers,
        "flopwise_overrides": args.flopwise,
        "threads": torch.get_num_threads(),
        "clock": "wall" if args.clock is time.perf_counter else "cpu",
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "steps": args.steps,
        "median_over": f"steps {args.skip + 1}-{args.steps}",
        "rounds": [],
    }
    for r in range(args.rounds):
        rnd = {}
        for dtype in args.dtypes.split(","):
            row = measure(args, shape, dtype, fpt)
            rnd[dtype] = row
            cells = " | ".join(
                f"{n} {row[n]['tokens_per_s']:,.0f} tok/s ({100 * row[n]['ceiling_share']:.0f}%)" for n in args.peers
            )
            ratios = " ".join(
                f"×{row['flopwise']['tokens_per_s'] / row[n]['tokens_per_s']:.2f} vs {n}"
                for n in args.peers
                if n != "flopwise" and "flopwise" in args.peers
            )
            print(
                f"round {r + 1} {dtype}: ceiling {row['ceiling_flops_before'] / 1e9:.0f}/"
                f"{row['ceiling_flops_after'] / 1e9:.0f} GFLOP/s | {cells} | {ratios}",
                flush=True,
            )
        result["rounds"].append(rnd)
    summary = {}
    for dtype in args.dtypes.split(","):
        rows = [rnd[dtype] for rnd in result["rounds"]]
        summary[dtype] = {
            n: {
                "tokens_per_s": statistics.median(r[n]["tokens_per_s"] for r in rows),
                "ceiling_share": statistics.median(r[n]["ceiling_share"] for r in rows),
            }
            for n in args.peers
        }
        if "flopwise" in args.peers:
            for n in args.peers:
                if n != "flopwise":
                    summary[dtype][f"ratio_vs_{n}"] = statistics.median(
                        r["flopwise"]["tokens_per_s"] / r[n]["tokens_per_s"] for r in rows
                    )
        print(f"{dtype} median of {args.rounds} rounds: " + json.dumps(summary[dtype]))
    result["summary"] = summary
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
