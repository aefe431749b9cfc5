"""The ownership cases (ownership by content, symlinks, `..` paths, one writer per folder), each case
run from nothing as a user would, against the flopwise source tree SRC:

    python benchmarks/long/ownership_cases.py SRC WORK [CASE ...]

prints one JSON row per case: exit code, error lines, traceback or not, and whether the user's
bytes are as they were (`intact`). Before/after: run it with SRC = an older checkout's src/ and
with this one's (the before/after table was made with dcda543 against the change)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SRC, WORK = Path(sys.argv[1]), Path(sys.argv[2])
ONLY = sys.argv[3:]
DATA = WORK / "data"
ENV = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
TINY = [
    'model.preset="demo-tiny"',
    "data.seq_len=32",
    "train.global_batch=8",
    "train.micro_batch=4",
    'train.dtype="fp32"',
    "train.eval_every=2",
    "train.eval_batches=2",
    "train.sample_tokens=0",
    "optim.warmup_steps=2",
    "log.every=1",
    "checkpoint.interval=2",
    f'data.path="{DATA}"',
]


def fw(*args, cwd, wait=True):
    cmd = [sys.executable, "-m", "flopwise", *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900)


def train(run, steps=4, *extra, cwd, wait=True):
    return fw("train", *TINY, f'run.dir="{run}"', f"train.steps={steps}", *extra, cwd=cwd, wait=wait)


def snapshot(paths):
    out = {}
    for p in paths:
        p = Path(p)
        out[str(p)] = (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ("dir" if p.is_dir() else "missing")
        )
    return out


def user(p: Path, text="a user's file\n"):
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


CASES = {}


def case(f):
    CASES[f.__name__] = f
    return f


@case
def symlinked_run_files(u):
    run = u / "run"
    assert train(run, cwd=u).returncode == 0
    files = []
    for name in ("metrics.jsonl", "config.toml", "loss.png"):
        target = user(
            u / "mine" / name, '{"step": 1, "note": "my own"}\n' if name.endswith("jsonl") else f"my {name}\n"
        )
        (run / name).unlink()
        (run / name).symlink_to(target)
        files.append(target)
    return (lambda: train(run, 6, cwd=u)), files


@case
def symlinked_checkpoints_folder(u):
    run = u / "run"
    assert train(run, cwd=u).returncode == 0
    mine = u / "mine"
    shutil.copytree(run / "checkpoints", mine)
    files = [user(mine / "step-00000009.tmp" / "thesis.tex"), user(mine / "step-x.tmp" / "notes.txt")]
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").symlink_to(mine)
    return (lambda: train(run, 8, "checkpoint.keep=1", cwd=u)), files


def dotdot(u, name):
    (u / "t").mkdir(exist_ok=True)
    return u / "t" / "missing" / ".." / name


@case
def dotdot_train_run_dir(u):
    files = [user(u / "t" / "target" / "config.toml"), user(u / "t" / "target" / "metrics.jsonl")]
    return (lambda: train(dotdot(u, "target"), 2, cwd=u)), files


@case
def dotdot_data_prepare_out(u):
    files = [user(u / "t" / "data" / "index.json"), user(u / "t" / "data" / "notes.txt")]
    return (
        lambda: fw("data", "prepare", "builtin:alice", "--out", dotdot(u, "data"), "--train-tokenizer", 300, cwd=u)
    ), files


@case
def dotdot_convert_to_hf(u):
    run = u / "run"
    assert train(run, 2, cwd=u).returncode == 0
    files = [user(u / "t" / "hf" / "model.safetensors"), user(u / "t" / "hf" / "config.json")]
    return (lambda: fw("convert", "to-hf", run, dotdot(u, "hf"), cwd=u)), files


@case
def dotdot_checkpoint_export_out(u):
    run = u / "run"
    assert train(run, 2, cwd=u).returncode == 0
    files = [user(u / "t" / "exp" / "flopwise-run.json")]
    return (lambda: fw("checkpoint", "export", run, "--out", dotdot(u, "exp"), "--force", cwd=u)), files


@case
def dotdot_out_config(u):
    files = [user(u / "t" / "config.toml")]
    return (lambda: fw("scale", "optimal", "--flops", "1e15", "--out-config", dotdot(u, "config.toml"), cwd=u)), files


@case
def dotdot_ids_out(u):
    files = [user(u / "t" / "ids.json")]
    return (
        lambda: fw(
            "data", "contamination", DATA, "--tasks", "alice-lastword", "--ids-out", dotdot(u, "ids.json"), cwd=u
        )
    ), files


@case
def crafted_data_manifest(u):
    d = u / "data"
    files = [user(d / "train-00000.bin"), user(d / "work" / "logs" / "thesis.tex"), user(d / "notes.txt")]
    (d / "manifest.json").write_text(
        json.dumps(
            {
                "format": "flopwise-data-manifest/1",
                "complete": False,
                "files": {},
                "unchecked": ["train-00000.bin", "notes.txt"],
                "folders": ["work/logs"],
            }
        )
    )
    return (lambda: fw("data", "prepare", "builtin:alice", "--out", d, "--train-tokenizer", 300, cwd=u)), files


def _hf_record(p):
    b = p.read_bytes()
    return {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}


@case
def crafted_hf_manifest(u):
    run = u / "run"
    assert train(run, 2, cwd=u).returncode == 0
    hf = u / "hf"
    files = [user(hf / "model.safetensors", "my weights\n")]
    (hf / "flopwise-manifest.json").write_text(
        json.dumps(
            {
                "format": "flopwise-hf-manifest/1",
                "complete": True,
                "files": {"model.safetensors": _hf_record(files[0])},
                "unchecked": [],
                "folders": [],
            }
        )
    )
    return (lambda: fw("convert", "to-hf", run, hf, cwd=u)), files


@case
def crafted_run_record(u):
    run = u / "run"
    files = [user(run / "metrics.jsonl", '{"step": 1, "loss": 9}\n'), user(run / "config.toml", "# my config\n")]
    old = {"format": "flopwise-run/1", "writes": ["config.toml", "metrics.jsonl", "loss.png", "checkpoints"]}
    new = {"format": "flopwise-run/2", "writes": old["writes"], "files": {f.name: _hf_record(f) for f in files}}
    is_new = (SRC / "flopwise" / "checkpoints" / "rundir.py").read_text().count("flopwise-run/2")
    (run / "flopwise-run.json").write_text(json.dumps(new if is_new else old))
    return (lambda: train(run, 2, cwd=u)), files


@case
def copied_run_folder(u):
    a, b = u / "a", u / "b"
    assert train(a, 2, cwd=u).returncode == 0
    shutil.copytree(a, b, symlinks=True)
    shutil.rmtree(b / "checkpoints")
    return (lambda: train(b, 2, cwd=u)), [b / "config.toml", b / "metrics.jsonl", b / "loss.png"]


@case
def copied_run_folder_edited(u):
    a, b = u / "a", u / "b"
    assert train(a, 2, cwd=u).returncode == 0
    shutil.copytree(a, b, symlinks=True)
    shutil.rmtree(b / "checkpoints")
    with open(b / "config.toml", "a") as f:
        f.write("# my template note\n")
    return (lambda: train(b, 2, cwd=u)), [b / "config.toml", b / "metrics.jsonl"]


@case
def two_writers(u):
    run = u / "run"
    first = train(run, 400, "checkpoint.interval=1000", "train.eval_every=1000", cwd=u, wait=False)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "metrics.jsonl").exists():
        time.sleep(0.5)

    def go():
        second = train(run, 3, "optim.lr=0.5", cwd=u)
        first.kill()
        first.wait()
        second.stderr += f"\n[first pid {first.pid}]"
        return second

    return go, []


@case
def stale_lock(u):
    run = u / "run"
    run.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (run / ".flopwise.lock").write_text(f"flopwise lock, held by PID {dead.pid}\n")
    return (lambda: train(run, 2, cwd=u)), []


if not (DATA / "index.json").exists():  # a tiny prepared corpus: Alice's chapters as documents
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"""
from pathlib import Path
from flopwise.data.shards import resolve_input
from flopwise.data.prepare import prepare_data
d = Path({str(WORK / "docs")!r}); d.mkdir(parents=True, exist_ok=True)
for i, c in enumerate(resolve_input("builtin:alice").read_text().split("CHAPTER")):
    (d / f"part_{{i:02d}}.txt").write_text(c) if c.strip() else None
prepare_data([str(d)], {str(DATA)!r}, tokenizer="bpe:300", val_fraction=0.1, seed=0)
""",
        ],
        env=ENV,
        check=True,
        capture_output=True,
    )

for name, f in CASES.items():
    if ONLY and name not in ONLY:
        continue
    u = WORK / name
    shutil.rmtree(u, ignore_errors=True)
    u.mkdir(parents=True)
    try:
        thunk, files = f(u)
        before = snapshot(files)
        out = thunk()
    except Exception as e:  # setup failed
        print(f"| {name} | setup failed: {e!r} |", flush=True)
        continue
    # user bytes: compare with what the setup wrote (files list is read right after setup? recorded by content)
    errs = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    warn = [ln for ln in (out.stdout + out.stderr).splitlines() if "taking over" in ln or "lock" in ln.lower()]
    intact = snapshot(files) == before
    print(
        json.dumps(
            {
                "case": name,
                "rc": out.returncode,
                "errors": errs[-1:],
                "n_err": len(errs),
                "traceback": "Traceback" in out.stderr,
                "warn": warn[:1],
                "intact": intact,
                "pid_note": out.stderr.splitlines()[-1] if name == "two_writers" else "",
                "files": {
                    str(p.relative_to(u)): (p.read_text(errors="replace")[:40] if p.is_file() else "MISSING")
                    for p in files
                },
            }
        ),
        flush=True,
    )
