"""What a weighted mixture holds and what a planned run will draw from it.

One place reads a mixture's token counts (the train split of each prepared source); `flopwise data
mix`, the training loader's epoch accounting and `scale optimal --unique-tokens` all use them. The
effective value of repeated tokens follows Muennighoff et al. 2023 (`plan.scaling.effective_tokens`),
applied per source: a source seen for e epochs is worth its unique tokens plus a discounted share
of the repeats, and the mixture is worth the sum.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from flopwise.data.shards import data_fingerprint, read_index
from flopwise.errors import DataError
from flopwise.scale.laws import effective_tokens

EPOCH_WARNING = 4.0  # Muennighoff et al. 2023: up to ~4 epochs of repeats are almost as good as new data


@dataclass(frozen=True)
class Source:
    """One prepared data folder and its share of the sampled sequences."""

    name: str
    data_dir: Path
    weight: float = 1.0


def prepared_sources(cfg) -> list[Source] | None:
    """The config's sources when every one is a prepared folder (raw inputs are counted only once
    `flopwise data mix` or a run has prepared them); else None."""
    dirs = [Path(s.path) for s in cfg.data.mixture]
    if not all((d / "index.json").is_file() for d in dirs):
        return None
    return [Source(s.label, d, s.weight) for s, d in zip(cfg.data.mixture, dirs, strict=True)]


@dataclass(frozen=True)
class SourceDraw:
    """One source of a mixture and what `tokens` training tokens take from it."""

    name: str
    share: float  # normalised weight
    unique_tokens: int  # its train split
    documents: int
    drawn_tokens: float  # share · planned tokens
    epochs: float
    effective_tokens: float

    @property
    def over_repeated(self) -> bool:
        return self.epochs > EPOCH_WARNING


def draws(sources: list[Source], tokens: float) -> list[SourceDraw]:
    """Per source: unique train tokens, and the epochs and effective tokens of `tokens` drawn by weight."""
    total = sum(s.weight for s in sources)
    out = []
    for s in sources:
        train = read_index(s.data_dir)["splits"]["train"]
        unique = int(train["tokens"])
        if unique < 1:
            raise DataError(f"data source {s.name!r} ({s.data_dir}): its train split is empty")
        drawn = tokens * s.weight / total
        out.append(
            SourceDraw(
                s.name,
                s.weight / total,
                unique,
                len(train.get("documents", [])),
                drawn,
                drawn / unique,
                effective_tokens(drawn, unique),
            )
        )
    return out


def unique_tokens(sources: list[Source]) -> int:
    """The mixture's unique train tokens (what `scale optimal --unique-tokens DIR` reads)."""
    return sum(d.unique_tokens for d in draws(sources, 0.0))


def parse_unique_tokens(spec: str) -> float:
    """`--unique-tokens`: a number, or prepared data dirs (comma-separated) whose train tokens count."""
    try:
        return float(spec)
    except ValueError:
        pass
    dirs = [Path(p) for p in spec.split(",") if p]
    for d in dirs:
        if not (d / "index.json").is_file():
            raise DataError(f"--unique-tokens {spec}: {d} is neither a number nor a prepared data dir (index.json)")
    return float(unique_tokens([Source(d.name, d) for d in dirs]))


def check_tokenizers(sources: list[Source]) -> None:
    """Every source must be tokenized alike: token ids mean nothing across tokenizers."""
    first = None
    for s in sources:
        name = read_index(s.data_dir).get("tokenizer")
        path = s.data_dir / name if isinstance(name, str) and Path(name).name == name else None
        if path is None or not path.is_file():
            raise DataError(f"data source {s.name!r} ({s.data_dir}): no tokenizer file; re-run data prepare")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if first is None:
            first = (s, digest)
        elif digest != first[1]:
            raise DataError(
                f"data source {s.name!r} ({s.data_dir}) was tokenized differently from "
                f"{first[0].name!r}; prepare every source with the same --tokenizer"
            )


def mixture_fingerprint(sources: list[Source]) -> str:
    """What identifies the mixture's data (not its weights, which a resumed run may change): one
    source's index digest as before, or a digest over every (name, digest)."""
    if len(sources) == 1:
        return data_fingerprint(sources[0].data_dir)
    joined = "\n".join(f"{s.name}={data_fingerprint(s.data_dir)}" for s in sources)
    return hashlib.sha256(joined.encode()).hexdigest()


def mixture_of(cfg) -> Callable[[float], list[SourceDraw]] | None:
    """What a planned run of `tokens` draws from each source, when every source is prepared: the
    planner reads no data, so `flopwise plan` hands it this."""
    sources = prepared_sources(cfg)
    return partial(draws, sources) if sources else None
