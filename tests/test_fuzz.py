"""Property tests: every reader of user-supplied input, fed random bytes and random values, either
works or raises its one-line flopwise error, and writes nothing outside where it was pointed.
FLOPWISE_FUZZ_EXAMPLES=5000 digs deeper than the 150 examples per property CI runs.

`test_mutated_real_files` feeds each reader structure-aware mutants of a real file flopwise wrote
(tests/fuzzing.py: every JSON/TOML field replaced by each JSON type, removed, duplicated, renamed;
binaries truncated, bit-flipped, safetensors length/header fields and DCP metadata objects and
pickle opcodes mutated): every mutant of every reader in CI (see fuzzing.DEFAULT_CASES for the
count and time on 2 CPU cores); FLOPWISE_FUZZ_CASES=N runs a seeded sample of N per reader plus
the regressions. The real files hold nothing machine-specific, so the mutants are the same bytes
on every machine. Each reader's line in the output (pytest -s) gives its case count and outcomes."""

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flopwise.checkpoints import checkpoint
from flopwise.config.schema import Config, hf_model_fields, load_config
from flopwise.data.shards import open_split, read_index
from flopwise.data.tokenizer import load_tokenizer
from flopwise.errors import CheckpointError, ConfigError, DataError, FlopwiseError

FUZZ = settings(
    max_examples=int(os.environ.get("FLOPWISE_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
KEYS = [
    "train.steps",
    "train.global_batch",
    "model.n_layers",
    "model.d_model",
    "model.n_heads",
    "data.seq_len",
    "optim.lr",
    "parallel.tp",
    "checkpoint.interval",
    "checkpoint.async",
    "guard.window",
    "watchdog.min_s",
    "model.preset",
    "model.arch",
    "model.pos",
    "run.dir",
    "data.tokenizer",
    "cluster.gpus",
    "bogus.key",
    "train",
]
scalars = st.one_of(st.integers(-(10**12), 10**12), st.floats(allow_nan=True), st.booleans(), st.text(max_size=20))
json_values = st.recursive(
    st.none() | scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)


def one_line(e: Exception) -> bool:
    return isinstance(e, FlopwiseError) and "\n" not in str(e) and str(e)


@FUZZ
@given(raw=st.binary(max_size=400) | st.text(max_size=400).map(str.encode))
def test_config_files_of_random_bytes(tmp_path, raw):
    f = tmp_path / "c.toml"
    f.write_bytes(raw)
    try:
        assert isinstance(load_config(f), Config)
    except ConfigError as e:
        assert one_line(e)


@FUZZ
@given(items=st.lists(st.tuples(st.sampled_from(KEYS), st.text(max_size=12) | scalars.map(json.dumps)), max_size=4))
def test_random_overrides(items):
    try:
        load_config(None, [f"{k}={v}" for k, v in items])
    except ConfigError as e:
        assert one_line(e)


@FUZZ
@given(index=json_values, raw=st.binary(max_size=64))
def test_data_index_and_shards(tmp_path, index, raw):
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    (d / "index.json").write_text(json.dumps(index))
    (d / "train.bin").write_bytes(raw)
    before = set(tmp_path.rglob("*"))
    for call in (lambda: read_index(d), lambda: open_split(d, "train")):
        try:
            call()
        except DataError as e:
            assert one_line(e)
    assert set(tmp_path.rglob("*")) == before


@FUZZ
@given(
    good=st.fixed_dictionaries(
        {
            "format": st.just("flopwise-shards/2"),
            "vocab_size": st.integers(-5, 70000),
            "dtype": st.sampled_from(["uint16", "uint32", "float64", "bogus"]),
            "splits": st.fixed_dictionaries(
                {
                    "train": st.fixed_dictionaries(
                        {
                            "files": st.lists(
                                st.fixed_dictionaries(
                                    {
                                        "file": st.sampled_from(["train.bin", "../x", "", 3]),
                                        "tokens": st.integers(-3, 40),
                                    }
                                ),
                                max_size=2,
                            ),
                            "tokens": st.integers(-3, 80),
                        }
                    ),
                    "val": st.just({"files": [], "tokens": 0}),
                }
            ),
        }
    ),
    raw=st.binary(max_size=80),
)
def test_nearly_valid_indexes(tmp_path, good, raw):
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    (d / "index.json").write_text(json.dumps(good))
    (d / "train.bin").write_bytes(raw)
    try:
        tokens = np.asarray(open_split(d, "train"))
        assert int(tokens.max(initial=0)) < good["vocab_size"]
    except DataError as e:
        assert one_line(e)


@FUZZ
@given(raw=st.binary(max_size=300))
def test_tokenizer_files(tmp_path, raw):
    f = tmp_path / "tokenizer.json"
    f.write_bytes(raw)
    with pytest.raises(DataError) as e:
        load_tokenizer(f)
    assert one_line(e.value)


@FUZZ
@given(manifest=json_values | st.binary(max_size=100), metadata=st.binary(max_size=200), state=st.binary(max_size=50))
def test_checkpoint_folders_of_junk(tmp_path, manifest, metadata, state):
    ckpt = tmp_path / "checkpoints" / "step-00000001"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "manifest.json").write_bytes(manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode())
    (ckpt / ".metadata").write_bytes(metadata)
    (ckpt / "state.json").write_bytes(state)
    reason = checkpoint.verify(ckpt)
    assert reason is None or isinstance(reason, str)
    with pytest.raises(CheckpointError) as e:
        checkpoint.read_dcp_metadata(ckpt)
    assert one_line(e.value)
    assert checkpoint.latest(tmp_path) in (None, ckpt)
    try:
        checkpoint.read_state(ckpt)
    except CheckpointError as e:
        assert one_line(e)


@FUZZ
@given(cfg=json_values | st.binary(max_size=100))
def test_hugging_face_configs(tmp_path, cfg):
    (tmp_path / "config.json").write_bytes(cfg if isinstance(cfg, bytes) else json.dumps(cfg).encode())
    try:
        hf_model_fields(tmp_path)
    except (CheckpointError, ConfigError) as e:
        assert one_line(e)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["train", "train.steps=-1"], "train.steps"),
        (["train", "missing.toml"], "config file missing.toml: not found"),
        (["train", "data.path=/no/such/dir", "train.steps=1", "optim.warmup_steps=0"], "/no/such/dir"),
        (["train", "model.init_from=hf:/no/such/folder"], "/no/such/folder"),
        (["eval", "{run}", "--tasks", "alice-lastword"], "no complete checkpoint"),
        (["train", "data.tokenizer=bpe:lots"], "data.tokenizer"),
        (["plan", "measure", "parallel.tp=4", "parallel.dp=4"], "at most 8"),
        (["plan", "measure", "demo", "parallel.tp=3"], "parallel.tp=3 does not divide model.n_heads=8"),
    ],
)
def test_cli_user_errors_are_one_line_exit_2_no_traceback(tmp_path, args, fragment, capsys, monkeypatch):
    """Through cli.main in this process (its handler is what prints the line; an uncaught exception
    fails the test outright)."""
    args = [a.replace("{run}", str(tmp_path)) for a in args]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "400")
    code, err = run_main(args, capsys, monkeypatch)
    assert code == 2, err[-2000:]
    assert "Traceback" not in err and fragment in err
    assert err.strip().startswith("error:") and len(err.strip().splitlines()) == 1, err


# --- structure-aware mutation of real files (tests/fuzzing.py) -----------------------------------
# Each reader gets every mutant of a file flopwise itself wrote (FLOPWISE_FUZZ_CASES=N: a seeded
# sample of N per reader plus the regressions). Every case must end in success or a one-line
# FlopwiseError, and write nothing outside the folder it was pointed at.

import hashlib  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from tests import fuzzing  # noqa: E402
from tests.conftest import run_main, tiny_overrides  # noqa: E402


def build_real(root: Path) -> dict[str, Path]:
    """Real files of every kind under `root`: Alice's chapters prepared into a data folder, a
    2-step training run's checkpoint, its config, an HF folder from `convert to-hf` of it, and a
    task file cut from two built-in tasks.

    Written from inside `root` with relative paths, so no file holds the temp folder's name (the
    config, state.json and the data index say "run", "data", "docs/..."), and DCP's `.metadata`
    normalised (its checkpoint_id and random save_id fixed, the manifest re-signed): every file is
    the same bytes on every machine, so a seed means the same mutants everywhere (before, DCP's
    absolute checkpoint path moved the seeded bit flips with the temp folder's name)."""
    from flopwise.config.schema import to_toml
    from flopwise.data.prepare import prepare_data
    from flopwise.data.shards import resolve_input
    from flopwise.data.tasks import builtin_tasks
    from flopwise.interop.convert import export_hf
    from flopwise.train.launch import train

    root.mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        docs = Path("docs")
        docs.mkdir()
        for i, chunk in enumerate(resolve_input("builtin:alice").read_text().split("CHAPTER")):
            if chunk.strip():
                (docs / f"part_{i:02d}.txt").write_text(chunk)
        prepare_data([str(docs)], Path("data"), tokenizer="bpe:512", val_fraction=0.1, seed=0)
        cfg = load_config(
            None,
            tiny_overrides(
                "run",
                "data",
                **{"train.steps": 2, "checkpoint.interval": 2, "train.eval_every": 2, "optim.warmup_steps": 1},
            ),
        )
        train(cfg)
        ckpt = root / checkpoint.latest("run")
        (ckpt / ".metadata").write_bytes(fuzzing.normalise_dcp_metadata((ckpt / ".metadata").read_bytes()))
        _resign(ckpt, ".metadata")
        # train records run.dir as the real absolute folder it wrote (launch.train); said "run" here
        state = json.loads((ckpt / "state.json").read_text())
        state["config"] = state["config"].replace(f'"{Path("run").resolve()}"', '"run"')
        state["config_hash"] = hashlib.sha256(state["config"].encode()).hexdigest()[:16]
        (ckpt / "state.json").write_text(json.dumps(state))
        _resign(ckpt, "state.json")
        manifest = json.loads((ckpt / "manifest.json").read_text())
        (ckpt / "manifest.json").write_text(json.dumps({**manifest, "config_hash": state["config_hash"]}))
        assert checkpoint.verify(ckpt) is None
        Path("config.toml").write_text(to_toml(cfg))
        export_hf(ckpt, root / "hf")
    finally:
        os.chdir(cwd)
    tasks = builtin_tasks()
    lines = (
        tasks["alice-nextsent"].read_text().splitlines()[:4]
    )  # one kind a file: multiple choice (cloze is its subset)
    (root / "task.jsonl").write_text("\n".join(lines) + "\n")
    return {
        "ckpt": ckpt,
        "config": root / "config.toml",
        "tokenizer": root / "data" / "tokenizer.json",
        "hf": root / "hf",
        "task": root / "task.jsonl",
        "data": root / "data",
    }


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict[str, Path]:
    return build_real(tmp_path_factory.mktemp("real"))


def _m(mutants, raw: bytes, *args, **kwargs) -> list[tuple[str, bytes]]:
    """The real file first (the control case), then its mutants."""
    return fuzzing.with_original(raw, mutants(raw, *args, **kwargs))


def _snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def _resign(ckpt: Path, name: str) -> None:
    """Rewrite the manifest entry of `name` to match its new bytes, as an attacker would, so the
    mutated file reaches the reader instead of being caught by the checksum."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": (ckpt / name).stat().st_size, "sha256": checkpoint._sha256(ckpt / name)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _checkpoint_readers(run_dir: Path, ckpt: Path, out: Path) -> None:
    """What a user reaches with a checkpoint folder: verify/latest, then eval's load."""
    from flopwise.eval.load import load_for_inference

    why = checkpoint.verify(ckpt)
    assert why is None or isinstance(why, str)
    assert checkpoint.latest(run_dir) in (None, ckpt)
    load_for_inference(ckpt)


def _cases_config(real, work):
    f = work / "c.toml"

    def run(raw):
        f.write_bytes(raw)
        load_config(f)

    return _m(fuzzing.toml_mutants, real["config"].read_bytes()), run


def _cases_tokenizer(real, work):
    f = work / "tokenizer.json"

    def run(raw):
        f.write_bytes(raw)
        load_tokenizer(f)

    return _m(fuzzing.json_mutants, real["tokenizer"].read_bytes()), run


def _hf_folder(real, work, name, raw):
    from flopwise.interop.convert import import_hf

    hf = work / "hf"
    shutil.rmtree(hf, ignore_errors=True)
    shutil.copytree(real["hf"], hf)
    (hf / name).write_bytes(raw)
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    if name == "config.json":
        hf_model_fields(hf)
    import_hf(hf, out)  # `flopwise convert from-hf`: from_hf -> load_hf_weights -> checkpoint


def _cases_hf_config(real, work):
    return _m(fuzzing.json_mutants, (real["hf"] / "config.json").read_bytes()), lambda raw: _hf_folder(
        real, work, "config.json", raw
    )


def _cases_safetensors(real, work):
    return (
        _m(fuzzing.safetensors_mutants, (real["hf"] / "model.safetensors").read_bytes()),
        lambda raw: _hf_folder(real, work, "model.safetensors", raw),
    )


def _ckpt_copy(real, work) -> tuple[Path, Path]:
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    ckpt = checkpoint.step_dir(run_dir, 2)
    shutil.copytree(real["ckpt"], ckpt)
    return run_dir, ckpt


def _ckpt_file(real, work, name: str, load=None):
    """Each case: a copy of the real checkpoint with `name` replaced (and re-signed in the
    manifest), read by verify/latest and then eval's load, or by `load` (a resume)."""

    def run(raw):
        run_dir, ckpt = _ckpt_copy(real, work)
        (ckpt / name).write_bytes(raw)
        if name != "manifest.json":
            _resign(ckpt, name)
        if load is None:
            _checkpoint_readers(run_dir, ckpt, work)
        else:
            load(ckpt)

    return run


def _cases_dcp_metadata(real, work):
    return _m(fuzzing.dcp_metadata_mutants, (real["ckpt"] / ".metadata").read_bytes()), _ckpt_file(
        real, work, ".metadata"
    )


def _cases_distcp(real, work):
    name = sorted(p.name for p in real["ckpt"].glob("*.distcp"))[0]
    return _m(fuzzing.binary_mutants, (real["ckpt"] / name).read_bytes(), "distcp", 40), _ckpt_file(real, work, name)


def _cases_manifest(real, work):
    return _m(fuzzing.json_mutants, (real["ckpt"] / "manifest.json").read_bytes()), _ckpt_file(
        real, work, "manifest.json"
    )


def _cases_state(real, work):
    return _m(fuzzing.json_mutants, (real["ckpt"] / "state.json").read_bytes()), _ckpt_file(real, work, "state.json")


def _cases_task(real, work):
    from flopwise.data.tasks import load_task

    f = work / "task.jsonl"

    def run(raw):
        f.write_bytes(raw)
        load_task(str(f))

    return _m(fuzzing.jsonl_mutants, real["task"].read_bytes()), run


def _data_copy(real, work) -> Path:
    d = work / "data"
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(real["data"], d)
    return d


def _data_readers(d: Path) -> None:
    """What training and evaluation reach with a data folder: the index, every split's shards, the
    loader's first batch, an evaluation batch, the tokenizer."""
    from flopwise.data.loader import TokenLoader, eval_batches
    from flopwise.data.shards import tokenizer_of

    read_index(d)
    for split in ("train", "val"):
        len(open_split(d, split))
    TokenLoader(d, "train", 32, 8, seed=0).next_batch()
    next(iter(eval_batches(d, 32, 4, 1)), None)
    tokenizer_of(d)


def _cases_data_index(real, work):
    def run(raw):
        d = _data_copy(real, work)
        (d / "index.json").write_bytes(raw)
        _data_readers(d)

    return _m(fuzzing.json_mutants, (real["data"] / "index.json").read_bytes(), fanout=8), run


def _cases_token_shard(real, work):
    name = json.loads((real["data"] / "index.json").read_text())["splits"]["train"]["files"][0]["file"]

    def run(raw):
        d = _data_copy(real, work)
        (d / name).write_bytes(raw)
        _data_readers(d)

    return _m(fuzzing.binary_mutants, (real["data"] / name).read_bytes(), "shard"), run


def _resumer(real, work):
    """A run built once (resume=none, on the first case) that each case resumes into as build_run
    does: resume_state (config and data checks, step) then resume (weights, optimizer, loader
    position, RNG, guard, step), then one batch is drawn from the restored loader position."""
    from flopwise.train.build import build_run
    from flopwise.train.run import check_data, resume, resume_state

    built = []

    def load(ckpt: Path) -> None:
        if not built:
            cfg = load_config(
                None,
                tiny_overrides(
                    work / "resumer",
                    real["data"],
                    **{
                        "train.steps": 2,
                        "checkpoint.interval": 2,
                        "train.eval_every": 2,
                        "optim.warmup_steps": 1,
                        "checkpoint.resume": '"none"',
                    },
                ),
            )
            built.append(build_run(cfg))
        check_data(ckpt, resume_state(ckpt, built[0].cfg), built[0].data_fingerprint)
        resume(built[0], ckpt)
        built[0].loader.next_batch()

    return load


def _cases_state_resume(real, work):
    return _m(fuzzing.json_mutants, (real["ckpt"] / "state.json").read_bytes()), _ckpt_file(
        real, work, "state.json", _resumer(real, work)
    )


def _cases_dcp_metadata_resume(real, work):
    return (
        _m(fuzzing.dcp_metadata_mutants, (real["ckpt"] / ".metadata").read_bytes(), seed=1),
        _ckpt_file(real, work, ".metadata", _resumer(real, work)),
    )


READERS = {
    "config-toml": _cases_config,
    "tokenizer-json": _cases_tokenizer,
    "hf-config-json": _cases_hf_config,
    "safetensors": _cases_safetensors,
    "dcp-metadata": _cases_dcp_metadata,
    "dcp-metadata-resume": _cases_dcp_metadata_resume,
    "distcp": _cases_distcp,
    "manifest-json": _cases_manifest,
    "state-json": _cases_state,
    "state-json-resume": _cases_state_resume,
    "task-jsonl": _cases_task,
    "data-index-json": _cases_data_index,
    "token-shard": _cases_token_shard,
}


# Cases that found a bug (fixed in the reader): run whatever a seeded sample holds.
REGRESSIONS = {
    "config-toml": ("model/preset=list", "model/arch=dict"),
    "tokenizer-json": ("model/continuing_subword_prefix=str",),  # aborted the process (Rust panic)
    "hf-config-json": ("vocab_size=huge",),
    "dcp-metadata": (":chunks=[]", ":chunk.sizes=bigger", "MEMOIZE=BYTEARRAY8"),  # the last: SystemError
    "dcp-metadata-resume": ("MEMOIZE=BYTEARRAY8",),
    "state-json": ("config=one",),
    "task-jsonl": ("not-utf8",),
    "state-json-resume": ("loader/sources/0/epoch=neg", "loader/sources/0/cursor=negfloat"),
    "data-index-json": ("vocab_size=inf",),
}


# What CPython prints when an error cannot be raised (a destructor, a callback): a reader that makes
# it print one has failed even if it then raised a one-line error (the bytearray SystemError did).
PRINTED_ERRORS = ("SystemError", "Exception ignored", "Traceback")


@pytest.mark.slow
@pytest.mark.parametrize("reader", list(READERS))
def test_mutated_real_files(reader, real, tmp_path, monkeypatch, capsys):
    """Every mutant of a real file: success or a one-line flopwise error, nothing written outside
    the folder it was pointed at (the work folder; cwd is tmp_path too, so stray relative writes
    count), nothing printed to stderr by the interpreter."""
    import warnings

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(tmp_path)
    everything, run = READERS[reader](real, work)
    original = everything[0][1] if everything[0][0] == "original" else None
    assert original is not None, "each reader's first case is the real file unchanged"
    run(original)  # the control: the unmutated file reads (so a refusal below is the mutation's doing)
    cases = fuzzing.pick(everything[1:], fuzzing.budget(), seed=17, always=REGRESSIONS.get(reader, ()))
    outcomes, failures = {"ok": 0, "refused": 0}, []
    capsys.readouterr()
    t0 = time.perf_counter()
    for label, raw in cases:
        outside = _snapshot(tmp_path)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run(raw)
            outcomes["ok"] += 1
        except FlopwiseError as e:
            outcomes["refused"] += 1
            if "\n" in str(e) or not str(e):
                failures.append(f"{label}: multi-line/empty {type(e).__name__}: {str(e)[:300]!r}")
        except Exception as e:  # noqa: BLE001 - the finding
            failures.append(f"{label}: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
        stray = {k for k in set(_snapshot(tmp_path)) ^ set(outside) if not k.startswith("work")}
        if stray:
            failures.append(f"{label}: wrote outside its folder: {sorted(stray)[:3]}")
        printed = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith(PRINTED_ERRORS)]
        if printed:
            failures.append(f"{label}: the interpreter printed {printed[0][:200]!r}")
    with capsys.disabled():
        print(
            f"\nfuzz {reader}: {len(cases)} cases of {len(everything) - 1} mutants, {outcomes['ok']} ok, "
            f"{outcomes['refused']} refused in one line, {len(failures)} failures, {time.perf_counter() - t0:.1f} s"
        )
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures[:40])


# A checkpoint's manifest binds it to its run folder (real path, device, inode): a step folder copied
# from another run is not this run's, so its bytes differ wherever it is written.
_BOUND_TO_THE_RUN_FOLDER = {"manifest-json"}


def _unbound(manifest: Path) -> dict:
    return {k: v for k, v in json.loads(manifest.read_text()).items() if k != "run"}


@pytest.mark.slow
def test_a_seed_means_the_same_mutants_wherever_the_files_are(real, tmp_path_factory):
    """The real files written under another temp folder, of another name length, are the same
    bytes, so every reader's mutants are too. Before: DCP wrote the absolute checkpoint path (and
    a random save_id) into `.metadata`, and the config, state.json, the manifest and the data
    index held the temp folder's path: each machine, each pytest-N, fuzzed another set."""
    elsewhere = build_real(tmp_path_factory.mktemp("elsewhere-under-a-much-longer-folder-name"))
    for name in ("ckpt", "config", "tokenizer", "task", "data", "hf"):
        here, there = real[name], elsewhere[name]
        files = sorted(p.relative_to(here) for p in here.rglob("*") if p.is_file()) if here.is_dir() else [Path()]
        if name == "data":  # the data folder's own provenance files (times) are read by no reader
            files = [f for f in files if f.name not in ("manifest.json", "report.json") and "work" not in f.parts]
        # ownership records name the folder they were written for (real path, device, inode) by
        # design, so a copy elsewhere proves nothing; no fuzzed reader reads them
        files = [f for f in files if f.name not in ("flopwise-manifest.json", "flopwise-run.json")]
        for f in files:
            if name == "ckpt" and f.name == "manifest.json":  # its "run" names the run folder, by design
                assert _unbound(here / f) == _unbound(there / f), f"{name}/{f} depends on where it was written"
                continue
            assert (here / f).read_bytes() == (there / f).read_bytes(), f"{name}/{f} depends on where it was written"
    work_here, work_there = tmp_path_factory.mktemp("w1"), tmp_path_factory.mktemp("w2")
    for reader, cases in READERS.items():
        mine, theirs = cases(real, work_here)[0], cases(elsewhere, work_there)[0]
        if reader in _BOUND_TO_THE_RUN_FOLDER:
            continue  # its bytes name the folder, so its mutants are the same only where it was written
        assert [label for label, _ in mine] == [label for label, _ in theirs], reader
        assert all(a == b for (_, a), (_, b) in zip(mine, theirs, strict=True)), f"{reader}: a mutant differs"
        sample = fuzzing.pick(mine[1:], 120, seed=17, always=REGRESSIONS.get(reader, ()))
        assert sample == fuzzing.pick(theirs[1:], 120, seed=17, always=REGRESSIONS.get(reader, ()))
