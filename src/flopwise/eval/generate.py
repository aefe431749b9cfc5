"""Sampling with a KV cache (or by full recomputation, the reference the cache is tested against)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from flopwise.checkpoints.checkpoint import resolve
from flopwise.data.tokenizer import special_ids
from flopwise.errors import DataError
from flopwise.eval.load import load_for_inference
from flopwise.model.layers import KVCache
from flopwise.model.transformer import Transformer


def _sample_next(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, gen: torch.Generator | None
) -> torch.Tensor:
    """logits (b, vocab) -> next ids (b,). temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(-1)


def room(max_seq_len: int, n_prompt: int) -> int:
    """New tokens that fit after a prompt of `n_prompt` tokens: prompt and output together fill at
    most max_seq_len (transformers' `max_length` convention; positions past it do not exist here)."""
    if n_prompt == 0:
        raise DataError("the prompt is empty (0 tokens): give generation some text to continue")
    if n_prompt >= max_seq_len:
        raise DataError(
            f"the prompt is {n_prompt} tokens but the model's context, max_seq_len={max_seq_len}, holds "
            f"prompt and output together: shorten the prompt to at most {max_seq_len - 1} tokens"
        )
    return max_seq_len - n_prompt


@torch.no_grad()
def generate_tokens(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    stop_id: int | None = None,
) -> list[int]:
    """Continue `prompt`; stops at max_new_tokens, at `stop_id`, or when prompt and output fill the
    model's max_seq_len (`room`), with or without the cache.

    A prompt that leaves no room is an error, not cut to its last tokens: transformers' `generate`
    never drops prompt tokens either (truncation is the tokenizer's opt-in) and only warns past the
    model's length, and a silently shortened prompt conditions the output on less than the user
    wrote. Callers that want lm-eval's left cut (the harness) make it before calling."""
    model.eval()
    device = model.tok_embeddings.weight.device
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    ids = list(prompt)
    n_new = min(max_new_tokens, room(model.cfg.max_seq_len, len(ids)))
    cache = KVCache(model.cfg, 1, len(ids) + n_new, device, model.tok_embeddings.weight.dtype) if use_cache else None
    step_input = torch.tensor([ids], device=device)
    out: list[int] = []
    for _ in range(n_new):
        if cache is not None:
            logits = model(step_input, cache, last_only=True)[:, -1]
        else:
            logits = model(torch.tensor([ids + out], device=device), last_only=True)[:, -1]
        nxt = int(_sample_next(logits, temperature, top_k, top_p, gen))
        out.append(nxt)
        if nxt == stop_id:
            break
        step_input = torch.tensor([[nxt]], device=device)
    return out


@dataclass(frozen=True)
class Completion:
    text: str  # the prompt and its continuation
    prompt_tokens: int
    new_tokens: int
    max_seq_len: int
    at_context_limit: bool  # stopped short of max_new_tokens because the model's context is full


def complete(
    ckpt: str | Path,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    report: Callable[[str], None] | None = None,
) -> Completion:
    """`flopwise generate`: a checkpoint (or a run's newest) continues `prompt` until its own end
    token, `max_new_tokens` or its context limit. `report` hears which checkpoint is used."""
    model, cfg, tok = load_for_inference(ckpt, report=report)
    ids = tok.encode(prompt).ids
    stop_id = special_ids(tok, resolve(ckpt))["eos"]
    out = generate_tokens(model, ids, max_new_tokens, temperature, top_k, top_p, seed, use_cache, stop_id)
    full = len(out) < max_new_tokens and len(ids) + len(out) == cfg.model.max_seq_len
    return Completion(tok.decode(ids + out), len(ids), len(out), cfg.model.max_seq_len, full)
