import json

import pytest
import torch
import torch.nn.functional as F

from flopwise.config.schema import ModelConfig, load_config
from flopwise.data.tasks import Example, builtin_tasks, load_task, shipped_task_records
from flopwise.errors import DataError
from flopwise.eval.tasks import evaluate_task, score, with_shots
from flopwise.model.transformer import build_model
from flopwise.train.launch import train
from tests.conftest import tiny_overrides


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=512, max_seq_len=64), seed=0).eval()


def reference_logprob(model, ctx, cont):
    x = torch.tensor([ctx + cont])
    with torch.no_grad():
        lp = F.log_softmax(model(x[:, :-1]).float(), -1)[0]
    pos = range(len(ctx) - 1, len(ctx) + len(cont) - 1)
    return sum(lp[p, t].item() for p, t in zip(pos, cont, strict=True))


def test_scores_equal_a_plain_forward_and_do_not_depend_on_batching(model):
    g = torch.Generator().manual_seed(0)
    reqs = [
        (torch.randint(0, 512, (int(n),), generator=g).tolist(), torch.randint(0, 512, (int(m),), generator=g).tolist())
        for n, m in [(5, 1), (17, 3), (9, 6), (30, 2), (60, 10)]
    ]  # the last is cut to max_seq_len from the left
    one = score(model, reqs, batch=1)
    many = score(model, reqs, batch=16)
    for (lp1, g1), (lp2, g2) in zip(one, many, strict=True):
        assert lp1 == pytest.approx(lp2, abs=1e-4) and g1 == g2
    for (ctx, cont), (lp, _) in zip(reqs[:4], one, strict=False):
        assert lp == pytest.approx(reference_logprob(model, ctx, cont), abs=1e-4)


class ByteTok:
    """A stand-in tokenizer: one id per byte, so expected scores are easy to compute."""

    class Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text):
        return self.Enc(list(text.encode()))


def test_multiple_choice_accuracy_and_length_normalisation(model):
    tok = ByteTok()
    ex = [
        Example("The cat sat on the", (" mat", " elephant in the room", " hat"), 0),
        Example("One, two,", (" three", " four, five"), 1),
    ]
    r = evaluate_task(model, tok, "mc", ex)
    expect, expect_norm = 0, 0
    for e in ex:
        sums = [reference_logprob(model, tok.encode(e.context).ids, tok.encode(c).ids) for c in e.choices]
        expect += max(range(len(sums)), key=sums.__getitem__) == e.gold
        norm = [s / len(c.encode()) for s, c in zip(sums, e.choices, strict=True)]
        expect_norm += max(range(len(norm)), key=norm.__getitem__) == e.gold
    assert r["acc"] == expect / 2 and r["acc_norm"] == expect_norm / 2 and r["n"] == 2 and r["ppl"] > 1


class IdTok:
    """Text is space-separated token ids."""

    def encode(self, text):
        return ByteTok.Enc([int(t) for t in text.split()])


def test_cloze_accuracy_is_exact_greedy_match(model):
    ctx = [3, 1, 4, 1, 5]
    with torch.no_grad():
        first = int(model(torch.tensor([ctx])).argmax(-1)[0, -1])
        second = int(model(torch.tensor([ctx + [first]])).argmax(-1)[0, -1])
    text = " ".join(map(str, ctx))
    hit = Example(text, target=f" {first} {second}")
    half = Example(text, target=f" {first} {(second + 1) % 512}")  # first token right, second wrong
    r = evaluate_task(model, IdTok(), "cloze", [hit, half])
    assert r["acc"] == 0.5 and r["acc_norm"] is None


def test_k_shot_prompts_are_seeded_and_exclude_the_example():
    ex = [Example(f"q{i}:", target=f" a{i}") for i in range(10)]
    a, b = with_shots(ex, 3, seed=1), with_shots(ex, 3, seed=1)
    assert a == b and a != with_shots(ex, 3, seed=2)
    for i, ctx in enumerate(a):
        parts = ctx.split("\n\n")
        assert len(parts) == 4 and parts[-1] == f"q{i}:" and f"q{i}: a{i}" not in parts[:-1]
    with pytest.raises(DataError, match="only 10 examples"):
        with_shots(ex, 10, 0)


def test_shipped_tasks_are_what_the_builder_makes():
    shipped = builtin_tasks()
    assert set(shipped) == {
        "alice-lastword",
        "enwiki-lastword",
        "alice-nextsent",
        "shakespeare-cloze",
        "shakespeare-nextline",
        "shakespeare-speaker",
    }
    for name, records in shipped_task_records().items():
        lines = [json.loads(x) for x in shipped[name].read_text().splitlines()]
        assert lines == records and len(lines) >= 150
    _, ex = load_task("alice-nextsent")
    assert all(len(e.choices) == 4 for e in ex)


def test_bad_task_files(tmp_path):
    f = tmp_path / "t.jsonl"
    for content, fragment in [
        ('{"context": "x"}', "needs 'choices'"),
        ("nope", "not JSON"),
        ('{"context": "x", "choices": ["a", "b"], "gold": 5}', "in range"),
        ("", "no examples"),
    ]:
        f.write_text(content)
        with pytest.raises(DataError, match=fragment):
            load_task(str(f))
    with pytest.raises(DataError, match="not a built-in task"):
        load_task("no-such-task")


def test_a_task_file_mixing_multiple_choice_and_cloze_is_refused_at_load(tmp_path, cli):
    """Was: loaded, then a TypeError in the summary (the kind taken from the first example only)."""
    mc, cloze = '{"context": "a", "choices": [" b", " c"], "gold": 0}', '{"context": "a", "target": " b"}'
    f = tmp_path / "mixed.jsonl"
    for lines, msg in [
        ([mc, "", mc, cloze], "line 4 is cloze but line 1 is multiple choice"),
        (["", cloze, mc], "line 3 is multiple choice but line 2 is cloze"),
    ]:
        f.write_text("\n".join(lines) + "\n")
        with pytest.raises(DataError, match=f"task file {f}: {msg}; .* in a file of their own"):
            load_task(str(f))
    r = cli("eval", tmp_path / "no-run", "--tasks", f)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "line 3 is multiple choice" in r.stderr


@pytest.mark.slow
def test_tasks_cli_and_during_training(tiny_data, tmp_path, cli):
    cfg = load_config(
        None,
        tiny_overrides(tmp_path, tiny_data, **{"train.eval_tasks": '["alice-lastword"]', "train.eval_task_limit": 10}),
    )
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    task_rows = [r for r in rows if r.get("task") == "alice-lastword"]
    assert [r["step"] for r in task_rows] == [3, 6] and task_rows[0]["n"] == 10
    r = cli("eval", tmp_path, "--tasks", "alice-lastword,alice-nextsent", "--limit", "12", "--shots", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [o["task"] for o in out] == ["alice-lastword", "alice-nextsent"]
    assert all({"task", "n", "acc", "acc_norm", "ppl"} <= set(o) and o["n"] == 12 for o in out)
    assert out[0]["acc_norm"] is None and 0 <= out[1]["acc_norm"] <= 1


def test_shakespeare_tasks_come_from_held_out_plays_only():
    from flopwise.data.shards import iter_documents
    from flopwise.data.tasks import heldout_plays

    plays = heldout_plays()
    names = [src for src, text in iter_documents(["builtin:shakespeare"]) if text in plays]
    assert [n.rsplit("/", 1)[-1] for n in names] == [
        "cymbeline_gut.txt",
        "julius_caesar_gut.txt",
        "winters_tale_gut.txt",
    ]
    held = "\n".join(plays)
    for name in ("shakespeare-cloze", "shakespeare-nextline", "shakespeare-speaker"):
        _, ex = load_task(name)
        assert len(ex) == 300
        for e in ex[:50]:  # the prompt's last line is verbatim held-out text
            assert e.context.rstrip().rsplit("\n", 1)[-1] in held
