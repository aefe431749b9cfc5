"""Stateful, resumable loader of packed fixed-length sequences.

A split is one token stream (documents joined by EOS) cut into non-overlapping windows of
seq_len + 1 tokens (inputs and shifted targets). Epoch e visits the windows in the order of a
permutation seeded by (seed, e). The position (epoch, cursor) counts *global* sequences, so it is
the same on every rank: each data-parallel rank takes its own contiguous slice of every global
batch, and a run resumed with a different dp degree continues the same stream with no sequence
seen twice or skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from flopwise.data.shards import open_split, read_index
from flopwise.errors import DataError


class TokenLoader:
    def __init__(self, data_dir: str | Path, split: str, seq_len: int, global_batch: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1):
        if global_batch % dp_size:
            raise DataError(f"train.global_batch={global_batch} is not divisible by the data-parallel size {dp_size}")
        self.tokens = open_split(data_dir, split)
        self.index_documents = read_index(data_dir)["splits"][split].get("documents", [])
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.n_windows = (len(self.tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"data split {split!r} of {data_dir}: {len(self.tokens)} tokens, too few for one "
                            f"sequence of data.seq_len={seq_len}")
        self.epoch, self.cursor = 0, 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def _take_global(self) -> np.ndarray:
        """The window ids of the next global batch; advances the position."""
        ids = []
        while len(ids) < self.global_batch:
            order = self._order(self.epoch)
            n = min(self.global_batch - len(ids), self.n_windows - self.cursor)
            ids.extend(order[self.cursor:self.cursor + n])
            self.cursor += n
            if self.cursor == self.n_windows:
                self.epoch, self.cursor = self.epoch + 1, 0
        return np.asarray(ids, dtype=np.int64)

    def windows(self, ids: np.ndarray) -> torch.Tensor:
        rows = [np.asarray(self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1], dtype=np.int64) for i in ids]
        return torch.from_numpy(np.stack(rows))

    def next_batch(self) -> torch.Tensor:
        """This rank's share of the next global batch: (global_batch / dp_size, seq_len + 1) int64."""
        ids = self._take_global()
        local = self.global_batch // self.dp_size
        return self.windows(ids[self.dp_rank * local:(self.dp_rank + 1) * local])

    def skip(self, n_batches: int) -> np.ndarray:
        """Advance past `n_batches` global batches without reading them; their window ids."""
        return np.concatenate([self._take_global() for _ in range(n_batches)]) if n_batches else np.empty(0, np.int64)

    def documents(self, ids: np.ndarray) -> list[int]:
        """Indices (in the split's index.json order) of the documents the given windows touch."""
        starts = np.asarray([d[0] for d in self.index_documents], dtype=np.int64)
        if not len(starts) or not len(ids):
            return []
        first = np.searchsorted(starts, ids * self.seq_len, side="right") - 1
        last = np.searchsorted(starts, (ids + 1) * self.seq_len, side="right") - 1
        return sorted({int(d) for a, b in zip(first, last) for d in range(max(a, 0), b + 1)})

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "seq_len": self.seq_len,
                "n_windows": self.n_windows}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_len", "n_windows"):
            if state.get(key) != getattr(self, key):
                raise DataError(f"loader state: checkpoint has {key}={state.get(key)} but this run has "
                                f"{getattr(self, key)}; resume with the same data and data.seq_len")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def eval_batches(data_dir, seq_len: int, batch: int, n_batches: int, split: str = "val") -> Iterator[torch.Tensor]:
    """A fixed set of evaluation batches: the first windows of the split, in order."""
    tokens = open_split(data_dir, split)
    n_windows = (len(tokens) - 1) // seq_len
    if n_windows < 1:
        raise DataError(f"data split {split!r}: too few tokens for one sequence of {seq_len}")
    for b in range(min(n_batches, max(1, n_windows // batch))):
        ids = range(b * batch, min((b + 1) * batch, n_windows))
        yield torch.from_numpy(np.stack([np.asarray(tokens[i * seq_len:(i + 1) * seq_len + 1], dtype=np.int64)
                                         for i in ids]))
