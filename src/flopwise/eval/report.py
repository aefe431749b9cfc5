"""`flopwise eval`: a checkpoint scored on a text file (loss per token, perplexity over windows of
a fixed length) or on tasks (log-likelihood accuracy, zero- or few-shot), the tasks' examples
optionally split into those with and without a 13-gram in the training data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from flopwise.data.shards import read_text
from flopwise.data.tasks import builtin_tasks, load_task
from flopwise.errors import ConfigError, DataError
from flopwise.eval.load import load_for_inference
from flopwise.eval.perplexity import text_loss
from flopwise.eval.tasks import evaluate_task

# progress(task name, calls to expect) -> advance(calls done)
Progress = Callable[[str, int], Callable[[int], object]]


@dataclass
class Evaluation:
    text: dict | None = None  # --text: loss, ppl, tokens, seq_len
    tasks: list[dict] = field(default_factory=list)  # --tasks: one row per task


def evaluate_checkpoint(
    ckpt: Path,
    text: Path | None = None,
    tasks: list[str] | None = None,
    shots: int = 0,
    seed: int = 0,
    limit: int | None = None,
    batch: int = 8,
    seq_len: int | None = None,
    clean_against: str | None = None,
    progress: Progress | None = None,
    report: Callable[[str], None] | None = None,
) -> Evaluation:
    """Score `ckpt` on `text` or on `tasks` (one of them); arguments and tasks are checked before
    the model loads. `report` hears which checkpoint of a run folder is used."""
    if (text is None) == (tasks is None):
        raise ConfigError(f"give one of --text FILE or --tasks NAMES (built-in: {', '.join(builtin_tasks())})")
    if text is not None and not text.is_file():
        raise DataError(f"--text {text}: no such file")
    if clean_against is not None and tasks is None:
        raise ConfigError("--clean-against needs --tasks: it splits task examples into clean and contaminated")
    loaded = [load_task(t) for t in tasks or []]
    clean: list[set[int] | None] = [None] * len(loaded)
    if clean_against is not None:
        from flopwise.data.contamination import measure_contamination

        dirty = measure_contamination(clean_against, loaded).contaminated
        clean = [set(range(len(ex))) - set(d) for (_, ex), d in zip(loaded, dirty, strict=True)]
    model, cfg, tok = load_for_inference(ckpt, report=report)
    if text is not None:
        if seq_len is not None and seq_len > cfg.model.max_seq_len:
            raise ConfigError(
                f"--seq-len {seq_len}: beyond the model's context (model.max_seq_len="
                f"{cfg.model.max_seq_len}); give at most that"
            )
        window = seq_len or cfg.model.max_seq_len
        return Evaluation(text={**text_loss(model, tok.encode(read_text(text)).ids, window, batch), "seq_len": window})
    results = []
    for (name, examples), keep in zip(loaded, clean, strict=True):
        n = min(limit or len(examples), len(examples))
        advance = progress(name, sum(len(e.choices or (1,)) for e in examples[:n])) if progress else None
        results.append(
            evaluate_task(model, tok, name, examples, shots, seed, batch, limit, progress=advance, clean=keep)
        )
    return Evaluation(tasks=results)
