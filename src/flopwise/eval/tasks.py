"""Zero- and few-shot evaluation scored by log-likelihood, as GPT-3 and lm-evaluation-harness do.

Task files are JSONL, one example per line:
  multiple choice  {"context": ..., "choices": [...], "gold": index}
  cloze            {"context": ..., "target": ...}
Multiple choice: each choice is scored by the summed log-probability of its tokens given the
context; `acc` takes the best sum, `acc_norm` the best sum per byte of the choice (the harness's
length normalisation); `ppl` is over the gold continuations. Cloze (LAMBADA-style): `acc` counts
targets that greedy decoding reproduces token for token; `ppl` is over the target tokens.
Context and continuation are tokenized separately and concatenated, so the continuation's tokens do
not depend on the context. k-shot prompts prepend k other examples (seeded) with their answers.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from flopwise.errors import DataError

SHOT_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...] | None = None
    gold: int | None = None
    target: str | None = None

    @property
    def answer(self) -> str:
        return self.choices[self.gold] if self.choices else self.target


def builtin_tasks() -> dict[str, Path]:
    root = Path(str(resources.files("flopwise") / "corpus" / "tasks"))
    return {p.stem: p for p in sorted(root.glob("*.jsonl"))}


def load_task(spec: str) -> tuple[str, list[Example]]:
    """A built-in task name or a path to a JSONL task file."""
    known = builtin_tasks()
    path = known.get(spec, Path(spec))
    if not path.is_file():
        raise DataError(f"task {spec!r}: not a built-in task ({', '.join(known)}) nor a JSONL file")
    examples = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise DataError(f"task file {path}: line {n} is not JSON") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("context"), str):
            raise DataError(f"task file {path}: line {n} needs a string 'context'")
        if "choices" in rec:
            ch, gold = rec["choices"], rec.get("gold")
            if not (isinstance(ch, list) and len(ch) >= 2 and all(isinstance(c, str) for c in ch)
                    and isinstance(gold, int) and 0 <= gold < len(ch)):
                raise DataError(f"task file {path}: line {n} needs 'choices' (2+ strings) and an integer 'gold' in range")
            examples.append(Example(rec["context"], tuple(ch), gold))
        elif isinstance(rec.get("target"), str):
            examples.append(Example(rec["context"], target=rec["target"]))
        else:
            raise DataError(f"task file {path}: line {n} needs 'choices' + 'gold' or a string 'target'")
    if not examples:
        raise DataError(f"task file {path}: no examples")
    return path.stem, examples


def with_shots(examples: list[Example], shots: int, seed: int) -> list[str]:
    """The context of each example with `shots` other examples (and their answers) before it."""
    if shots == 0:
        return [e.context for e in examples]
    if shots >= len(examples):
        raise DataError(f"--shots {shots}: the task has only {len(examples)} examples")
    rng = random.Random(seed)
    contexts = []
    for i, e in enumerate(examples):
        pool = [j for j in rng.sample(range(len(examples)), shots + 1) if j != i][:shots]
        demo = SHOT_SEPARATOR.join(examples[j].context + examples[j].answer for j in pool)
        contexts.append(demo + SHOT_SEPARATOR + e.context)
    return contexts


@torch.no_grad()
def score(model, requests: list[tuple[list[int], list[int]]], batch: int = 16,
          progress: Callable[[int], None] | None = None) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), greedy reproduces it) for each (context, continuation)."""
    model.eval()
    device = model.tok_embeddings.weight.device
    limit = model.cfg.max_seq_len + 1
    out: list[tuple[float, bool] | None] = [None] * len(requests)
    order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][0]) + len(requests[i][1])))
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        seqs = []
        for i in idx:
            ctx, cont = requests[i]
            if not cont:
                raise DataError("a continuation tokenized to no tokens")
            seqs.append((ctx + cont)[-limit:])  # keep the continuation, cut the context from the left
        width = max(len(s) for s in seqs) - 1
        x = torch.zeros(len(seqs), width, dtype=torch.long)
        for r, s in enumerate(seqs):
            x[r, :len(s) - 1] = torch.tensor(s[:-1])
        logprobs = model(x.to(device)).float().log_softmax(-1).cpu()
        for r, (i, s) in enumerate(zip(idx, seqs)):
            n = len(requests[i][1])
            pos = torch.arange(len(s) - 1 - n, len(s) - 1)
            target = torch.tensor(s[-n:])
            lp = logprobs[r, pos]
            out[i] = (float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
        if progress:
            progress(len(idx))
    return out


def evaluate_task(model, tokenizer, name: str, examples: list[Example], shots: int = 0, seed: int = 0,
                  batch: int = 16, limit: int | None = None, progress=None) -> dict:
    examples = examples[:limit] if limit else examples
    contexts = with_shots(examples, shots, seed)
    enc = lambda text: tokenizer.encode(text).ids  # noqa: E731
    requests, owners = [], []
    for k, (e, ctx) in enumerate(zip(examples, contexts)):
        c = enc(ctx)
        for j, cont in enumerate(e.choices or (e.target,)):
            requests.append((c, enc(cont)))
            owners.append((k, j))
    scores = score(model, requests, batch, progress)
    per_example: dict[int, list] = {}
    for (k, j), s, (_, cont) in zip(owners, scores, requests):
        per_example.setdefault(k, []).append((j, s, len(cont)))
    correct = correct_norm = 0
    nll, ntok = 0.0, 0
    for k, e in enumerate(examples):
        rows = per_example[k]
        if e.choices:
            best = max(rows, key=lambda r: r[1][0])[0]
            best_norm = max(rows, key=lambda r: r[1][0] / max(1, len(e.choices[r[0]].encode())))[0]
            correct += best == e.gold
            correct_norm += best_norm == e.gold
            gold = next(r for r in rows if r[0] == e.gold)
            nll, ntok = nll - gold[1][0], ntok + gold[2]
        else:
            (_, (lp, greedy), n), = rows
            correct += greedy
            nll, ntok = nll - lp, ntok + n
    n = len(examples)
    is_mc = examples[0].choices is not None
    return {"task": name, "n": n, "acc": correct / n, "acc_norm": correct_norm / n if is_mc else None,
            "ppl": math.exp(nll / ntok), "shots": shots}


# --- building the shipped tasks from held-out text ---------------------------------------------

_SENTENCE = re.compile(r"[^.!?]+[.!?]")


def sentences(text: str) -> list[str]:
    flat = " ".join(text.split())
    return [s.strip() for s in _SENTENCE.findall(flat) if 8 <= len(s.split()) <= 40]


def build_lastword(text: str, n: int, seed: int) -> list[dict]:
    """LAMBADA-style cloze: a sentence (after the one before it) with its last word held out."""
    sents = sentences(text)
    rng = random.Random(seed)
    items = []
    for i in sorted(rng.sample(range(1, len(sents)), min(n, len(sents) - 1))):
        words = sents[i].rstrip(".!?").split()
        last = re.sub(r"[^\w'-]", "", words[-1])
        if not last:
            continue
        items.append({"context": sents[i - 1] + " " + " ".join(words[:-1]), "target": " " + last})
    return items


def build_next_sentence(text: str, n: int, seed: int, n_choices: int = 4) -> list[dict]:
    """Multiple choice: which sentence really comes next (the others are drawn from elsewhere)."""
    sents = sentences(text)
    rng = random.Random(seed)
    items = []
    for i in sorted(rng.sample(range(len(sents) - 1), min(n, len(sents) - 1))):
        wrong = rng.sample([s for j, s in enumerate(sents) if abs(j - i - 1) > 3], n_choices - 1)
        gold = rng.randrange(n_choices)
        choices = wrong[:gold] + [sents[i + 1]] + wrong[gold:]
        items.append({"context": sents[i], "choices": [" " + c for c in choices], "gold": gold})
    return items


def shipped_task_records() -> dict[str, list[dict]]:
    """The built-in tasks exactly as shipped in corpus/tasks/ (a test regenerates and compares)."""
    root = Path(str(resources.files("flopwise") / "corpus" / "eval"))
    alice = (root / "alice29.txt").read_text(encoding="utf-8")
    wiki = (root / "enwiki-105-articles.txt").read_text(encoding="utf-8")
    return {"alice-lastword": build_lastword(alice, 200, seed=1),
            "enwiki-lastword": build_lastword(wiki, 200, seed=2),
            "alice-nextsent": build_next_sentence(alice, 200, seed=3)}


def write_shipped_tasks(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, records in shipped_task_records().items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":  # python -m flopwise.eval.tasks: rebuild the shipped task files
    write_shipped_tasks(Path(str(resources.files("flopwise") / "corpus" / "tasks")))
