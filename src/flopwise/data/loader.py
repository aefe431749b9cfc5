"""Stateful, resumable loader of packed fixed-length sequences from a weighted mixture of sources.

A source's split is one token stream (documents joined by EOS) cut into non-overlapping windows of
seq_len + 1 tokens (inputs and shifted targets). Epoch e of source i visits its windows in the
order of a permutation seeded by (seed, e, i). Global batch b draws the source of each of its
sequences from the mixture weights with a generator seeded by (seed, b), so the batch's make-up is
a function of the seed and the batch number only. Positions ((epoch, cursor) per source, and the
batch number) count *global* sequences, so they are the same on every rank: each data-parallel
rank takes its own contiguous slice of every global batch, and a run resumed with a different dp
degree continues the same stream with no sequence seen twice or skipped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from flopwise.data.mixture import Source
from flopwise.data.shards import open_split, read_index
from flopwise.errors import DataError

_MIX_KEY = 0x6D6978  # "mix": keeps the batch-composition stream apart from the window orders


class _WindowStream:
    """The windows of one source's split, in a seeded order per epoch."""

    def __init__(self, source: Source, index: int, split: str, seq_len: int, seed: int):
        self.source, self.seq_len = source, seq_len
        self.tokens = open_split(source.data_dir, split)
        self.index_documents = read_index(source.data_dir)["splits"][split].get("documents", [])
        self.n_windows = (len(self.tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(
                f"data split {split!r} of {source.data_dir}: {len(self.tokens)} tokens, too few for one "
                f"sequence of data.seq_len={seq_len}"
            )
        # the first source keeps the key a one-source loader always had, so its order is unchanged
        self.key = [seed] if index == 0 else [seed, index]
        self.epoch, self.cursor, self.taken = 0, 0, 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.key[0], epoch, *self.key[1:]]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def take(self, n: int) -> np.ndarray:
        """The next `n` window ids; advances the position."""
        ids: list[int] = []
        while len(ids) < n:
            order = self._order(self.epoch)
            k = min(n - len(ids), self.n_windows - self.cursor)
            ids.extend(order[self.cursor : self.cursor + k])
            self.cursor += k
            if self.cursor == self.n_windows:
                self.epoch, self.cursor = self.epoch + 1, 0
        self.taken += n
        return np.asarray(ids, dtype=np.int64)

    def rows(self, ids: Sequence[int]) -> list[np.ndarray]:
        s = self.seq_len
        return [np.asarray(self.tokens[i * s : (i + 1) * s + 1], dtype=np.int64) for i in ids]

    def documents(self, ids: np.ndarray) -> list[int]:
        """Indices (in the split's index.json order) of the documents the given windows touch."""
        starts = np.asarray([d[0] for d in self.index_documents], dtype=np.int64)
        if not len(starts) or not len(ids):
            return []
        first = np.searchsorted(starts, ids * self.seq_len, side="right") - 1
        last = np.searchsorted(starts, (ids + 1) * self.seq_len, side="right") - 1
        return sorted({int(d) for a, b in zip(first, last, strict=True) for d in range(max(a, 0), b + 1)})

    def state_dict(self) -> dict:
        return {
            "name": self.source.name,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "taken": self.taken,
            "n_windows": self.n_windows,
        }


class TokenLoader:
    """Global batches of windows drawn from `data` (one data folder, or weighted sources)."""

    def __init__(
        self,
        data: str | Path | Sequence[Source],
        split: str,
        seq_len: int,
        global_batch: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        if global_batch % dp_size:
            raise DataError(f"train.global_batch={global_batch} is not divisible by the data-parallel size {dp_size}")
        sources = [Source("data", Path(data))] if isinstance(data, (str, Path)) else list(data)
        self.streams = [_WindowStream(s, i, split, seq_len, seed) for i, s in enumerate(sources)]
        weights = np.asarray([s.weight for s in sources], dtype=np.float64)
        self.weights = weights / weights.sum()
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.batches = 0

    @property
    def names(self) -> list[str]:
        return [s.source.name for s in self.streams]

    def composition(self, batch: int) -> np.ndarray:
        """The source of each sequence of global batch `batch` (a function of seed and batch only)."""
        if len(self.streams) == 1:
            return np.zeros(self.global_batch, dtype=np.int64)
        return np.random.default_rng([self.seed, _MIX_KEY, batch]).choice(
            len(self.streams), self.global_batch, p=self.weights
        )

    def _take_global(self) -> np.ndarray:
        """(source, window) of each sequence of the next global batch; advances the position."""
        which = self.composition(self.batches)
        self.batches += 1
        ids = np.empty(self.global_batch, dtype=np.int64)
        for s, stream in enumerate(self.streams):
            slots = np.flatnonzero(which == s)
            ids[slots] = stream.take(len(slots))
        return np.stack([which, ids], axis=1)

    def next_batch(self) -> torch.Tensor:
        """This rank's share of the next global batch: (global_batch / dp_size, seq_len + 1) int64."""
        pairs = self._take_global()
        local = self.global_batch // self.dp_size
        mine = pairs[self.dp_rank * local : (self.dp_rank + 1) * local]
        return torch.from_numpy(np.stack([self.streams[s].rows([i])[0] for s, i in mine]))

    def skip(self, n_batches: int) -> np.ndarray:
        """Advance past `n_batches` global batches without reading them; their (source, window) pairs."""
        return (
            np.concatenate([self._take_global() for _ in range(n_batches)]) if n_batches else np.empty((0, 2), np.int64)
        )

    def by_source(self, pairs: np.ndarray) -> dict[str, np.ndarray]:
        return {st.source.name: pairs[pairs[:, 0] == s, 1] for s, st in enumerate(self.streams)}

    def documents(self, pairs: np.ndarray) -> dict[str, list[int]]:
        """Per source, the documents the given (source, window) pairs touch."""
        return {name: self.streams[s].documents(ids) for s, (name, ids) in enumerate(self.by_source(pairs).items())}

    def tokens_by_source(self) -> dict[str, int]:
        """Training tokens drawn from each source so far (every rank's, seq_len per sequence)."""
        return {st.source.name: st.taken * self.seq_len for st in self.streams}

    def epochs_by_source(self) -> dict[str, float]:
        return {st.source.name: st.taken / st.n_windows for st in self.streams}

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "seq_len": self.seq_len,
            "batches": self.batches,
            "sources": [st.state_dict() for st in self.streams],
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_len"):
            if state.get(key) != getattr(self, key):
                raise DataError(
                    f"loader state: checkpoint has {key}={state.get(key)} but this run has "
                    f"{getattr(self, key)}; resume with the same data and data.seq_len"
                )
        saved = state.get("sources", [])
        if [s["name"] for s in saved] != self.names and not (len(saved) == len(self.names) == 1):
            raise DataError(
                f"loader state: checkpoint's data sources are {[s['name'] for s in saved]} but this run's "
                f"are {self.names}; resume with the same data.sources (names and order)"
            )
        for st, s in zip(self.streams, saved, strict=True):
            if s["n_windows"] != st.n_windows:
                raise DataError(
                    f"loader state: source {st.source.name!r} had {s['n_windows']} windows in the "
                    f"checkpoint but has {st.n_windows} here; resume with the same data and data.seq_len"
                )
            st.epoch, st.cursor, st.taken = int(s["epoch"]), int(s["cursor"]), int(s["taken"])
        self.batches = int(state["batches"])


def eval_batches(data_dir, seq_len: int, batch: int, n_batches: int, split: str = "val") -> Iterator[torch.Tensor]:
    """A fixed set of evaluation batches: the first windows of the split, in order."""
    tokens = open_split(data_dir, split)
    n_windows = (len(tokens) - 1) // seq_len
    if n_windows < 1:
        raise DataError(f"data split {split!r}: too few tokens for one sequence of {seq_len}")
    for b in range(min(n_batches, max(1, n_windows // batch))):
        ids = range(b * batch, min((b + 1) * batch, n_windows))
        yield torch.from_numpy(
            np.stack([np.asarray(tokens[i * seq_len : (i + 1) * seq_len + 1], dtype=np.int64) for i in ids])
        )
