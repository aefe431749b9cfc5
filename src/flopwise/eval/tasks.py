"""Zero- and few-shot evaluation scored by log-likelihood, as GPT-3 and lm-evaluation-harness do.

Task files (flopwise.data.tasks): multiple choice or cloze, one example per JSONL line.
Multiple choice: each choice is scored by the summed log-probability of its tokens given the
context; `acc` takes the best sum, `acc_norm` the best sum per byte of the choice (the harness's
length normalisation); `ppl` is over the gold continuations. Cloze (LAMBADA-style): `acc` counts
targets that greedy decoding reproduces token for token; `ppl` is over the target tokens.
Context and continuation are tokenized separately and concatenated, so the continuation's tokens do
not depend on the context. k-shot prompts prepend k other examples (seeded) with their answers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection

import torch

from flopwise.data.tasks import Example
from flopwise.data.tokenizer import guarded
from flopwise.errors import DataError

_SHOT_SEPARATOR = "\n\n"


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
        demo = _SHOT_SEPARATOR.join(examples[j].context + examples[j].answer for j in pool)
        contexts.append(demo + _SHOT_SEPARATOR + e.context)
    return contexts


@torch.no_grad()
def score(
    model, requests: list[tuple[list[int], list[int]]], batch: int = 16, progress: Callable[[int], None] | None = None
) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), greedy reproduces it) for each (context, continuation)."""
    model.eval()
    device = model.tok_embeddings.weight.device
    limit = model.cfg.max_seq_len + 1
    out: dict[int, tuple[float, bool]] = {}
    order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][0]) + len(requests[i][1])))
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        seqs = []
        for i in idx:
            ctx, cont = requests[i]
            if not cont:
                raise DataError("a continuation tokenized to no tokens")
            seqs.append((ctx + cont)[-limit:])  # keep the continuation, cut the context from the left
        width = max(len(s) for s in seqs) - 1
        x = torch.zeros(len(seqs), width, dtype=torch.long)
        for r, s in enumerate(seqs):
            x[r, : len(s) - 1] = torch.tensor(s[:-1])
        logprobs = model(x.to(device)).float().log_softmax(-1).cpu()
        for r, (i, s) in enumerate(zip(idx, seqs, strict=True)):
            n = len(requests[i][1])
            pos = torch.arange(len(s) - 1 - n, len(s) - 1)
            target = torch.tensor(s[-n:])
            lp = logprobs[r, pos]
            out[i] = (float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
        if progress:
            progress(len(idx))
    return [out[i] for i in range(len(requests))]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of a context and its continuation, split as lm-evaluation-harness splits them for
    a causal model: the context's trailing whitespace moves to the continuation, the joined text is
    encoded whole and cut after the context's tokens, so BPE pre-tokens at the boundary are those
    of the joined text. flopwise eval, the `flopwise` lm-eval model and lm-eval's `hf` model on an
    exported folder then score the same token sequences."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    ctx = tokenizer.encode(context).ids
    return ctx, tokenizer.encode(context + continuation).ids[len(ctx) :]


def evaluate_task(
    model,
    tokenizer,
    name: str,
    examples: list[Example],
    shots: int = 0,
    seed: int = 0,
    batch: int = 16,
    limit: int | None = None,
    progress=None,
    clean: Collection[int] | None = None,
) -> dict:
    """Scores of a task; with `clean` (indices of uncontaminated examples) also the clean subset's
    `clean_n`, `clean_acc`, `clean_acc_norm`, from the same per-example results (GPT-3, Llama 2)."""
    tokenizer = guarded(tokenizer)  # a panic of the tokenizers library is a one-line DataError
    examples = examples[:limit] if limit else examples
    contexts = with_shots(examples, shots, seed)
    requests, owners = [], []
    for k, (e, ctx) in enumerate(zip(examples, contexts, strict=True)):
        for j, cont in enumerate(e.choices or (e.answer,)):
            requests.append(encode_pair(tokenizer, ctx, cont))
            owners.append((k, j))
    scores = score(model, requests, batch, progress)
    per_example: dict[int, list] = {}
    for (k, j), s, (_, cont_ids) in zip(owners, scores, requests, strict=True):
        per_example.setdefault(k, []).append((j, s, len(cont_ids)))
    # per example: (correct, correct by acc_norm, gold NLL, gold tokens, Brier score)
    outcomes: list[tuple[bool, bool | None, float, int, float | None]] = []
    for k, e in enumerate(examples):
        rows = per_example[k]
        if choices := e.choices:
            best = max(rows, key=lambda r: r[1][0])[0]
            best_norm = max(rows, key=lambda r: r[1][0] / max(1, len(choices[r[0]].encode())))[0]
            gold = next(r for r in rows if r[0] == e.gold)
            # Brier score of the choice distribution (softmax of the summed log-probabilities)
            probs = torch.tensor([r[1][0] for r in sorted(rows)], dtype=torch.float64).softmax(0)
            brier = float(((probs - torch.nn.functional.one_hot(torch.tensor(e.gold), len(rows))) ** 2).sum())
            outcomes.append((best == e.gold, best_norm == e.gold, -gold[1][0], gold[2], brier))
        else:
            ((_, (lp, greedy), n),) = rows
            outcomes.append((greedy, None, -lp, n, None))
    is_mc = examples[0].choices is not None
    result = {"task": name, **_summary(outcomes, is_mc), "shots": shots}
    if clean is not None:
        kept = [o for k, o in enumerate(outcomes) if k in clean]
        sub = _summary(kept, is_mc) if kept else {"acc": None, "acc_norm": None}
        result.update(clean_n=len(kept), clean_acc=sub["acc"], clean_acc_norm=sub["acc_norm"])
    return result


def _summary(outcomes: list[tuple], is_mc: bool) -> dict:
    n = len(outcomes)
    nll = sum(o[2] for o in outcomes)
    ntok = sum(o[3] for o in outcomes)
    # nll: the correct answer's negative log-likelihood per example (Llama 3's continuous task metric)
    return {
        "n": n,
        "acc": sum(o[0] for o in outcomes) / n,
        "acc_norm": sum(o[1] for o in outcomes) / n if is_mc else None,
        "ppl": math.exp(nll / ntok),
        "nll": nll / n,
        "brier": sum(o[4] for o in outcomes) / n if is_mc else None,
    }


# --- building the shipped tasks from held-out text ---------------------------------------------
