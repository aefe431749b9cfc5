"""Nothing lost at the edges: values that are not numbers, buffers the pre-flight
must book, inputs skipped without a word, orphaned workers, and tracebacks where one line is promised.
Each case ends in one line, exit 2, with the user's bytes intact."""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import fields
from pathlib import Path

import pytest

from flopwise.config.schema import load_config
from flopwise.errors import ConfigError
from flopwise.hardware.catalogue import CATALOGUE, Hardware, hardware_toml, load_catalogue

ENV = {**os.environ, "COLUMNS": "400"}


def flopwise(*args: str, cwd=None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flopwise", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=ENV,
        timeout=timeout,
        check=False,
    )


def one_line(r: subprocess.CompletedProcess) -> str:
    """The single error line of a refused command (exit 2, no traceback)."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) == 1, (r.returncode, r.stderr[-3000:])
    return lines[0]


# --- Every number is a number -------------------------------------------------------------------


@pytest.mark.parametrize(
    "override",
    [
        "optim.lr=inf",
        "optim.weight_decay=inf",
        "model.init_std=inf",
        "model.init_std=nan",
        "guard.spike_zscore=nan",
        "plan.tokens=inf",
        "watchdog.min_s=-inf",
        'data.sources=[{path="x", weight=nan}]',
        ("model.rope_scaling={factor=inf, low_freq_factor=1, high_freq_factor=4, original_max_seq_len=8}"),
    ],
)
def test_a_non_finite_config_value_is_refused_naming_its_field(override):
    """inf and nan are floats to TOML and pass `gt=0`: `optim.lr=inf` trained to NaN checkpoints, exit 0."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match="finite number") as e:
        load_config(None, [override])
    assert key.split(".")[-1] in str(e.value) or key in str(e.value)


def test_every_float_field_of_the_config_tree_refuses_nan():
    """One mechanism for the whole tree, so a field added later is covered too: every float field refuses nan."""
    from flopwise.config.schema import Config, Section

    def float_fields(model, prefix):
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, Section):
                yield from float_fields(ann, f"{prefix}{name}.")
            elif "float" in str(ann):
                yield f"{prefix}{name}"

    keys = list(float_fields(Config, ""))
    assert len(keys) >= 20 and "optim.lr" in keys
    for key in keys:
        with pytest.raises(ConfigError, match=f"{key}: Input should be a finite number"):
            load_config(None, [f"{key}=nan"])


def test_the_cli_refuses_lr_inf_in_one_line(tmp_path, cli):
    line = one_line(cli("train", "optim.lr=inf", f"run.dir={str(tmp_path / 'run')!r}", cwd=tmp_path))
    assert "optim.lr" in line and "finite" in line
    assert list(tmp_path.iterdir()) == []


HW = """[mine]
peak_flops = {{bf16 = 1e15}}
memory_bytes = 80e9
memory_bw = 3e12
intra_node_bw = 4e11
inter_node_bw = 5e10
devices_per_node = 8
source = "mine"
{extra}
"""


CAL = (
    "[mine.calibration]\ndtype = 'bf16'\ngemm = [[64, 64, 64, {gemm}]]\nattention = [[64, 64, 0.5, 0.5]]\n"
    "elementwise = [[1, 1e6, {bw}]]\noptimizer = [[1e6, 0.01]]"
)


@pytest.mark.parametrize(
    "extra, field",
    [
        ("matmul_efficiency = nan", "matmul_efficiency"),
        ("matmul_efficiency = inf", "matmul_efficiency"),
        ("matmul_efficiency = 1.5", "matmul_efficiency"),
        ("devices_per_node = 0", "devices_per_node"),
        (CAL.format(gemm="nan", bw="1e10") + "\n", "calibration.gemm[0]"),
        (CAL.format(gemm="0.5", bw="inf") + "\n", "calibration.elementwise[0]"),
        (CAL.format(gemm="0.5", bw="1e10") + "\noverlap = nan", "calibration.overlap"),
    ],
)
def test_a_non_finite_hardware_field_is_refused_naming_it(tmp_path, extra, field, cli):
    """A NaN efficiency gave a NaN plan, exit 0; inf passed every `> 0` check."""
    path = tmp_path / "hw.toml"
    text = HW.format(extra=extra)
    if field == "devices_per_node":
        text = text.replace("devices_per_node = 8\n", "")
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(f"[mine].{field}")):
        load_catalogue(path)
    r = cli("plan", "cluster.hardware=mine", f"cluster.hardware_file={str(path)!r}", cwd=tmp_path)
    assert field.split("[")[0] in one_line(r)
    assert path.read_text() == text


def test_every_builtin_hardware_entry_passes_the_file_checks(tmp_path):
    """The catalogue is held to what a hardware file is: each entry, written out, loads back unchanged."""
    import tomli_w

    path = tmp_path / "all.toml"
    path.write_text(tomli_w.dumps({n: hardware_toml(hw) for n, hw in CATALOGUE.items()}))
    loaded = load_catalogue(path)
    for name, hw in CATALOGUE.items():
        assert all(getattr(loaded[name], f.name) == getattr(hw, f.name) for f in fields(Hardware)), name


# --- Tracebacks where one line is promised ------------------------------------------------------


def test_calibrate_in_bf16_on_a_cpu_without_bf16_is_refused_before_measuring(tmp_path, cli, monkeypatch):
    """fp32 calibrates now (the tables a CPU without bf16 instructions trains with); bf16 asked of such
    a CPU is refused in one line before anything is measured or written."""
    import flopwise.measure.calibrate

    def never(*a, **k):
        raise AssertionError("calibrate measured before refusing bf16")

    monkeypatch.setattr(flopwise.measure.calibrate, "calibrate_device", never)
    monkeypatch.setattr(flopwise.measure.calibrate, "native_dtype", lambda device: "fp32")
    r = cli("hardware", "calibrate", 'train.dtype="bf16"', "--out", str(tmp_path / "hw.toml"), cwd=tmp_path)
    assert "train.dtype=bf16" in one_line(r)
    assert list(tmp_path.iterdir()) == []


def test_calibrate_out_over_its_own_file_keeps_the_users_comments(tmp_path):
    """A rewrite from what tomllib read dropped every comment the user had added: now refused (the
    edit breaks the file's seal, so it is the user's), bytes kept."""
    from dataclasses import replace

    from flopwise.measure.calibrate import save_hardware

    path = tmp_path / "hw.toml"
    save_hardware(replace(CATALOGUE["h100-sxm"], name="mine"), path)
    save_hardware(replace(CATALOGUE["h200"], name="mine"), path)  # flopwise's own file, no comment: replaced
    assert load_catalogue(path)["mine"].memory_bytes == CATALOGUE["h200"].memory_bytes
    text = path.read_text().replace("[mine]\n", "[mine]\n# measured on node 7 after the BIOS update\n", 1)
    path.write_text(text)
    with pytest.raises(ConfigError, match="something flopwise did not write"):
        save_hardware(replace(CATALOGUE["h100-sxm"], name="mine"), path)
    assert path.read_text() == text


# --- The pre-flight books the buffers that grow with max_seq_len --------------------------------


def _measured_buffer_bytes(m) -> int:
    """What the engine's built model holds in buffers (RoPE tables, distance embeddings, slopes)."""
    from flopwise.model.transformer import build_model

    return sum(b.numel() * b.element_size() for b in build_model(m, "cpu").buffers())


@pytest.mark.parametrize(
    "extra", [{}, {"model.rotary_pct": 0.5}, {"model.pos": '"relative"'}, {"model.pos": '"alibi"'}]
)
def test_the_account_books_the_buffers_the_engine_holds(extra):
    """The per-rank account (what pre-flight and the layout search compare with memory) grows with
    model.max_seq_len by what the built model measurably holds more: before, by nothing at all."""
    from flopwise.layout.rules import config_layout
    from flopwise.plan.memory import buffer_bytes
    from flopwise.train.preflight import rank_memory_total

    base = [
        'model.preset="demo-tiny"',
        "data.seq_len=32",
        'train.dtype="fp32"',
        *(f"{k}={v}" for k, v in extra.items()),
    ]
    cfgs = [load_config(None, [*base, f"model.max_seq_len={n}"]) for n in (64, 4096)]
    measured = [_measured_buffer_bytes(c.model) for c in cfgs]
    assert [buffer_bytes(c.model, c.model.n_layers) for c in cfgs] == measured
    lo = config_layout(cfgs[0], 1)
    totals = [rank_memory_total(c, lo, 0, True)["total"] for c in cfgs]
    assert totals[1] - totals[0] == measured[1] - measured[0]
    if extra.get("model.pos") in (None, '"relative"'):
        assert measured[1] > measured[0]


def test_a_huge_max_seq_len_is_refused_before_allocating(tmp_path):
    """`model.max_seq_len=1e8` passed the pre-flight ("needs 1.0 GiB"), prepared data, then allocated
    12.8 GB for RoPE's angles: its 25.6 GB of cos/sin tables were in no account."""
    from tests.train.test_preflight import max_rss_of

    r, peak = max_rss_of([sys.executable, "-m", "flopwise", "train", "model.max_seq_len=1e8"], tmp_path)
    line = one_line(r)
    assert line.startswith("error: train.preflight: will not fit") and "GiB" in line
    assert list(tmp_path.iterdir()) == [] and peak < 2 * 2**30


# --- No orphans ---------------------------------------------------------------------------------


def _children(pid: int) -> set[int]:
    kids = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids |= {int(x) for x in f.read().split()}
    return kids


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    return "?"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stopped_sweep_stops_its_workers_and_says_so(sig, tiny_data, tmp_path):
    """`scale sweep --jobs 2` stopped by SIGTERM left its workers training with no parent, then idle,
    and a rerun trained beside them. Now each worker's trainer gets the signal (checkpoint, stop), the
    sweep waits for them and says so in one line, exit 2."""
    import signal
    import time

    from tests.conftest import tiny_overrides

    out = tmp_path / "ladder"
    over = tiny_overrides(tmp_path / "base", tiny_data, **{"train.global_batch": 8, "train.micro_batch": 8})
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flopwise",
            "scale",
            "sweep",
            *over,
            "--budgets",
            "3e11",
            "--sizes",
            "2",
            "--spread",
            "4",
            "--jobs",
            "2",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 600  # a busy machine takes minutes to start both
        while len(list(out.glob("C*/metrics.jsonl"))) < 2:  # both workers are training
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.5)
        workers = _children(proc.pid)
        assert len(workers) >= 2
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(ln for ln in err.splitlines(keepends=True) if not ln.startswith("note:"))  # the law's predictions
    line = one_line(subprocess.CompletedProcess(proc.args, proc.returncode, "", err))
    assert f"scale sweep stopped by {sig}: its 2 worker process(es) stopped too" in line, line
    assert line.count("with a checkpoint") + line.count(": finished") == 2 and "with a checkpoint" in line, line
    gone = time.monotonic() + 10  # a worker on its way out (memory released, not yet reaped) is left alone
    while [p for p in workers if _alive(p)] and time.monotonic() < gone:
        time.sleep(0.1)
    assert not {p: _cmdline(p) for p in workers if _alive(p)}


def test_a_negative_seed_is_refused_in_the_config():
    """numpy's generators refused run.seed=-1 with a ValueError traceback after the build."""
    with pytest.raises(ConfigError, match="run.seed: Input should be greater than or equal to 0"):
        load_config(None, ["run.seed=-1"])


def test_a_lone_surrogate_in_a_jsonl_line_is_one_line(tmp_path, cli):
    """JSON's escape of half a surrogate pair parses to a str that cannot be encoded: a traceback."""
    src = tmp_path / "in.jsonl"
    text = '{"text": "fine"}\n{"text": "half \\ud800 a pair"}\n'
    src.write_text(text)
    line = one_line(cli("data", "prepare", str(src), "--out", str(tmp_path / "out"), "--workers", "1"))
    assert "line 2" in line and "lone surrogate (\\ud800)" in line
    assert src.read_text() == text and not (tmp_path / "out").exists()


def test_nan_rows_in_scale_fit_are_named(tmp_path, cli):
    rows = [
        "params,tokens,loss",
        "1e6,2e7,3.3",
        "2e6,4e7,nan",
        "4e6,8e7,2.9",
        "8e6,1.6e8,2.7",
        "1.6e7,3.2e8,2.5",
        "3.2e7,6.4e8,2.4",
        "5e6,2e8,2.6",
    ]
    path = tmp_path / "points.csv"
    path.write_text("\n".join(rows) + "\n")
    line = one_line(cli("scale", "fit", str(path), cwd=tmp_path))
    assert "row 3" in line and "finite positive" in line and "nan" in line


@pytest.mark.parametrize("kind", ["long", "loop"])
def test_unusable_paths_are_one_line(kind, tmp_path, cli):
    """A name over 255 bytes and a symlink loop as --out or run.dir were OSError/RuntimeError tracebacks."""
    (tmp_path / "in.txt").write_text("some text to prepare\n")
    if kind == "loop":
        (tmp_path / "a").symlink_to("b")
        (tmp_path / "b").symlink_to("a")
    bad = str(tmp_path / ("x" * 300 if kind == "long" else "a"))
    line = one_line(cli("data", "prepare", str(tmp_path / "in.txt"), "--out", bad, "--workers", "1", cwd=tmp_path))
    assert ("shorter name" if kind == "long" else "is a symbolic link") in line
    if kind == "long":
        r = cli("train", f"run.dir={bad!r}", "train.steps=2", "optim.warmup_steps=1", cwd=tmp_path)
        assert "shorter name" in one_line(r)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["in.txt"] if kind == "long" else ["a", "b", "in.txt"])


def test_resume_refuses_a_metrics_file_the_user_annotated(tmp_path, tiny_data):
    """A note without a step in metrics.jsonl (`{"note": ...}`) was a KeyError traceback on resume;
    now the edited file is the user's (its bytes are not what flopwise recorded): the resume is
    refused in one line and the file is kept byte for byte."""

    from flopwise.train.launch import train
    from tests.conftest import tiny_overrides

    over = tiny_overrides(
        tmp_path / "run", tiny_data, **{"train.steps": 4, "checkpoint.interval": 2, "train.eval_every": 0}
    )
    train(load_config(None, [*over, "train.stop_after=3"]))
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    note = '{"note":  "lr looked high here, kept going"}\n'
    edited = "".join(lines[:1]) + note + "".join(lines[1:])
    metrics.write_text(edited)
    with pytest.raises(ConfigError, match="metrics.jsonl has changed since flopwise wrote it"):
        train(load_config(None, over))
    assert metrics.read_text() == edited


# --- Nothing dropped without a word -------------------------------------------------------------


def test_what_a_folder_walk_skips_is_counted_and_named(tmp_path, monkeypatch):
    """An unreadable sub-folder, .json/.csv files, a dangling link and binary Parquet rows were left
    out without a word (one document instead of two, exit 0): now named in the summary and report.json."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flopwise.data.prepare import prepare_data

    src = tmp_path / "in"
    (src / "locked").mkdir(parents=True)
    (src / "a.txt").write_text("the first document, which is read\n")
    (src / "locked" / "b.txt").write_text("the second document, behind a folder the OS will not list\n")
    (src / "notes.json").write_text('{"text": "json is not an input type"}\n')
    (src / "table.csv").write_text("text\nnor is csv\n")
    (src / "gone").symlink_to(tmp_path / "nowhere")
    pq.write_table(pa.table({"text": pa.array([b"bytes", b"more bytes"], type=pa.binary())}), src / "bin.parquet")
    real = os.scandir

    def scandir(path="."):  # what an unreadable folder does to a reader that is not root
        if isinstance(path, (str, Path)) and os.fspath(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    stats = prepare_data([str(src)], tmp_path / "out", tokenizer="bpe:300", workers=1)
    assert stats.documents == 1
    skipped = json.loads((tmp_path / "out" / "report.json").read_text())["skipped"]
    assert (
        skipped
        == stats.report["skipped"]
        == {
            "unreadable folders": [str(src / "locked")],
            "broken or looping links and special files": [str(src / "gone")],
            "files of another type (not .txt, .md, .jsonl, .parquet)": [
                str(src / "notes.json"),
                str(src / "table.csv"),
            ],
            "Parquet files with rows whose text is not a string": [f"{src / 'bin.parquet'}: 2 of its rows"],
        }
    )


def test_a_folder_with_nothing_usable_is_refused_naming_what_was_skipped(tmp_path, cli):
    src = tmp_path / "in"
    src.mkdir()
    (src / "notes.json").write_text('{"text": "json is not an input type"}\n')
    line = one_line(cli("data", "prepare", str(src), "--out", str(tmp_path / "out"), "--workers", "1"))
    assert "no .txt, .jsonl or .parquet files found" in line and "notes.json" in line
    assert not (tmp_path / "out").exists()


def test_the_prepare_summary_names_what_was_skipped(tmp_path, cli):
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.txt").write_text("a document of plain text to prepare\n")
    (src / "table.csv").write_text("text\nnor is csv\n")
    r = cli("data", "prepare", str(src), "--out", str(tmp_path / "out"), "--workers", "1")
    assert r.returncode == 0, r.stderr
    assert f"skipped: 1 files of another type (not .txt, .md, .jsonl, .parquet) ({src / 'table.csv'})" in r.stdout


def test_eval_and_generate_say_which_checkpoint_they_use_and_why(tmp_path, tiny_run, cli):
    """A run whose newest checkpoint is damaged: eval and generate used the older one without a word."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run(6), run)  # a copy: its newest checkpoint is damaged below
    newest = run / "checkpoints" / "step-00000006"
    with warnings.catch_warnings(record=True) as said:  # what a fresh process would print on stderr
        warnings.simplefilter("always")
        r = cli("generate", str(run), "--prompt", "Alice", "--max-new-tokens", "2")
    assert r.returncode == 0 and r.stderr == "" and not said, (r.stderr, [str(w.message) for w in said])
    shard = max((p for p in newest.rglob("*") if p.is_file() and p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    for args in (
        ["generate", str(run), "--prompt", "Alice", "--max-new-tokens", "2"],
        ["eval", str(run), "--tasks", "alice-lastword"],
    ):
        r = cli(*args)
        assert r.returncode == 0, r.stderr
        assert "note: skipping damaged checkpoint step-00000006 (" in r.stderr and "using step-00000003" in r.stderr


def test_a_huge_tokenizer_vocab_is_refused_before_the_rust_trainer_aborts(tmp_path):
    """`--train-tokenizer 1e10` was a Rust abort ("memory allocation of 566935683088 bytes failed")."""
    (tmp_path / "in.txt").write_text("a little text\n")
    line = one_line(
        flopwise(
            "data",
            "prepare",
            str(tmp_path / "in.txt"),
            "--out",
            str(tmp_path / "out"),
            "--workers",
            "1",
            "--train-tokenizer",
            "10000000000",
        )
    )
    assert "tokenizer vocab 10000000000" in line and "1,048,576" in line
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_with_ids_beyond_its_vocabulary_is_refused_at_load(tmp_path, tiny_data, cli):
    """A token id >= the vocab size overflowed the shard dtype or indexed past the token counts and the
    embedding (IndexError); now the tokenizer is refused when loaded, by every command."""
    tok = json.loads((tiny_data / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab[max(vocab, key=vocab.get)] = 5000
    path = tmp_path / "sparse.json"
    path.write_text(json.dumps(tok))
    (tmp_path / "in.txt").write_text("Alice was beginning to get very tired of sitting by her sister\n")
    line = one_line(
        cli(
            "data",
            "prepare",
            str(tmp_path / "in.txt"),
            "--out",
            str(tmp_path / "out"),
            "--workers",
            "1",
            "--tokenizer",
            str(path),
        )
    )
    assert f"tokenizer {path}: token id 5000 is beyond its vocabulary of 512 entries" in line


# --- A full disk during an export -----------------------------------------------------------------


@pytest.mark.parametrize("command", ["checkpoint-export", "to-hf"])
def test_a_full_disk_during_an_export_is_one_line_and_leaves_no_half_output(
    command, tiny_run, tmp_path, cli, monkeypatch
):
    """`checkpoint export` on a full disk was a traceback (DCP's CheckpointException is a
    BaseException, which `except Exception` let through) and left its temporary folder; `convert
    to-hf` must say the same in one line. Now: exit 2, one line, no checkpoint or weights written."""
    import errno

    from torch.distributed.checkpoint import filesystem

    from flopwise.interop import hf  # patched where it is called: hf binds save_file at import

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out"))

    run = tiny_run(6)  # trained (once per session) before the disk fills
    monkeypatch.setattr(filesystem, "_write_item", no_space)
    monkeypatch.setattr(hf, "save_file", no_space)
    out = tmp_path / "out"
    argv = (
        ["checkpoint", "export", run, "--out", out]
        if command == "checkpoint-export"
        else ["convert", "to-hf", run, out]
    )
    r = cli(*map(str, argv))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "no space left" in r.stderr.lower()
    left = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert not [p for p in left if p.suffix in (".distcp", ".safetensors") or p.name == ".metadata"], left
    assert not list(out.glob("checkpoints/*.tmp")) if out.exists() else True
