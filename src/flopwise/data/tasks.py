"""Evaluation task files: the format, the built-in tasks shipped in corpus/tasks/, and how those
were built from the embedded corpora (`python -m flopwise.data.tasks` rebuilds them; a test
regenerates and compares). Scoring lives in flopwise.eval.tasks.

Task files are JSONL, one example per line:
  multiple choice  {"context": ..., "choices": [...], "gold": index}
  cloze            {"context": ..., "target": ...}
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from flopwise.config.schema import load_config
from flopwise.data.shards import iter_documents, val_documents
from flopwise.errors import DataError


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...] | None = None
    gold: int | None = None
    target: str | None = None

    @property
    def answer(self) -> str:
        if self.choices and self.gold is not None:
            return self.choices[self.gold]
        return self.target or ""


def builtin_tasks() -> dict[str, Path]:
    root = Path(str(resources.files("flopwise") / "corpus" / "tasks"))
    return {p.stem: p for p in sorted(root.glob("*.jsonl"))}


def load_task(spec: str) -> tuple[str, list[Example]]:
    """A built-in task name or a path to a JSONL task file."""
    known = builtin_tasks()
    path = known.get(spec, Path(spec))
    if not path.is_file():
        raise DataError(f"task {spec!r}: not a built-in task ({', '.join(known)}) nor a JSONL file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"task file {path}: not UTF-8 text (byte {e.start}); save it as UTF-8 JSONL") from None
    examples, first_line = [], 0
    for n, line in enumerate(text.splitlines(), 1):
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
            if not (
                isinstance(ch, list)
                and len(ch) >= 2
                and all(isinstance(c, str) for c in ch)
                and isinstance(gold, int)
                and 0 <= gold < len(ch)
            ):
                raise DataError(
                    f"task file {path}: line {n} needs 'choices' (2+ strings) and an integer 'gold' in range"
                )
            examples.append(Example(rec["context"], tuple(ch), gold))
        elif isinstance(rec.get("target"), str):
            examples.append(Example(rec["context"], target=rec["target"]))
        else:
            raise DataError(f"task file {path}: line {n} needs 'choices' + 'gold' or a string 'target'")
        first_line = first_line or n
        if (examples[-1].choices is None) != (examples[0].choices is None):  # one kind per task: one set of metrics
            kinds = ("multiple choice", "cloze") if examples[0].choices else ("cloze", "multiple choice")
            raise DataError(
                f"task file {path}: line {n} is {kinds[1]} but line {first_line} is {kinds[0]}; "
                f"a task is one kind: put the {kinds[1]} examples in a file of their own"
            )
    if not examples:
        raise DataError(f"task file {path}: no examples")
    return path.stem, examples


_SENTENCE = re.compile(r"[^.!?]+[.!?]")


def sentences(text: str) -> list[str]:
    flat = " ".join(text.split())
    return [s.strip() for s in _SENTENCE.findall(flat) if 8 <= len(s.split()) <= 40]


def _build_lastword(text: str, n: int, seed: int) -> list[dict]:
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


def _build_next_sentence(text: str, n: int, seed: int, n_choices: int = 4) -> list[dict]:
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


# In-domain tasks for the embedded corpus, from the plays the demo's train/val split holds out.

_SPEAKER = re.compile(r"^[A-Z][A-Z ,'&-]*[A-Z]\.$")


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker, verse lines) for each speech of a Gutenberg play: a block opened by 'NAME.'."""
    out = []
    for block in re.split(r"\n\s*\n", text.replace("\r", "")):
        lines = [ln.strip() for ln in block.strip().split("\n")]
        if len(lines) >= 2 and _SPEAKER.match(lines[0]):
            verse = [ln for ln in lines[1:] if ln and not ln.startswith("[")]
            if verse:
                out.append((lines[0][:-1], verse))
    return out


def heldout_plays() -> list[str]:
    """The Shakespeare documents in the val split of the embedded default (demo.toml's seed and fraction)."""
    cfg = load_config("demo")
    docs = list(iter_documents([cfg.data.path]))
    return [docs[i][1] for i in sorted(val_documents(len(docs), cfg.data.val_fraction, cfg.run.seed))]


def _build_line_cloze(plays: list[str], n: int, seed: int) -> list[dict]:
    """Cloze: a speech's speaker and first lines, and the last word of its last line held out."""
    pool = [
        (who, verse)
        for play in plays
        for who, verse in speeches(play)
        if len(verse[-1].split()) >= 4 and re.sub(r"[^\w'-]", "", verse[-1].split()[-1])
    ]
    items = []
    for who, verse in sorted(random.Random(seed).sample(pool, min(n, len(pool)))):
        words = verse[-1].split()
        last = re.sub(r"[^\w'-]", "", words[-1])
        items.append({"context": "\n".join([f"{who}.", *verse[-3:-1], " ".join(words[:-1])]), "target": " " + last})
    return items


def _build_next_line(plays: list[str], n: int, seed: int, n_choices: int = 4) -> list[dict]:
    """Multiple choice: the line that really follows within a speech, against lines of other speeches."""
    lines = [
        (k, who, verse, i)
        for k, (who, verse) in enumerate(sp for play in plays for sp in speeches(play))
        for i in range(len(verse) - 1)
    ]
    everyone = [verse[i] for _, _, verse, i in lines]
    rng = random.Random(seed)
    items = []
    for _k, who, verse, i in sorted(rng.sample(lines, min(n, len(lines)))):
        wrong = rng.sample([x for x in everyone if x != verse[i + 1]], n_choices - 1)
        gold = rng.randrange(n_choices)
        choices = wrong[:gold] + [verse[i + 1]] + wrong[gold:]
        items.append(
            {
                "context": f"{who}.\n" + "\n".join(verse[max(0, i - 1) : i + 1]),
                "choices": ["\n" + c for c in choices],
                "gold": gold,
            }
        )
    return items


def _build_speaker(plays: list[str], n: int, seed: int, n_choices: int = 4) -> list[dict]:
    """Multiple choice: who speaks next, given the two speeches before (choices: that play's speakers)."""
    rng = random.Random(seed)
    cases = []
    for play in plays:
        sp = speeches(play)
        names = sorted({who for who, _ in sp})
        cases += [(sp[i - 2 : i], sp[i][0], names) for i in range(2, len(sp)) if len(names) >= n_choices]
    items = []
    for before, who, names in rng.sample(cases, min(n, len(cases))):
        wrong = rng.sample([x for x in names if x != who], n_choices - 1)
        gold = rng.randrange(n_choices)
        choices = wrong[:gold] + [who] + wrong[gold:]
        context = "".join(f"{w}.\n" + "\n".join(v[-2:]) + "\n\n" for w, v in before)
        items.append({"context": context, "choices": [c + "." for c in choices], "gold": gold})
    return items


def shipped_task_records() -> dict[str, list[dict]]:
    """The built-in tasks exactly as shipped in corpus/tasks/ (a test regenerates and compares)."""
    root = Path(str(resources.files("flopwise") / "corpus" / "eval"))
    alice = (root / "alice29.txt").read_text(encoding="utf-8")
    wiki = (root / "enwiki-105-articles.txt").read_text(encoding="utf-8")
    plays = heldout_plays()
    return {
        "alice-lastword": _build_lastword(alice, 200, seed=1),
        "enwiki-lastword": _build_lastword(wiki, 200, seed=2),
        "alice-nextsent": _build_next_sentence(alice, 200, seed=3),
        "shakespeare-cloze": _build_line_cloze(plays, 300, seed=4),
        "shakespeare-nextline": _build_next_line(plays, 300, seed=5),
        "shakespeare-speaker": _build_speaker(plays, 300, seed=6),
    }


def _write_shipped_tasks(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, records in shipped_task_records().items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":  # python -m flopwise.data.tasks: rebuild the shipped task files
    _write_shipped_tasks(Path(str(resources.files("flopwise") / "corpus" / "tasks")))
