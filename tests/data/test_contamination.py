"""Decontamination against a planted corpus, checked with a brute-force reference that shares no code
with the module: its own normalization (str.isalnum), exact word strings, no hashing."""

import json
import random
import re

import pytest
from datatrove.data import Document
from typer.testing import CliRunner

from flopwise.cli import app
from flopwise.config.schema import load_config
from flopwise.data.contamination import DecontaminationFilter, measure_contamination
from flopwise.data.prepare import prepare_data
from flopwise.data.shards import iter_documents, resolve_input, val_documents
from flopwise.data.tasks import builtin_tasks, load_task
from flopwise.errors import DataError
from flopwise.eval.load import load_for_inference
from flopwise.eval.tasks import evaluate_task

N = 13
FOREIGN = ["alice-lastword", "alice-nextsent", "shakespeare-cloze", "shakespeare-nextline", "shakespeare-speaker"]
ALL = FOREIGN + ["enwiki-lastword"]  # enwiki-lastword was built from the background text itself


def ref_words(text: str) -> list[str]:
    return "".join(c if c.isalnum() else " " for c in text.lower()).split()


def ref_text(e) -> str:
    return e.context + (e.choices[e.gold] if e.choices else e.target)


def ref_grams(ws: list[str], n: int = N) -> set[str]:
    m = min(n, len(ws))
    return {" ".join(ws[i : i + m]) for i in range(len(ws) - m + 1)} if ws else set()


def brute_force(tasks: dict[str, list], docs: list[str]) -> tuple[dict[str, list[int]], list[int]]:
    """(contaminated example ids per task, touched document ids): exact word windows of each doc."""
    example_grams = {name: [ref_grams(ref_words(ref_text(e))) for e in ex] for name, ex in tasks.items()}
    lengths = {len(g.split()) for gs in example_grams.values() for s in gs for g in s}
    wanted = {g for gs in example_grams.values() for s in gs for g in s}
    found, touched = set(), []
    for i, doc in enumerate(docs):
        ws = ref_words(doc)
        hit = {g for m in lengths for g in (" ".join(ws[p : p + m]) for p in range(len(ws) - m + 1)) if g in wanted}
        if hit:
            touched.append(i)
            found |= hit
    return {name: [k for k, s in enumerate(gs) if s & found] for name, gs in example_grams.items()}, touched


def shout(text: str) -> str:
    """The same words with case, punctuation (ASCII and Unicode) and whitespace changed."""
    return re.sub(r"\s+", " -- ", text.upper()).replace("'", "\u2019").replace(",", "\u2026;")


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """enwiki articles (the background), with 7 task examples inserted into 7 of them."""
    wiki = resolve_input("builtin:enwiki").read_text(encoding="utf-8")
    docs = [d for d in re.split(r"\n(?== .+ =\n)", wiki) if d.strip()][:40]
    tasks = {name: load_task(name)[1] for name in ALL}
    plants = [
        ("alice-lastword", 3, str),
        ("alice-lastword", 150, shout),
        ("alice-nextsent", 7, str),
        ("shakespeare-nextline", 42, shout),
        ("shakespeare-speaker", 9, str),
        ("shakespeare-cloze", 1, shout),
        ("shakespeare-cloze", 3, str),
    ]  # cloze 1 and 3 are under 13 words
    assert all(len(ref_words(ref_text(tasks[t][k]))) < N for t, k, _ in plants[-2:])
    rng = random.Random(0)
    where = rng.sample(range(len(docs)), len(plants))
    for (task, k, change), d in zip(plants, where, strict=True):
        ws = docs[d].split(" ")
        p = rng.randrange(len(ws))
        docs[d] = " ".join(ws[:p]) + "\n" + change(ref_text(tasks[task][k])) + "\n" + " ".join(ws[p:])
    # an example split over two documents is not an overlap with either
    half = ref_words(ref_text(tasks["alice-lastword"][20]))
    docs[min(set(range(len(docs))) - set(where))] += " " + " ".join(half[:10])
    path = tmp_path_factory.mktemp("planted") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path, docs, tasks, plants, sorted(where)


@pytest.fixture(scope="module")
def truth(planted):
    """The brute-force reference on the planted documents, for all tasks and for the foreign ones
    (several tests' reference: computed once)."""
    _, docs, tasks, _, _ = planted
    return {"all": brute_force(tasks, docs), "foreign": brute_force({t: tasks[t] for t in FOREIGN}, docs)}


def test_planted_examples_are_found_and_nothing_else(planted, truth):
    path, docs, tasks, plants, where = planted
    report = measure_contamination(str(path), list(tasks.items()))
    ids, touched = truth["all"]
    got = dict(zip(report.tasks, report.contaminated, strict=True))
    for task, k, _ in plants:  # recall 1, verbatim and changed
        assert k in got[task]
    assert got == ids  # precision: nothing reported that is not truly there
    assert report.touched == touched and set(where) <= set(touched)
    assert got["enwiki-lastword"]  # examples built from the background text: natural overlap, found too
    assert report.documents == len(docs)


@pytest.mark.slow
def test_prepared_folder_and_cli_json(planted, truth, tmp_path):
    path, _, tasks, _, _ = planted
    data = tmp_path / "data"
    prepare_data([str(path)], data, tokenizer="bpe:300", val_fraction=0.0)
    ids_truth, _ = truth["all"]
    ids = tmp_path / "ids.json"
    r = CliRunner().invoke(
        app, ["data", "contamination", str(data), "--tasks", ",".join(ALL), "--json", "--ids-out", str(ids)]
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert rows == [
        {
            "task": t,
            "examples": len(tasks[t]),
            "contaminated": len(ids_truth[t]),
            "share": len(ids_truth[t]) / len(tasks[t]),
        }
        for t in ALL
    ]
    written = json.loads(ids.read_text())
    assert written.pop("written_by").startswith("flopwise data contamination") and written == ids_truth
    r = CliRunner().invoke(app, ["data", "contamination", str(data), "--tasks", "alice-lastword"])
    assert r.exit_code == 0 and "training documents contain a task n-gram" in r.output


def test_short_n_and_bad_inputs(tmp_path):
    (tmp_path / "doc.txt").write_text("Say: I will, my LORD! and go")
    task = tmp_path / "t.jsonl"
    task.write_text(
        json.dumps({"context": "I will, my", "target": " lord"})
        + "\n"
        + json.dumps({"context": "will my", "target": " liege"})
        + "\n"
    )
    assert measure_contamination(str(tmp_path / "doc.txt"), [load_task(str(task))], n=3).contaminated == [[0]]
    assert measure_contamination(str(tmp_path / "doc.txt"), [load_task(str(task))], n=2).contaminated == [[0, 1]]
    with pytest.raises(DataError, match="no such file"):
        measure_contamination(str(tmp_path / "missing"), [load_task(str(task))])
    with pytest.raises(DataError, match="--n 0"):
        measure_contamination(str(tmp_path / "doc.txt"), [load_task(str(task))], n=0)
    with pytest.raises(DataError, match="--tasks"):
        measure_contamination(str(tmp_path / "doc.txt"), [])


@pytest.mark.slow
def test_datatrove_filter_drops_exactly_the_planted_documents(planted, truth):
    _, docs, _, _, where = planted
    step = DecontaminationFilter(FOREIGN)
    kept = [int(d.id) for d in step.run(iter(Document(text=t, id=str(i)) for i, t in enumerate(docs)))]
    _, touched = truth["foreign"]
    assert touched == where
    assert kept == [i for i in range(len(docs)) if i not in where]
    assert step.stats["dropped"].total == len(where)


@pytest.mark.slow
def test_clean_subset_scores(tiny_data, tiny_run):
    run = tiny_run(6)
    limit, names = 30, ["alice-nextsent", "alice-lastword"]
    r = CliRunner().invoke(
        app,
        [
            "eval",
            str(run),
            "--tasks",
            ",".join(names),
            "--limit",
            str(limit),
            "--clean-against",
            str(tiny_data),
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    dirty = measure_contamination(str(tiny_data), [load_task(t) for t in names]).contaminated
    model, _, tok = load_for_inference(run)
    for row, name, bad in zip(rows, names, dirty, strict=True):
        examples = load_task(name)[1][:limit]
        clean = [k for k in range(limit) if k not in bad]
        assert 0 < row["clean_n"] == limit - len([k for k in bad if k < limit]) == len(clean) < limit
        one = [evaluate_task(model, tok, name, [examples[k]]) for k in clean]  # each example alone
        assert row["clean_acc"] == pytest.approx(sum(o["acc"] for o in one) / len(clean))
        if row["acc_norm"] is None:
            assert row["clean_acc_norm"] is None
        else:
            assert row["clean_acc_norm"] == pytest.approx(sum(o["acc_norm"] for o in one) / len(clean))
        assert {"task", "n", "acc", "acc_norm", "ppl", "nll", "brier", "shots"} < set(row)


@pytest.mark.slow
def test_shipped_in_domain_tasks_are_clean_against_the_demo_train_split(tmp_path):
    """The README's measured figure: the Shakespeare tasks against the demo's train plays (clean), and
    against the held-out plays they were built from (nearly all contaminated: the rule has teeth)."""
    cfg = load_config("demo")
    plays = [t for _, t in iter_documents([cfg.data.path])]
    held = val_documents(len(plays), cfg.data.val_fraction, cfg.run.seed)
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
    for i, text in enumerate(plays):
        (tmp_path / ("val" if i in held else "train") / f"{i:02d}.txt").write_text(text)
    names = [t for t in builtin_tasks() if t.startswith("shakespeare")]
    tasks = {t: load_task(t)[1] for t in names}
    train = measure_contamination(str(tmp_path / "train"), list(tasks.items()))
    assert train.documents == len(plays) - len(held) == 39
    assert [r["contaminated"] for r in train.rows()] == [0, 0, 0] and train.touched == []
    assert brute_force(tasks, [plays[i] for i in range(len(plays)) if i not in held]) == ({t: [] for t in names}, [])
    val = measure_contamination(str(tmp_path / "val"), list(tasks.items()))
    truth, touched = brute_force(tasks, [plays[i] for i in sorted(held)])
    assert dict(zip(val.tasks, val.contaminated, strict=True)) == truth and val.touched == touched == [0, 1, 2]
    assert [r["contaminated"] for r in val.rows()] == [300, 300, 289]  # 11 speaker prompts span cut speeches


@pytest.mark.slow
def test_prepare_step_drops_the_planted_documents_and_reports_them(planted, truth, tmp_path):
    """`data prepare --decontaminate TASKS` (2 workers): the folder holds every document but the
    brute-force-contaminated ones, the report counts them, and the result measures clean."""
    path, docs, tasks, _, where = planted
    _, touched = truth["foreign"]
    data = tmp_path / "data"
    stats = prepare_data([str(path)], data, tokenizer="bpe:300", val_fraction=0.0, workers=2, decontaminate=FOREIGN)
    [row] = [r for r in stats.report["stages"] if r["stage"] == "decontaminate"]
    assert row["documents_removed"] == len(touched) == len(where) and row["rules"] == {"contaminated": len(where)}
    assert stats.documents == len(docs) - len(where)
    assert measure_contamination(str(data), [(t, tasks[t]) for t in FOREIGN]).contaminated == [[] for _ in FOREIGN]
