import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
import warnings
from pathlib import Path

import pytest

# Under xdist (`pytest -n 2`) each worker shares the cores with the other: one OpenMP thread each, or
# the two pools contend (a model test of 0.03 s alone took 5 s beside the other worker's training).
# Set before torch is imported; the processes tests start inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# The CPU's MFU ceilings (flopwise.train.metrics.ceilings_file): timed once per session, shared by every
# process the tests start (inherited), and not written to the user's own cache folder
if "FLOPWISE_CACHE_DIR" not in os.environ:
    os.environ["FLOPWISE_CACHE_DIR"] = tempfile.mkdtemp(prefix="flopwise-test-cache-")
    atexit.register(shutil.rmtree, os.environ["FLOPWISE_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


OWN_PROCESSES = ("multiproc", "slurm", "multinode")
# The process tests' two lanes under `pytest -n 2`: tests/parallel/'s and tests/plan/'s launches (4-rank
# FSDP2/DTensor jobs on gloo) and the calibrations are CPU-bound from start to end; the others (train
# runs with injected faults, SLURM jobs, nodes, CLI commands that start ranks) spend much of their time
# waiting on injected sleeps, watchdog timeouts and SLURM's timer. One after another on one worker they
# were the suite's tail (1,286 s of 1,299 s, 2026-12-06) while the other worker had run out of work;
# side by side the waiting lane costs the CPU-bound one little, and no two CPU-bound launches meet.
CPU_BOUND_LAUNCHES = ("tests/parallel/", "tests/plan/", "tests/test_calibrate.py")


def xdist_group(item: pytest.Item) -> str:
    """The lane a test runs in under `pytest -n 2`: one of the two process lanes, or its file's."""
    if not any(item.get_closest_marker(m) for m in OWN_PROCESSES):
        return item.nodeid.split("::")[0]
    return "processes-launches" if item.nodeid.startswith(CPU_BOUND_LAUNCHES) else "processes-runs"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist's `--dist loadgroup` (`pytest -n 2`): the tests that start processes of
    their own (torchrun ranks, SLURM jobs, nodes) in the two lanes of xdist_group, each run one test
    after another on one worker; every other test with its file, so a module's fixtures are built once.
    Under xdist the queue (pyproject: --no-loadscope-reorder, so xdist keeps this order) starts with
    the two lanes, one per worker, then the files with slow tests, longest first, so that no long
    file starts last and ends the run alone."""
    groups = {item: xdist_group(item) for item in items}
    for item, group in groups.items():
        item.add_marker(pytest.mark.xdist_group(group))
        if getattr(config.option, "loadgroup", False) and not hasattr(item, "_nodeid"):
            # pytest 9 keeps a node's id in `_id`, so xdist 3.8's loadgroup, which appends "@group" to
            # `_nodeid`, groups nothing (measured: an 8-rank and a 4-rank launch ran at once); the
            # suffix is written where pytest 9 reads it, in the form xdist's scheduler splits
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(f"{item.nodeid}@{group}")
    if hasattr(config, "workerinput"):  # an xdist worker: its collection order is the controller's queue
        slow = {g: 0 for g in groups.values()}
        for item, group in groups.items():
            slow[group] += item.get_closest_marker("slow") is not None
        rank = {"processes-launches": 0, "processes-runs": 1}
        # the waiting tests first in their lane: while they wait, the other lane's multi-rank launches use
        # both cores; last, they met the calibrations' one thread and left a core idle (about 100 core-s
        # of a 953-s run, 2026-12-06)
        items.sort(
            key=lambda i: (
                rank.get(groups[i], 2),
                -slow[groups[i]],
                groups[i] in rank and i.get_closest_marker("waits") is None,
            )
        )  # stable: a file's order kept


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """FLOPWISE_TEST_CPU=FILE: a JSON line per test with its wall seconds, the CPU seconds it used (its
    own and its finished child processes': torchrun ranks, CLI runs; fixtures it set up included), its
    xdist worker and when it ended: where the suite's work goes, which wall clocks under `-n 2` (two
    workers sharing 2 cores) hide, and what each worker ran when."""
    t = os.times()
    try:
        return (yield)
    finally:
        if path := os.environ.get("FLOPWISE_TEST_CPU"):
            e = os.times()
            cpu = sum(getattr(e, k) - getattr(t, k) for k in ("user", "system", "children_user", "children_system"))
            row = {
                "test": item.nodeid,
                "wall": round(e.elapsed - t.elapsed, 2),
                "cpu": round(cpu, 2),
                "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
                "end": round(e.elapsed, 1),  # seconds since an arbitrary origin, the same for every process here
            }
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """Alice in Wonderland split into chapters, tokenized with a 512-token BPE."""
    from flopwise.data.prepare import prepare_data
    from flopwise.data.shards import resolve_input

    src = resolve_input("builtin:alice").read_text()
    docs = tmp_path_factory.mktemp("alice_docs")
    for i, chunk in enumerate(src.split("CHAPTER")):
        if chunk.strip():
            (docs / f"part_{i:02d}.txt").write_text(chunk)
    out = tmp_path_factory.mktemp("data") / "alice"
    prepare_data([str(docs)], out, tokenizer="bpe:512", val_fraction=0.1, seed=0)
    return out


def tiny_overrides(run_dir, data_dir, **extra) -> list[str]:
    base = {
        "run.dir": f'"{run_dir}"',
        "data.path": f'"{data_dir}"',
        "model.preset": '"demo-tiny"',
        "data.seq_len": 32,
        "train.global_batch": 8,
        "train.micro_batch": 4,
        "train.dtype": '"fp32"',
        "train.steps": 6,
        "train.eval_every": 3,
        "train.eval_batches": 2,
        "train.sample_tokens": 0,
        "optim.warmup_steps": 2,
        "log.every": 1,
        "checkpoint.interval": 3,
    }
    base.update({k: v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="session")
def tiny_run(tiny_data, tmp_path_factory):
    """`tiny_run(steps)`: the run folder of `tiny_overrides` trained for `steps` steps on Alice, trained
    once per session (training is deterministic: a test's own run would be byte for byte this one).
    Read it, export or evaluate it elsewhere; never write into it."""
    from flopwise.config.schema import load_config
    from flopwise.train.launch import train

    runs: dict[int, Path] = {}

    def get(steps: int) -> Path:
        if steps not in runs:
            out = tmp_path_factory.mktemp(f"tiny_run_{steps}") / "run"
            train(load_config(None, tiny_overrides(out, tiny_data, **{"train.steps": steps})))
            runs[steps] = out
        return runs[steps]

    return get


ROOT = Path(__file__).parents[1]
FIXTURES = ROOT / "tests" / "fixtures"  # checked-in reference data, with its sources (SOURCE.md)
WORKER = ROOT / "tests" / "dist" / "worker.py"


def run_jobs(n: int, jobs: list[dict], tmp: Path, timeout: int | None = None, retry: bool = True) -> dict:
    """Run `jobs` in one torchrun launch of `n` gloo ranks (tests/dist/worker.py); their results by
    name. A job that fails on any rank fails the launch with that rank's trace. `--standalone`: the
    rendezvous takes a free port, so launches of parallel test workers (or of other users of the
    machine) never meet on a fixed one. Each job has WORKER_HANG_S (tests/dist/worker.py); the launch
    as a whole, by default, that per job and two minutes to start, so a busy machine only slows it.

    A rank killed by a signal while no job raised is torch crashing, not a job failing: CI's
    sequential run saw it once in plan-engine's 46-job launch (`malloc(): unaligned tcache chunk
    detected`, SIGABRT, between profiled steps). The jobs not finished then run once more in a new
    launch, with a warning that says so; a second crash, a job's error or a hang fails as before."""
    tag = uuid.uuid4().hex[:8]
    spec, out = tmp / f"jobs-{tag}.json", tmp / f"out-{tag}.json"
    spec.write_text(json.dumps(jobs))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(n),
            str(WORKER),
            str(spec),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=timeout or 120 + 300 * len(jobs),
        env=env,
    )
    errors = [json.loads(f.read_text()) for f in sorted(tmp.glob(f"{out.name}.rank*.error"))]
    assert not errors, "\n".join(f"job {e['job']}: {e['error']}\n{e['trace']}" for e in errors)
    done = json.loads(out.read_text()) if out.exists() else {}
    crashed = re.search(r"traceback : Signal \d+ \((SIGABRT|SIGSEGV|SIGBUS)\)", r.stderr)
    if r.returncode != 0 and retry and crashed:
        left = [j for j in jobs if j["name"] not in done]
        warnings.warn(
            f"torchrun rank crashed ({crashed[1]}) with {len(left)} of {len(jobs)} jobs left; "
            f"running them again: {r.stderr[-1500:]}",
            stacklevel=2,
        )
        return {**done, **run_jobs(n, left, tmp, timeout, retry=False)}
    assert r.returncode == 0, r.stderr[-4000:]
    return done


def flopwise(
    *args, cwd: Path | None = None, timeout: int = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`flopwise ARGS` in a fresh process (as a user runs it): its exit code, stdout and stderr."""
    return subprocess.run(
        [sys.executable, "-m", "flopwise", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def main_in_process(argv: list, capsys, monkeypatch, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`flopwise ARGV` in this process, through cli.main (the top-level handler the console script
    runs), in `cwd` if given: its exit code, stdout and stderr, as a fresh process would give them,
    without an interpreter start per call (and with its lines in the coverage)."""
    from flopwise.cli import main

    with monkeypatch.context() as m:
        if cwd is not None:
            m.chdir(cwd)
        m.setattr(sys, "argv", ["flopwise", *map(str, argv)])
        capsys.readouterr()
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1 if e.code else 0
        out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out.out, out.err)


def run_main(argv: list, capsys, monkeypatch) -> tuple[int, str]:
    """main_in_process's exit code and stderr."""
    r = main_in_process(argv, capsys, monkeypatch)
    return r.returncode, r.stderr


@pytest.fixture
def cli(capsys, monkeypatch):
    """main_in_process bound to this test's capture: `cli(*args, cwd=None)`."""
    return lambda *args, cwd=None: main_in_process(list(args), capsys, monkeypatch, cwd)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """The embedded default's data (Shakespeare, its 4096-token BPE), prepared once by the code
    `flopwise train` prepares it with: pass it as data.path to a demo-config run, which would
    otherwise prepare the same folder again under its own run.dir (6 s or more each)."""
    from flopwise.config.schema import load_config
    from flopwise.train.build import ensure_data

    return ensure_data(load_config("demo"), tmp_path_factory.mktemp("demo_run"))[0].data_dir


@pytest.fixture(scope="session")
def tiny_mix(tiny_data, tmp_path_factory) -> str:
    """A two-source mixture for data.sources: Alice (weight 0.7) and three Shakespeare plays
    tokenized with Alice's tokenizer (0.3)."""
    from flopwise.data.prepare import prepare_data
    from flopwise.data.shards import resolve_input

    plays = tmp_path_factory.mktemp("plays")
    for f in sorted(resolve_input("builtin:shakespeare").iterdir())[:3]:
        (plays / f.name).write_text(f.read_text()[:60_000])
    out = tmp_path_factory.mktemp("data") / "plays"
    prepare_data([str(plays)], out, tokenizer=str(tiny_data / "tokenizer.json"), val_fraction=0.34, seed=0)
    return f'[{{path="{tiny_data}", weight=0.7, name="alice"}}, {{path="{out}", weight=0.3, name="plays"}}]'


@pytest.fixture(scope="session")
def tiny_docs(tiny_data, tmp_path_factory) -> Path:
    """Alice cut into paragraphs (~1,000 short documents, most 32-token windows hold a boundary),
    tokenized with Alice's tokenizer."""
    import json

    from flopwise.data.prepare import prepare_data
    from flopwise.data.shards import resolve_input

    paragraphs = [p for p in resolve_input("builtin:alice").read_text().split("\n\n") if p.strip()]
    src = tmp_path_factory.mktemp("paragraphs") / "alice.jsonl"
    src.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    out = tmp_path_factory.mktemp("data") / "paragraphs"
    prepare_data([str(src)], out, tokenizer=str(tiny_data / "tokenizer.json"), val_fraction=0.1, seed=0)
    return out


@pytest.fixture
def tiny_run_copy(tiny_run, tmp_path):
    """`tiny_run_copy(steps)`: a copy of tiny_run(steps)'s folder in this test's tmp_path, to damage
    or change. Checkpoint reading (verify, latest, resolve, list_complete, prune) asks no ownership;
    training on in the copy is refused (a copied run folder proves nothing): train in a folder of its own."""

    return lambda steps: Path(shutil.copytree(tiny_run(steps), tmp_path / f"tiny_run_{steps}"))
