"""The trainer's step around the model (the loss, clipping, the guards, the weight guard's max-abs
from aminmax) changes no number: 30 steps equal a plain PyTorch loop over the same model, with
torch's own cross-entropy and clipping; and the cheaper weight guard still
sees every non-finite weight."""

import json
import math
import types

import pytest
import torch
import torch.nn.functional as F

from flopwise.config.schema import load_config
from flopwise.parallel import mesh
from flopwise.train.build import build_engine
from flopwise.train.faults import Faults
from flopwise.train.trainer import train_step

SHAPES = {
    "llama": dict(arch="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96),
    "gpt2": dict(arch="gpt2", n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, head_dim=16, ffn_dim=256, bias=False),
}


def built(shape: dict):
    model = [f"model.{k}={json.dumps(v)}" for k, v in shape.items()]
    over = ["model.vocab_size=256", "model.max_seq_len=32", "data.seq_len=32", "train.global_batch=4"]
    over += ["train.micro_batch=4", 'train.dtype="fp32"', "train.compile=false", "train.steps=30"]
    over += ["optim.warmup_steps=0", 'optim.schedule="constant"', "optim.grad_clip=0.5", "optim.lr=1e-3"]
    cfg = load_config("demo", [*model, *over])
    return cfg, *build_engine(cfg, mesh.init(cfg, torch.device("cpu")))


@pytest.mark.parametrize("arch", list(SHAPES))
def test_thirty_steps_equal_a_plain_loop_one_linear_at_a_time(arch):
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(3)] * 10  # learnable: seen again
    cfg, engine, optimizer = built(SHAPES[arch])
    feed = types.SimpleNamespace(batch=None)
    run = types.SimpleNamespace(
        cfg=cfg, engine=engine, optimizer=optimizer, loader=types.SimpleNamespace(next_batch=lambda: feed.batch)
    )
    faults, ours = Faults(), []
    for i, b in enumerate(batches):
        feed.batch = b
        ours.append(train_step(run, i, faults)[0].tolist())

    _, ref_engine, ref_opt = built(SHAPES[arch])  # the same seed: the same initial weights
    model = ref_engine.parts[0]
    ref = []
    for b in batches:
        logits = model(b[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref.append((loss.item(), norm.item()))
    assert [r[2:] for r in ours] == [[0.0, 0.0]] * 30  # nothing flagged
    assert [r[0] for r in ours] == pytest.approx([r[0] for r in ref], abs=1e-6, rel=0)
    assert [r[1] for r in ours] == pytest.approx([r[1] for r in ref], abs=1e-6, rel=1e-6)
    assert ref[-1][0] < ref[0][0] - 0.3  # it learned: the comparison is of a moving curve


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_the_weight_guard_sees_any_non_finite_weight(bad):
    _, engine, _ = built(SHAPES["gpt2"])
    assert engine.weights_nonfinite().item() == 0.0
    p = list(engine.parts[0].parameters())[3]
    with torch.no_grad():
        p.view(-1)[p.numel() // 2 + 5] = bad
    assert not all(q.isfinite().all() for q in engine.parts[0].parameters())  # the reference
    assert engine.weights_nonfinite().item() == 1.0
