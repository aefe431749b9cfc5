"""Mean loss per token and perplexity of a model on a text file."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flopwise.errors import DataError
from flopwise.model.transformer import Transformer


@torch.no_grad()
def text_loss(
    model: Transformer, token_ids: list[int], seq_len: int, batch: int = 8, autocast_dtype: torch.dtype | None = None
) -> dict:
    """Non-overlapping windows of seq_len + 1 tokens; every token after the first of each window is
    scored given the window's preceding tokens. Returns loss (nats/token), ppl, tokens scored."""
    model.eval()
    device = model.tok_embeddings.weight.device
    ids = torch.tensor(token_ids, dtype=torch.long)
    if len(ids) < 2:
        raise DataError("text too short to score: it tokenizes to fewer than 2 tokens")
    starts = range(0, len(ids) - 1, seq_len)
    windows = [ids[s : s + seq_len + 1] for s in starts]  # the last one may be shorter
    full = [w for w in windows if len(w) == seq_len + 1]
    batches = [full[b : b + batch] for b in range(0, len(full), batch)]
    batches += [[w] for w in windows if len(w) < seq_len + 1]
    total, count = 0.0, 0
    for chunk in batches:
        x = torch.stack(chunk).to(device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    mean = total / count
    return {"loss": mean, "ppl": math.exp(mean), "tokens": count}
