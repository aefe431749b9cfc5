"""Will it fit? `flopwise train`'s pre-flight refuses, before anything is written or allocated, a
run its planner predicts will not fit, and an out-of-memory step leaves oom.json behind."""

import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from rich.console import Console

from flopwise.config.schema import load_config
from flopwise.hardware.catalogue import GiB
from flopwise.log import printing_to
from flopwise.model.transformer import build_model
from flopwise.parallel import mesh
from flopwise.train.launch import train
from flopwise.train.preflight import WillNotFit, run_preflight
from tests.conftest import tiny_overrides

ENV = {**os.environ, "COLUMNS": "400"}


def max_rss_of(cmd: list[str], cwd, timeout: int = 300) -> tuple[subprocess.CompletedProcess, int]:
    """Run `cmd` from a fresh Python whose only child it is; (its result, its peak resident bytes)."""
    probe = (
        "import resource, subprocess, sys, json; r = subprocess.run(sys.argv[1:], capture_output=True, "
        "text=True); peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss; "
        "print(json.dumps([r.returncode, r.stdout, r.stderr, peak]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, *cmd],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=ENV,
        timeout=timeout,
        check=True,
    )
    rc, stdout, stderr, kib = json.loads(out.stdout)
    return subprocess.CompletedProcess(cmd, rc, stdout, stderr), kib * 1024


@pytest.mark.slow
def test_a_7b_model_is_refused_before_data_or_a_run_folder_exist(tmp_path):
    """The default `flopwise train` with Llama 2 7B on this machine: 108 GB of fp32 states alone.
    Before the pre-flight it prepared data, allocated for minutes and was killed by the kernel."""
    r, peak = max_rss_of([sys.executable, "-m", "flopwise", "train", "model.preset=llama2-7b"], tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("error: train.preflight: will not fit: rank 0 of 1")
    needs = float(re.search(r"needs ([\d.]+) GiB", lines[0]).group(1))
    assert needs > 16 * 6.74e9 / GiB  # at least the fp32 weights, gradients and Adam moments of 6.74B parameters
    assert "nothing fits on 1 rank of cpu: needs >= " in lines[0]
    assert list(tmp_path.iterdir()) == []  # no runs/demo, no data prepared, no flopwise-run.json
    assert peak < 2 * GiB  # nothing large was built (the model's weights alone are 27 GB)


def test_the_refusal_names_the_nearest_change_that_fits(tmp_path, tiny_data, monkeypatch):
    """A 355M model at micro-batch 16 × 1024 tokens cannot fit in what a 24 GiB machine shares out;
    the planner's search names the smallest change, and that change then passes the pre-flight."""
    over = tiny_overrides(
        tmp_path / "run",
        tiny_data,
        **{"model.preset": '"gpt2-355m"', "data.seq_len": 1024, "train.global_batch": 16, "train.micro_batch": 16},
    )
    monkeypatch.setattr("flopwise.train.preflight.mem_available", lambda: 12.0 * GiB)
    with pytest.raises(WillNotFit) as e:
        train(load_config(None, over))
    line = str(e.value)
    assert "nearest change that fits (1 change: micro_batch): train.micro_batch=" in line, line
    mb = int(re.search(r"train\.micro_batch=(\d+)", line).group(1))
    assert mb < 16 and not (tmp_path / "run").exists()
    changed = load_config(None, [*over, f"train.micro_batch={mb}"])  # the suggestion passes the same check
    assert run_preflight(changed, mesh.init(changed, torch.device("cpu"))).startswith("pre-flight: rank 0 of 1")


@pytest.mark.slow
def test_a_run_predicted_to_fit_starts_and_says_so(tmp_path, tiny_data):
    out = io.StringIO()
    cfg = load_config(None, tiny_overrides(tmp_path, tiny_data, **{"train.steps": 2}))
    with printing_to(Console(file=out, width=400)):
        r = train(cfg)
    assert r.steps == 2 and len(r.losses) == 2
    assert re.search(
        r"pre-flight: rank 0 of 1 \(single, micro-batch 4, recompute none\) needs [\d.]+ GiB; "
        r"[\d.]+ GiB usable",
        out.getvalue(),
    )


@pytest.mark.slow
def test_preflight_false_skips_the_check(tmp_path, tiny_data, monkeypatch):
    """A node shared by a million ranks leaves each a few kB: refused, unless train.preflight=false."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000000")
    over = tiny_overrides(tmp_path, tiny_data, **{"train.steps": 2})
    with pytest.raises(WillNotFit, match="MemAvailable / 1000000 local ranks"):
        train(load_config(None, over))
    assert not tmp_path.joinpath("flopwise-run.json").exists()
    r = train(load_config(None, [*over, "train.preflight=false"]))
    assert r.steps == 2


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_ranks_agree_and_rank_0_says_why_once(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "flopwise",
            "train",
            "model.preset=llama2-7b",
            "train.micro_batch=8",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=ENV,
        timeout=300,
    )
    text = r.stdout + r.stderr
    assert text.count("error: train.preflight: will not fit") == 1, text[-3000:]
    assert "of 2 (dp2, micro-batch 8" in text and "MemAvailable / 2 local ranks" in text
    # torchrun's summary: the first rank to end exits 2, and so does the other (or, if it was a moment slower to
    # leave, torchrun has stopped it: SIGTERM, -15)
    codes = re.findall(r"exitcode\s+: (-?\d+) \(pid", text)
    root = re.search(r"Root Cause.*?exitcode\s+: (-?\d+)", text, re.S).group(1)
    assert len(codes) == 2 and root == "2" and set(codes) <= {"2", "-15"}, text[-3000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_an_out_of_memory_step_writes_oom_json_and_exits_2_in_one_line(tmp_path, tiny_data, monkeypatch, capsys):
    """CUDA's OutOfMemoryError raised inside the model's 4th forward: with 2 micro-batches a step,
    that is step 2's second micro-batch (index 1)."""
    from flopwise import cli
    from flopwise.model.transformer import Transformer

    calls, forward = [0], Transformer.forward

    def forward_until_oom(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", forward_until_oom)
    over = tiny_overrides(tmp_path, tiny_data, **{"train.global_batch": 8, "train.micro_batch": 4})
    monkeypatch.setattr(sys, "argv", ["flopwise", "train", *over])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("error: out of memory at step 2, micro-batch 1, forward on cpu")
    assert f"see {tmp_path / 'oom.json'}" in err and ("nearest change that fits" in err or "nothing fits" in err)
    report = json.loads((tmp_path / "oom.json").read_text())
    assert (report["step"], report["micro_batch"], report["phase"]) == (2, 1, "forward")
    bytes_ = report["predicted_bytes"]
    assert set(bytes_) >= {"params", "grads", "optimizer", "activations", "total"}
    model = build_model(load_config(None, over).model, "meta")
    assert bytes_["params"] == 4 * sum(p.numel() for p in model.parameters())  # fp32 master weights of the model
    assert bytes_["total"] > bytes_["params"] + bytes_["optimizer"]
    assert report["memory_stats"] is None and "memory_stats is null" in report["memory_stats_note"]
    assert report["requested_bytes"] == 2 * GiB and report["suggestion"] in err
    assert "oom.json" in json.loads((tmp_path / "flopwise-run.json").read_text())["writes"]


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_a_cpu_without_bf16_instructions_is_said_before_the_run(native, tmp_path, monkeypatch, cli):
    """Not refused (it trains), but said before anything else, here ahead of a missing data folder's
    error: there bf16 matmuls ran ~50x slower than fp32 (2026-12-07, an AVX2 EPYC); fp32 gets no note."""
    from flopwise.train import preflight as pf

    monkeypatch.setattr(pf, "cpu_multiplies_bf16", lambda cpuinfo=None: native)
    for dtype in ("bf16", "fp32"):
        r = cli(
            "train",
            "model.preset=demo-tiny",
            'data.tokenizer="bpe:512"',
            "data.seq_len=64",
            'data.path="missing"',
            f"run.dir={dtype}",
            f'train.dtype="{dtype}"',
            cwd=tmp_path,
        )
        assert r.returncode == 2 and "error: data input missing: no such file or directory" in r.stderr, r.stderr
        said = (
            "note: train.dtype=bf16 on a CPU without bf16 matrix instructions (AMX or AVX512-BF16)"
            in r.stdout + r.stderr
        )
        assert said == (dtype == "bf16" and not native), r.stdout + r.stderr
