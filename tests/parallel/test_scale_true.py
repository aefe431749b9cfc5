"""The scale-true engine: no rank holds the whole model, and nothing about that changes the numbers.

References are independent of the sharded path: the one-process model (built whole), today's
in-memory exporters, SDPA on expanded K/V, the process's own resident-memory high-water mark.
"""

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flopwise.checkpoints import checkpoint
from flopwise.checkpoints.export import export_checkpoint
from flopwise.config.schema import ModelConfig, load_config, to_toml
from flopwise.eval.load import load_for_inference
from flopwise.interop.convert import export_hf
from flopwise.interop.hf import from_hf, to_hf
from flopwise.layout.rules import Layout
from flopwise.measure.bytes import HostSyncCounter
from flopwise.model.init import normal_box
from flopwise.model.transformer import build_model
from flopwise.parallel.mesh import Parallel
from flopwise.train.build import build_engine
from flopwise.train.engine import lm_loss
from flopwise.train.launch import train
from tests.conftest import ROOT, run_jobs, tiny_overrides

# --- one process -----------------------------------------------------------------------------


def test_any_box_of_a_weight_draws_the_values_of_the_whole():
    """The initialiser's values at an element do not depend on which box around it is drawn:
    narrow weights (whole-row blocks) and wide ones (row pieces), boxes cutting blocks anywhere."""
    for shape in [(300, 384), (40, 20000)]:
        whole = normal_box(7, "w", shape, (0, 0), shape)
        rows, cols = shape
        for (r, c), (nr, nc) in [
            ((17, 0), (rows // 2, cols)),
            ((0, cols // 2), (rows, cols - cols // 2)),
            ((33, 1234 % cols), (5, 97)),
            ((rows - 1, cols - 1), (1, 1)),
            ((3, 16000 % cols), (2, 0)),
        ]:
            assert torch.equal(normal_box(7, "w", shape, (r, c), (nr, nc)), whole[r : r + nr, c : c + nc])
    assert 0.98 < whole.std() < 1.02 and abs(whole.mean()) < 0.01
    assert not torch.equal(normal_box(7, "w", (4, 8), (0, 0), (4, 8)), normal_box(7, "v", (4, 8), (0, 0), (4, 8)))


def test_grouped_query_attention_saves_keys_and_values_at_kv_width():
    """With SDPA's native GQA, autograd saves K and V at n_kv_heads; the old expand-then-attend
    path (the reference here) saves them at n_heads: 2·b·(h − h_kv)·t·d·4 bytes more."""
    m = ModelConfig(n_layers=1, d_model=64, n_heads=8, n_kv_heads=2, vocab_size=64, max_seq_len=32)
    attn = build_model(m, "cpu", seed=0).layers["0"].attention
    b, t, hd = 2, 16, m.head_dim
    q = torch.randn(b, 8, t, hd, requires_grad=True)
    k, v = (torch.randn(b, 2, t, hd, requires_grad=True) for _ in range(2))

    def saved_bytes(fn) -> int:
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda x: sizes.append(x.numel() * x.element_size()) or x, lambda x: x
        ):
            out = fn()
        return sum(sizes), out

    ours, y = saved_bytes(lambda: attn.core(q, k, v, None, True))
    ref, y_ref = saved_bytes(
        lambda: F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    )
    assert torch.allclose(y, y_ref, atol=1e-6)
    assert ref - ours == 2 * b * (8 - 2) * t * hd * 4


@pytest.mark.slow
def test_one_host_sync_per_log_step(tiny_data, tmp_path):
    """Steps between log points read nothing from the device: 10 more steps at log.every=5 add
    two sync points (the per-step cost, measured on the same run lengths, not counted by the
    trainer itself); the steps' losses still reach the result one by one."""

    def run(steps: int) -> tuple[int, list[float]]:
        cfg = load_config(
            None,
            tiny_overrides(
                tmp_path / f"r{steps}",
                tiny_data,
                **{
                    "train.steps": steps,
                    "log.every": 5,
                    "train.eval_every": 0,
                    "checkpoint.interval": 0,
                    "checkpoint.resume": '"none"',
                },
            ),
        )
        with HostSyncCounter() as c:
            r = train(cfg)
        return c.count, r.losses

    (short, _), (long, losses20) = run(10), run(20)
    assert long - short == 2
    assert len(losses20) == 20 and all(math.isfinite(x) for x in losses20)


def test_one_process_uses_the_same_initialiser(tmp_path):
    """The single-process engine's weights are the model built whole with the run's seed."""
    cfg = load_config(None, ['model.preset="demo-tiny"', "run.seed=5", "data.seq_len=64", f'run.dir="{tmp_path}"'])
    engine, _ = build_engine(cfg, Parallel(Layout(micro_batch=cfg.train.micro_batch), None, torch.device("cpu")))
    whole = build_model(cfg.model, "cpu", seed=5).state_dict()
    assert all(torch.equal(v, whole[k]) for k, v in engine.parts[0].state_dict().items())


# --- streaming export (one process holding one tensor at a time) -------------------------------


def _write_checkpoint(tmp: Path, tiny_data: Path, **model) -> tuple[Path, int]:
    """A weights-only checkpoint of a model built whole; (its folder, its largest tensor's bytes)."""
    cfg = load_config(None, tiny_overrides(tmp / "src", tiny_data, **{f"model.{k}": v for k, v in model.items()}))
    net = build_model(cfg.model, "cpu", seed=1)
    ckpt = checkpoint.save(
        tmp / "src", 3, net, None, {"config": to_toml(cfg)}, files={"tokenizer.json": tiny_data / "tokenizer.json"}
    )
    return ckpt, max(p.numel() * 4 for p in net.parameters())


def test_streamed_export_writes_what_the_whole_model_would(tiny_data, tmp_path):
    """`checkpoint export` streams tensor by tensor, and its tensor file is byte-identical to a
    save from one process holding the whole model; `convert to-hf` streams shard by shard and
    writes the same files as the in-memory exporter, for a fused-attention family too."""
    for arch in ("llama", "gpt2"):
        tmp = tmp_path / arch
        extra = {"arch": f'"{arch}"', "n_kv_heads": 4, "bias": "true"} if arch == "gpt2" else {}
        ckpt, _ = _write_checkpoint(tmp, tiny_data, **extra)
        out = export_checkpoint(ckpt, tmp / "exported")
        model, cfg, _ = load_for_inference(ckpt)
        ref = checkpoint.save(tmp / "ref", 3, model, None, {})
        assert (out / "__0_0.distcp").read_bytes() == (ref / "__0_0.distcp").read_bytes()
        export_hf(ckpt, tmp / "hf", max_shard_bytes=40_000)
        to_hf(model, cfg.model, tmp / "hf_ref", max_shard_bytes=40_000)
        files = sorted(p.name for p in (tmp / "hf").glob("model*"))
        assert len(files) > 2 and files == sorted(p.name for p in (tmp / "hf_ref").glob("model*"))
        assert all((tmp / "hf" / f).read_bytes() == (tmp / "hf_ref" / f).read_bytes() for f in files)


@pytest.mark.slow
def test_streamed_export_peak_memory_is_about_one_tensor(tiny_data, tmp_path):
    """Exporting a 0.67 GB checkpoint (to a one-process checkpoint and to HF with 64 MB shards)
    adds about the largest tensor (131 MB; at most twice it, the reader's transient copy, plus
    64 MB) to the process's peak resident memory; loading the model whole, as the exporters did
    before, adds all of it."""
    ckpt, largest = _write_checkpoint(
        tmp_path,
        tiny_data,
        n_layers=8,
        d_model=1024,
        n_heads=16,
        n_kv_heads=16,
        ffn_dim=2816,
        vocab_size=32000,
        max_seq_len=64,
    )
    total = sum(p.stat().st_size for p in ckpt.glob("*.distcp"))
    probe = textwrap.dedent(f"""
        import sys
        import torch
        from flopwise.checkpoints.export import export_checkpoint
        from flopwise.interop.convert import export_hf
        from flopwise.eval.load import load_for_inference
        def hwm():  # this process's peak resident set (getrusage's would include the forking parent's)
            return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
        before = hwm()
        {{"ckpt": lambda: export_checkpoint({str(ckpt)!r}, {str(tmp_path / "out")!r}),
          "hf": lambda: export_hf({str(ckpt)!r}, {str(tmp_path / "hf")!r}, max_shard_bytes=64 << 20),
          "whole": lambda: load_for_inference({str(ckpt)!r})}}[sys.argv[1]]()
        print("added", hwm() - before)
    """)
    # one process per probe (VmHWM is the process's own), all three at once: none reads another's peak
    probes = {
        mode: subprocess.Popen(
            [sys.executable, "-c", probe, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for mode in ("ckpt", "hf", "whole")
    }
    added = {}
    try:
        for mode, p in probes.items():
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-2000:]
            added[mode] = int(out.split("added")[-1])
    finally:
        for p in probes.values():
            p.kill()
            p.wait()
    assert added["whole"] > 0.9 * total
    assert added["ckpt"] < 2 * largest + 64 * 2**20, added
    assert added["hf"] < 2 * largest + 64 * 2**20, added


# --- under torchrun ----------------------------------------------------------------------------


def _hf_folder(tmp: Path) -> tuple[Path, ModelConfig]:
    """A 4-layer GQA Llama in HF format (random weights, untied: pipeline-able)."""
    m = ModelConfig(
        arch="llama", n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=512, max_seq_len=128
    )
    to_hf(build_model(m, "cpu", seed=11), m, tmp / "hf")
    return tmp / "hf", m


def _layout_overrides(tmp, data, name, **extra):
    kw = {"model.n_layers": 4, "model.tie_embeddings": "false", "train.micro_batch": 2, "run.seed": 3, **extra}
    return {"name": name, "kind": "shards", "overrides": tiny_overrides(tmp / name, data, **kw)}


LAYOUTS = {
    2: {"dp2-zero3": {"parallel.zero": 3}},
    4: {
        "tp2xdp2-zero3": {"parallel.tp": 2, "parallel.zero": 3, "parallel.sequence_parallel": "true"},
        "pp2xdp2-zero3": {"parallel.pp": 2, "parallel.zero": 3},
        "cp2xdp2-zero3": {"parallel.cp": 2, "parallel.zero": 3},
    },
}


def _half_billion(run_dir: Path) -> list[str]:
    """A 0.48B-parameter Llama (1.9 GB in fp32) for zero3."""
    return [
        "model.n_layers=32",
        "model.d_model=1024",
        "model.n_heads=16",
        "model.ffn_dim=2816",
        "model.vocab_size=32000",
        "model.max_seq_len=64",
        "data.seq_len=64",
        "train.global_batch=4",
        "train.micro_batch=1",
        "parallel.zero=3",
        'train.dtype="fp32"',
        f'run.dir="{run_dir}"',
    ]


@pytest.fixture(scope="module")
def sharded(tiny_data, tmp_path_factory) -> dict:
    """Every torchrun job of this module: one launch of 2 ranks, one of 4. The half-billion build is
    the 4-rank launch's first job: it reads the ranks' VmHWM from a fresh process's start."""
    tmp = tmp_path_factory.mktemp("scale")
    hf, _ = _hf_folder(tmp)
    hf_job = _layout_overrides(
        tmp, tiny_data, "hf-tp2xdp2-zero3", **{"parallel.tp": 2, "parallel.zero": 3, "model.init_from": f'"hf:{hf}"'}
    )
    mem_job = {"name": "half-billion", "kind": "build_memory", "overrides": _half_billion(tmp / "half-billion")}
    results = {"_tmp": tmp, "_hf": hf}
    results.update(run_jobs(2, [_layout_overrides(tmp, tiny_data, n, **x) for n, x in LAYOUTS[2].items()], tmp))
    results.update(
        run_jobs(
            4, [mem_job] + [_layout_overrides(tmp, tiny_data, n, **x) for n, x in LAYOUTS[4].items()] + [hf_job], tmp
        )
    )
    return results


def _assert_slices_of(whole: dict[str, torch.Tensor], run_dir: Path, ranks: int) -> None:
    covered = dict.fromkeys(whole, 0)
    for r in range(ranks):
        for name, (offset, local) in torch.load(run_dir / f"shards-rank{r}.pt", weights_only=True).items():
            ref = whole[name][tuple(slice(o, o + n) for o, n in zip(offset, local.shape, strict=True))]
            assert torch.equal(local, ref), f"rank {r}: {name} at {offset}"
            covered[name] += local.numel()
    assert all(covered[k] >= whole[k].numel() for k in whole), "some parameter is held by no rank"


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", [n for w in LAYOUTS for n in LAYOUTS[w]])
def test_sharded_init_equals_slices_of_the_one_process_model(name, sharded, tiny_data):
    """Each rank initialises only its shards, bit-identical to the same slices of the model the
    one-process path builds whole from the same seed."""
    cfg = load_config(None, _layout_overrides(sharded["_tmp"], tiny_data, name)["overrides"])
    whole = dict(build_model(cfg.model, "cpu", seed=cfg.run.seed).named_parameters())
    _assert_slices_of(whole, sharded["_tmp"] / name, 2 if name in LAYOUTS[2] else 4)


@pytest.mark.slow
@pytest.mark.multiproc
def test_sharded_hf_load_reads_only_each_ranks_slices(sharded, tiny_data):
    """model.init_from=hf:PATH under tp2·dp2 zero3: every rank's shards equal the one-process
    from_hf model's slices, each rank reads about a quarter of the weight file (norm gains, held
    by two ranks each under tp, are the excess), and the loss equals the one-process one."""
    r = sharded["hf-tp2xdp2-zero3"]
    model, _ = from_hf(sharded["_hf"])
    _assert_slices_of(dict(model.named_parameters()), sharded["_tmp"] / "hf-tp2xdp2-zero3", 4)
    size = (sharded["_hf"] / "model.safetensors").stat().st_size
    for read in r["hf_bytes_read"]:
        assert size / 4 * 0.98 < read < size / 4 * 1.03
    from flopwise.data.loader import eval_batches

    batch = next(iter(eval_batches(tiny_data, 32, r["rows"], 1)))
    assert r["loss"] == pytest.approx(lm_loss(model, batch, torch.device("cpu"), "fp32").item(), rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiproc
def test_building_a_half_billion_model_on_four_ranks_holds_a_quarter_each(sharded):
    """A 0.48B-parameter Llama (1.9 GB in fp32) built for zero3 on 4 ranks: each rank's peak
    resident memory grows by at most a quarter of the model plus 200 MB while it builds
    (measured before meta-device init: 2.06 GB per rank, the whole model)."""
    cfg = load_config(None, _half_billion(sharded["_tmp"] / "half-billion"))
    full = sum(p.numel() for p in build_model(cfg.model, "meta").parameters()) * 4
    for added in sharded["half-billion"]["peak_added_bytes"]:
        assert added < full / 4 + 200 * 2**20, (added, full)


@pytest.mark.slow
def test_gpu_benchmark_script_runs_its_path_on_cpu(tmp_path):
    """benchmarks/gpu/llama1b.py (FSDP2 on a one-rank mesh, the engine's own step) on a tiny
    shape: it trains (finite loss) and reports every figure the GPU run records."""
    script = ROOT / "benchmarks" / "gpu" / "llama1b.py"
    out = tmp_path / "gpu.json"
    r = subprocess.run(
        [sys.executable, str(script), "--tiny", "--steps", "2", "--warmup", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert math.isfinite(got["final_loss"]) and got["tokens_per_s"] > 0 and 0 < got["mfu_vs_measured_matmul"] < 1
    assert got["layout"].startswith("fsdp2")
