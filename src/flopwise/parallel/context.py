"""Context parallelism as Llama 3 did it (Dubey et al. 2024 §3.3.2), hand-written.

Why not torch's `context_parallel`: in this torch it has no CPU sharding strategy for the SDPA op and
FlexAttention has no CPU backward, so it cannot run on gloo; this needs only an all-gather.

Each sequence is cut into 2·cp chunks and rank r keeps chunks r and 2·cp−1−r (head-tail pairing:
every rank gets the same amount of causal work). In every attention layer the local K and V are
all-gathered across the cp group by an autograd-aware collective (its backward reduce-scatters the
K/V gradients), and the local queries attend with a mask built from their true positions.

One object per rank, the engine's (flopwise.train.engine), does both halves, once per batch: it
shards the batch (`shard`) and hands the model its `span` (positions and the K/V gather). The model
holds nothing of it; no module is changed (cp ranks hold the same weights, and join the
data-parallel reduction: flopwise.parallel.data).
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import all_gather_tensor_autograd

from flopwise.model.layers import Span


class ContextParallel:
    def __init__(self, rank: int, size: int, group):
        self.rank, self.size, self.group = rank, size, group

    def chunk_ids(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.size - 1 - rank

    def positions(self, seq: int, rank: int | None = None) -> torch.Tensor:
        """Absolute positions of `rank`'s tokens in a sequence of `seq` tokens."""
        c = seq // (2 * self.size)
        return torch.cat(
            [torch.arange(i * c, (i + 1) * c) for i in self.chunk_ids(self.rank if rank is None else rank)]
        )

    def key_positions(self, seq: int) -> torch.Tensor:
        """Positions of the all-gathered keys, in gather order (rank 0's chunks, rank 1's, ...)."""
        return torch.cat([self.positions(seq, r) for r in range(self.size)])

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of full-length sequences (inputs or targets)."""
        return x.index_select(dim, self.positions(x.shape[dim]).to(x.device))

    def span(self, seq: int, device: torch.device | str | None = None) -> Span:
        """What the model needs to compute this rank's tokens of `seq`-token sequences: their
        positions, the all-gathered keys' positions, and the gather."""
        return Span(self.positions(seq).to(device), self.key_positions(seq).to(device), self.gather)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(b, h, t_local, d) keys or values -> (b, h, t, d) from all cp ranks."""
        return all_gather_tensor_autograd(x.contiguous(), gather_dim=2, group=self.group)
