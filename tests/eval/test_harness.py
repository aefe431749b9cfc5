"""lm-evaluation-harness parity: the registered `flopwise` model and lm-eval's own `hf` model on the
exported folder score the shipped tasks as `flopwise eval` does (offline, task YAMLs over local files)."""

import os

import pytest

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from flopwise.data.tasks import load_task  # noqa: E402
from flopwise.eval.harness import TASK_PREFIX, FlopwiseLM, task_yaml, write_task_yamls  # noqa: E402
from flopwise.eval.load import load_for_inference  # noqa: E402
from flopwise.eval.tasks import evaluate_task  # noqa: E402
from flopwise.interop.convert import export_hf  # noqa: E402

N = 40


def test_lm_eval_scores_equal_flopwise_eval_and_hf(tiny_run, tmp_path):
    run = tiny_run(12)
    hf_dir = export_hf(run, tmp_path / "hf")
    names = write_task_yamls(tmp_path / "yaml")
    tm = TaskManager(include_path=str(tmp_path / "yaml"))
    ours = lm_eval.simple_evaluate(model=FlopwiseLM(str(run)), tasks=names, limit=N, task_manager=tm)["results"]
    hf = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={hf_dir},dtype=float32",
        tasks=names,
        limit=N,
        task_manager=tm,
        batch_size=8,
        device="cpu",
    )["results"]
    model, _, tok = load_for_inference(run)
    for name in names:
        own = evaluate_task(model, tok, *load_task(name[len(TASK_PREFIX) :]), limit=N)
        metrics = ["acc"] + (["acc_norm"] if own["acc_norm"] is not None else [])
        for m in metrics:  # contexts ending in whitespace included (speaker task: "\n\n")
            assert ours[name][f"{m},none"] == own[m], (name, m)
            assert hf[name][f"{m},none"] == own[m], (name, m)
    # a context longer than the model's window: cut from the left to leave max_gen_toks, as lm-eval's hf model cuts
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    ctx = "Alice was beginning to get very tired of sitting by her sister on the bank. " * 30 + "Alice"
    assert len(tok.encode(ctx).ids) > 2 * model.cfg.max_seq_len
    req = [Instance("generate_until", {}, (ctx, {"until": ["\n\n"], "max_gen_toks": 12}), 0)]
    hf_lm = HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=1)
    assert hf_lm.max_length == model.cfg.max_seq_len
    (out,) = FlopwiseLM(str(run)).generate_until(req)
    assert out and [out] == hf_lm.generate_until(req)  # 12 tokens each (was "": no room left after the context)


def test_rolling_and_generation_against_direct_computation(tiny_run):
    from lm_eval.api.instance import Instance

    from flopwise.eval.generate import generate

    lm = FlopwiseLM(str(tiny_run(6)))
    text = "Alice was beginning to get very tired of sitting by her sister on the bank. " * 12
    (ll,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ids = [lm.eos] + lm.tok.encode(text).ids
    assert len(ids) - 1 > lm.model.cfg.max_seq_len  # really several windows
    # independent reference (the harness's documented windows): blocks of L predicted tokens, each fed the
    # L tokens before its last one; the final block gets a full L-token context and scores only its rest
    import torch

    L, n = lm.model.cfg.max_seq_len, len(ids) - 1
    ref = 0.0
    with torch.no_grad():
        for start in range(0, n, L):
            stop = min(start + L, n)
            lo = max(0, stop - L)
            lp = lm.model(torch.tensor([ids[lo:stop]])).float().log_softmax(-1)[0]
            ref += sum(float(lp[i - lo, ids[i + 1]]) for i in range(start, stop))
    assert ll == pytest.approx(ref, rel=1e-4)
    (out,) = lm.generate_until([Instance("generate_until", {}, ("Alice", {"until": ["\n"], "max_gen_toks": 12}), 0)])
    full = lm.tok.decode(generate(lm.model, lm.tok.encode("Alice").ids, 12, temperature=0.0, stop_id=lm.eos))
    assert out == full.split("\n")[0]
    from flopwise.errors import ConfigError

    with pytest.raises(ConfigError, match=f"max_gen_toks={L} leaves no room .*max_seq_len={L}"):
        lm.generate_until([Instance("generate_until", {}, ("Alice", {"until": ["\n"], "max_gen_toks": L}), 0)])


def test_flopwise_lm_eval_keeps_the_users_include_paths(tiny_run, tmp_path):
    """`flopwise lm-eval --include_path A --include_path B`: the user's own task folders are found
    beside the built-in tasks, and score as `flopwise eval` scores the same examples."""
    import json
    import shutil
    import subprocess
    import sys

    from flopwise.data.tasks import builtin_tasks

    run = tiny_run(6)
    folders = {}
    for name, src in [("my_cloze", "shakespeare-cloze"), ("my_lastword", "alice-lastword")]:
        folder = tmp_path / f"user_{name}"
        folder.mkdir()
        shutil.copy(builtin_tasks()[src], folder / f"{name}.jsonl")
        (folder / f"{name}.yaml").write_text(
            task_yaml(name, folder / f"{name}.jsonl").replace(f"task: {TASK_PREFIX}{name}", f"task: {name}")
        )
        folders[name] = folder
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flopwise",
            "lm-eval",
            "--model",
            "flopwise",
            "--model_args",
            f"path={run}",
            "--tasks",
            f"my_cloze,my_lastword,{TASK_PREFIX}alice-lastword",
            "--include_path",
            str(folders["my_cloze"]),
            f"--include_path={folders['my_lastword']}",
            "--limit",
            "10",
            "--output_path",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results*.json")).read_text())["results"]
    model, _, tok = load_for_inference(run)
    for name in folders:
        own = evaluate_task(model, tok, *load_task(str(folders[name] / f"{name}.jsonl")), limit=10)
        assert results[name]["acc,none"] == own["acc"], name
    assert f"{TASK_PREFIX}alice-lastword" in results


def test_readme_lm_eval_command_with_batch_size_in_model_args(tiny_run, tmp_path):
    """README's `--model_args path=runs/demo,batch_size=16`: lm-eval's CLI also passes its own batch_size
    (default 1), max_batch_size and device (default cuda:0); model_args wins, as the user wrote it."""
    import json
    import subprocess
    import sys

    from lm_eval.config.evaluate_config import EvaluatorConfig

    from flopwise.errors import ConfigError

    run = tiny_run(6)
    cli = EvaluatorConfig()  # what the CLI passes when not told
    passed = {"batch_size": cli.batch_size, "max_batch_size": cli.max_batch_size, "device": cli.device}
    lm = FlopwiseLM.create_from_arg_string(f"path={run},batch_size=16", passed)
    assert lm.batch == 16 and lm.model.tok_embeddings.weight.device.type == "cpu"
    assert FlopwiseLM.create_from_arg_string(f"path={run}", passed).batch == cli.batch_size
    with pytest.raises(ConfigError, match="--model_args batchsize: .*batch_size"):
        FlopwiseLM.create_from_arg_string(f"path={run},batchsize=16", passed)
    tasks = ["shakespeare-cloze", "shakespeare-speaker"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flopwise",
            "lm-eval",
            "--model",
            "flopwise",
            "--model_args",
            f"path={run},batch_size=16",
            "--tasks",
            ",".join(TASK_PREFIX + t for t in tasks),
            "--limit",
            "100",
            "--output_path",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results*.json")).read_text())["results"]
    model, _, tok = load_for_inference(run)
    for t in tasks:
        assert results[TASK_PREFIX + t]["acc,none"] == evaluate_task(model, tok, *load_task(t), limit=100)["acc"], t
