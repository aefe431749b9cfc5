"""lm-evaluation-harness parity: the registered `flopwise` model and lm-eval's own `hf` model on the
exported folder score the shipped tasks as `flopwise eval` does (offline, task YAMLs over local files)."""

import os
import sys

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


@pytest.mark.slow
def test_lm_eval_scores_equal_flopwise_eval_and_hf(tiny_run, tmp_path):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    run = tiny_run(12)
    hf_dir = export_hf(run, tmp_path / "hf")
    names = write_task_yamls(tmp_path / "yaml")
    tm = TaskManager(include_path=str(tmp_path / "yaml"))
    lm = FlopwiseLM(str(run))
    ours = lm_eval.simple_evaluate(model=lm, tasks=names, limit=N, task_manager=tm)["results"]
    hf_lm = HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=8)  # loaded once, used twice
    hf = lm_eval.simple_evaluate(model=hf_lm, tasks=names, limit=N, task_manager=tm)["results"]
    model, _, tok = load_for_inference(run)
    for name in names:
        own = evaluate_task(model, tok, *load_task(name[len(TASK_PREFIX) :]), limit=N)
        metrics = ["acc"] + (["acc_norm"] if own["acc_norm"] is not None else [])
        for m in metrics:  # contexts ending in whitespace included (speaker task: "\n\n")
            assert ours[name][f"{m},none"] == own[m], (name, m)
            assert hf[name][f"{m},none"] == own[m], (name, m)
    # a context longer than the model's window: cut from the left to leave max_gen_toks, as lm-eval's hf model cuts
    ctx = "Alice was beginning to get very tired of sitting by her sister on the bank. " * 30 + "Alice"
    assert len(tok.encode(ctx).ids) > 2 * model.cfg.max_seq_len
    req = [Instance("generate_until", {}, (ctx, {"until": ["\n\n"], "max_gen_toks": 12}), 0)]
    assert hf_lm.max_length == model.cfg.max_seq_len
    (out,) = lm.generate_until(req)
    assert out and [out] == hf_lm.generate_until(req)  # 12 tokens each (was "": no room left after the context)


def test_rolling_and_generation_against_direct_computation(tiny_run):
    from lm_eval.api.instance import Instance

    from flopwise.eval.generate import generate_tokens

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
    full = lm.tok.decode(generate_tokens(lm.model, lm.tok.encode("Alice").ids, 12, temperature=0.0, stop_id=lm.eos))
    assert out == full.split("\n")[0]
    from flopwise.errors import ConfigError

    with pytest.raises(ConfigError, match=f"max_gen_toks={L} leaves no room .*max_seq_len={L}"):
        lm.generate_until([Instance("generate_until", {}, ("Alice", {"until": ["\n"], "max_gen_toks": L}), 0)])


def readme_command() -> list[str]:
    """The `flopwise lm-eval --model flopwise` command of docs/evaluation.md (the README's evaluation
    page), as a shell would split it."""
    import re
    import shlex

    from tests.conftest import ROOT

    page = (ROOT / "docs" / "evaluation.md").read_text()
    (command,) = re.findall(r"^flopwise lm-eval --model flopwise .*?[^\\]$", page, re.M | re.S)
    return shlex.split(command.replace("\\\n", " "))


@pytest.fixture(scope="module")
def lm_eval_cli(tiny_run, tmp_path_factory):
    """One `flopwise lm-eval` run that both CLI tests read: the README's command on tiny_run(6) (its
    batch_size in --model_args, its tasks and --limit), with two task folders of the user's own added
    to --tasks and given as `--include_path A` and `--include_path=B`. In this process through
    cli.main (lm-eval's CLI needs no fresh one); sys.argv, the working folder and the environment
    lm-eval's CLI sets are restored. (run, readme argv, the user's folders, exit code, results)."""
    import json
    import shutil

    from flopwise.cli import main
    from flopwise.data.tasks import builtin_tasks

    run, tmp = tiny_run(6), tmp_path_factory.mktemp("lm_eval_cli")
    folders = {}
    for name, src in [("my_cloze", "shakespeare-cloze"), ("my_lastword", "alice-lastword")]:
        folder = tmp / f"user_{name}"
        folder.mkdir()
        shutil.copy(builtin_tasks()[src], folder / f"{name}.jsonl")
        (folder / f"{name}.yaml").write_text(
            task_yaml(name, folder / f"{name}.jsonl").replace(f"task: {TASK_PREFIX}{name}", f"task: {name}")
        )
        folders[name] = folder
    readme = readme_command()
    argv = [a.replace("path=runs/demo,", f"path={run},") for a in readme[1:]]
    tasks = argv.index("--tasks") + 1
    argv[tasks] += f",my_cloze,my_lastword,{TASK_PREFIX}alice-lastword"
    argv += ["--include_path", str(folders["my_cloze"]), f"--include_path={folders['my_lastword']}"]
    argv += ["--output_path", str(tmp / "out")]
    with pytest.MonkeyPatch.context() as m:
        m.chdir(tmp)
        m.setattr(sys, "argv", ["flopwise", *argv])
        m.delenv("TOKENIZERS_PARALLELISM", raising=False)  # lm-eval's CLI sets it
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1 if e.code else 0
    found = list((tmp / "out").rglob("results*.json"))
    results = json.loads(found[0].read_text())["results"] if found else {}
    return run, readme, folders, code, results


@pytest.mark.slow
def test_flopwise_lm_eval_keeps_the_users_include_paths(lm_eval_cli):
    """`flopwise lm-eval --include_path A --include_path=B`: the user's own task folders are found
    beside the built-in tasks, and score as `flopwise eval` scores the same examples."""
    run, readme, folders, code, results = lm_eval_cli
    assert code == 0
    limit = int(readme[readme.index("--limit") + 1])
    model, _, tok = load_for_inference(run)
    for name in folders:
        own = evaluate_task(model, tok, *load_task(str(folders[name] / f"{name}.jsonl")), limit=limit)
        assert results[name]["acc,none"] == own["acc"], name
    assert f"{TASK_PREFIX}alice-lastword" in results


@pytest.mark.slow
def test_readme_lm_eval_command_with_batch_size_in_model_args(lm_eval_cli):
    """README's `--model_args path=runs/demo,batch_size=16`: lm-eval's CLI also passes its own batch_size
    (default 1), max_batch_size and device (default cuda:0); model_args wins, as the user wrote it."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    from flopwise.errors import ConfigError

    run, readme, _, code, results = lm_eval_cli
    assert readme[:4] == ["flopwise", "lm-eval", "--model", "flopwise"]
    assert readme[readme.index("--model_args") + 1] == "path=runs/demo,batch_size=16"
    tasks = [t.removeprefix(TASK_PREFIX) for t in readme[readme.index("--tasks") + 1].split(",")]
    limit = int(readme[readme.index("--limit") + 1])
    assert (tasks, limit) == (["shakespeare-cloze", "shakespeare-speaker"], 100)
    cli = EvaluatorConfig()  # what the CLI passes when not told
    passed = {"batch_size": cli.batch_size, "max_batch_size": cli.max_batch_size, "device": cli.device}
    lm = FlopwiseLM.create_from_arg_string(f"path={run},batch_size=16", passed)
    assert lm.batch == 16 and lm.model.tok_embeddings.weight.device.type == "cpu"
    assert FlopwiseLM.create_from_arg_string(f"path={run}", passed).batch == cli.batch_size
    with pytest.raises(ConfigError, match="--model_args batchsize: .*batch_size"):
        FlopwiseLM.create_from_arg_string(f"path={run},batchsize=16", passed)
    assert code == 0
    model, _, tok = load_for_inference(run)
    for t in tasks:
        assert results[TASK_PREFIX + t]["acc,none"] == evaluate_task(model, tok, *load_task(t), limit=limit)["acc"], t
