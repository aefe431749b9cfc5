"""Byte-level BPE through Hugging Face `tokenizers`: trained on the corpus or loaded from a file.

Every tokenizer flopwise hands out is a `GuardedTokenizer`: the library's own `Tokenizer` whose
every call turns a panic inside the Rust code (pyo3's `PanicException` derives from
BaseException, so `except Exception` misses it and the user got a traceback) or one of the
library's bare `Exception`s into a one-line DataError naming the file and the call. A loaded file
is also made safe for token shards, which need whole documents:

- a `truncation` block (a normal Hugging Face field, e.g. max_length 512) would keep only the
  first max_length tokens of every document, and a `padding` block would add pad tokens to every
  one. Both are switched off, with a warning that names the field, rather than refused: the file
  is otherwise sound (often a model's own), flopwise cuts training windows from the token stream
  itself, and the copy saved with the data (and every checkpoint) no longer carries the block.
  A malformed truncation block (stride >= max_length, on which the library panics) is refused.
- `load_tokenizer` round-trips a probe string (encode, encode_batch, decode) so a file whose
  decoder or pipeline panics (e.g. a `Strip` decoder on a lone-space token) is refused at load,
  before anything is written; a panic on text the probe did not reach is still a DataError.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from flopwise.config.hf_mapping import check_inside
from flopwise.errors import DataError

EOS = "<|endoftext|>"
_MIN_VOCAB = 257  # 256 byte symbols + EOS
_MAX_VOCAB = 2**20  # 4x the largest published vocabulary (Gemma's 262,144)
# what a corpus may hold: words, punctuation, doubled spaces, tab, newline, digits, accents, CJK, emoji
_PROBE_TEXT = "Hello, world!  Two  spaces,\ttab\nnew line; 0123456789 café naïve 中文 🙂 end "


def _library_error(e: BaseException) -> bool:
    """A panic inside the Rust library (pyo3_runtime.PanicException, a BaseException) or one of its
    errors (raised as a bare Exception); not a KeyboardInterrupt, nor a bug of the caller's."""
    return type(e).__name__ == "PanicException" or type(e) is Exception


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:160] or type(e).__name__


def _call(where: str, name: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except BaseException as e:
        if not _library_error(e):
            raise
        fix = "fix or replace the tokenizer.json" if where.endswith(".json") else "use a tokenizer.json (--tokenizer)"
        raise DataError(f"tokenizer {where}: the tokenizers library failed in {name} ({_one_line(e)}); {fix}") from None


class GuardedTokenizer:
    """A `tokenizers.Tokenizer` (`.raw`) whose every method (encode, encode_batch, decode,
    decode_batch, get_vocab_size, token_to_id, save, ...) raises a one-line DataError where the
    library would panic; attributes (truncation, padding, decoder, ...) read and set through."""

    __slots__ = ("raw", "where")

    def __init__(self, raw: Tokenizer, where: str | Path = "tokenizer"):
        object.__setattr__(self, "raw", raw)
        object.__setattr__(self, "where", str(where))

    def __getattr__(self, name: str):
        if name in GuardedTokenizer.__slots__:
            raise AttributeError(name)
        attr = getattr(self.raw, name)
        if not callable(attr):
            return attr
        return lambda *args, **kwargs: _call(self.where, name, attr, *args, **kwargs)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.raw, name, value)

    def __reduce__(self):
        return GuardedTokenizer, (self.raw, self.where)

    def __repr__(self) -> str:
        return f"GuardedTokenizer({self.where})"


def guarded(tok: Tokenizer | GuardedTokenizer, where: str | Path = "tokenizer") -> GuardedTokenizer:
    """`tok` with its calls guarded (as it is if it already is)."""
    return tok if isinstance(tok, GuardedTokenizer) else GuardedTokenizer(tok, where)


def _bpe_vocab(vocab_size: int) -> int:
    """A vocab size a BPE can be trained to: at least the 256 bytes + EOS, at most MAX_VOCAB (the
    trainer allocates per entry up front: 1e10 was a Rust abort, 'memory allocation of 566 GB failed')."""
    if not _MIN_VOCAB <= vocab_size <= _MAX_VOCAB:
        raise DataError(
            f"tokenizer vocab {vocab_size}: a byte-level BPE needs {_MIN_VOCAB} (256 bytes + EOS) to "
            f"{_MAX_VOCAB:,} entries (the largest published vocabularies are ~256k); use e.g. bpe:4096"
        )
    return vocab_size


def train_bpe(texts: Iterable[str], vocab_size: int) -> GuardedTokenizer:
    _bpe_vocab(vocab_size)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok = guarded(bpe, f"bpe:{vocab_size}")
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> GuardedTokenizer:
    """A tokenizer.json (or a Hugging Face folder holding one), checked: loaded, truncation and
    padding switched off (warned), a probe string encoded and decoded, an end-of-text token found.
    Raises only DataError for a bad file (this is the one call a fuzzer of tokenizer files needs)."""
    p = Path(path)
    if p.is_dir():
        check_inside(p)
        if not (p / "tokenizer.json").is_file():
            raise DataError(
                f"tokenizer {p}: a folder without a tokenizer.json (give a Hugging Face model folder "
                "that has one, a tokenizer.json, or bpe:VOCAB to train one)"
            )
        p = p / "tokenizer.json"
    if not p.is_file():
        raise DataError(
            f"tokenizer {p}: not found (give a tokenizer.json, a Hugging Face folder holding one, or "
            "bpe:VOCAB to train one)"
        )
    _check_bpe_prefix(p)
    try:
        raw = Tokenizer.from_file(str(p))
    except BaseException as e:  # tokenizers raises a bare Exception on malformed JSON, or panics
        if not (isinstance(e, Exception) or _library_error(e)):
            raise
        raise DataError(f"tokenizer {p}: not a Hugging Face tokenizer.json ({_one_line(e)})") from None
    tok = guarded(raw, p)
    _whole_documents(tok, p)
    _probe(tok)
    _dense_ids(tok, p)
    eos_id(tok, p)
    return tok


def _dense_ids(tok: GuardedTokenizer, p: Path) -> None:
    """Every token id below the vocab size: shards, token counts and the embedding have that many
    rows (an id beyond was an IndexError or overflow in the tokenize stage, or in training)."""
    size = tok.get_vocab_size()
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= size:
        raise DataError(
            f"tokenizer {p}: token id {top} is beyond its vocabulary of {size} entries (ids must run "
            f"0..{size - 1}); fix the ids in the file or train a new tokenizer"
        )


def _whole_documents(tok: GuardedTokenizer, p: Path) -> None:
    """Switch off the file's truncation and padding (each with a warning naming it): token shards
    need every document whole, and nothing else. A malformed truncation block is refused."""
    trunc = tok.truncation
    if trunc is not None:
        stride, max_length = trunc.get("stride", 0), trunc.get("max_length", 0)
        if stride >= max_length:
            raise DataError(
                f"tokenizer {p}: truncation.stride={stride} must be below truncation.max_length="
                f"{max_length} (the tokenizers library panics on it); remove the truncation block"
            )
        tok.no_truncation()
        warnings.warn(
            f"tokenizer {p}: its truncation block (max_length {max_length}) is switched off: flopwise "
            "tokenizes whole documents (it would keep only their first tokens)",
            stacklevel=3,
        )
    if tok.padding is not None:
        tok.no_padding()
        warnings.warn(
            f"tokenizer {p}: its padding block is switched off: flopwise tokenizes whole documents "
            "(it would add pad tokens to them)",
            stacklevel=3,
        )


def _probe(tok: GuardedTokenizer) -> None:
    """Encode and decode PROBE_TEXT as every reader will: a panic is a DataError now, at load. Its
    message goes to a silenced stderr, so the user sees the DataError's one line."""
    with _quiet_stderr():
        ids = tok.encode(_PROBE_TEXT).ids
        tok.encode_batch([_PROBE_TEXT, ""], add_special_tokens=False)
        tok.decode(ids)
        tok.decode_batch([ids])
        tok.get_vocab_size()


@contextmanager
def _quiet_stderr():
    """fd 2 to /dev/null for a moment: the Rust panic hook prints its message (and a backtrace
    under RUST_BACKTRACE) there before pyo3 raises."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        saved = None
    if saved is not None:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        if saved is not None:
            os.dup2(saved, 2)
            os.close(saved)


def _check_bpe_prefix(p: Path) -> None:
    """Refuse a BPE whose merges do not carry its continuing_subword_prefix/end_of_word_suffix:
    `tokenizers` (0.23) cuts those strings by byte length and aborts the whole process on the
    invalid UTF-8 this makes, so no exception could be caught."""
    try:
        model = json.loads(p.read_text(encoding="utf-8")).get("model")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return  # not a JSON object: tokenizers' own error says so
    if not isinstance(model, dict) or model.get("type", "BPE") != "BPE":
        return
    prefix, suffix = model.get("continuing_subword_prefix"), model.get("end_of_word_suffix")
    merges = model.get("merges")
    for merge in merges if isinstance(merges, list) else []:
        parts = merge.split(" ", 1) if isinstance(merge, str) else merge
        if not (isinstance(parts, list) and len(parts) == 2 and all(isinstance(x, str) for x in parts)):
            return  # malformed: tokenizers refuses it with an error
        for field, affix, ok in (
            ("continuing_subword_prefix", prefix, parts[1].startswith),
            ("end_of_word_suffix", suffix, parts[0].endswith),
        ):
            if isinstance(affix, str) and affix and not ok(affix):
                raise DataError(
                    f"tokenizer {p}: model.{field}={affix!r} but merge {' '.join(parts)!r} lacks it; "
                    "fix the tokenizer.json (or set the field to null)"
                )


def eos_id(tok: Tokenizer | GuardedTokenizer, where: str | Path = "tokenizer") -> int:
    for name in (EOS, "</s>", "<|end_of_text|>", "<eos>"):
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise DataError(f"{where}: no end-of-text token ({EOS} or </s>) in the vocabulary; add one as a special token")


# The files beside tokenizer.json that make a model usable as its authors shipped it (special
# tokens, chat template, generation settings): copied into every checkpoint of a run started from
# a Hugging Face folder, and from there into its export, so none of them depends on that folder.
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


def side_files(folder: str | Path) -> dict[str, Path]:
    """name -> path of the SIDE_FILES present in `folder` (a handed folder: nothing outside it)."""
    check_inside(folder)
    return {name: Path(folder) / name for name in SIDE_FILES if (Path(folder) / name).is_file()}


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (ValueError, UnicodeDecodeError):
        raise DataError(f"{path}: not valid JSON; fix or remove it") from None
    return data if isinstance(data, dict) else {}


def special_ids(tok: Tokenizer | GuardedTokenizer, folder: str | Path) -> dict[str, int | None]:
    """{"bos": id, "eos": id} as the model's own files say (generation_config.json, then
    tokenizer_config.json's token strings), else the end-of-text token found by `eos_id` for both
    (what a flopwise-trained tokenizer has)."""
    gen, cfg = _json(Path(folder) / "generation_config.json"), _json(Path(folder) / "tokenizer_config.json")
    out: dict[str, int | None] = {}
    for key in ("bos", "eos"):
        value = gen.get(f"{key}_token_id")
        if isinstance(value, list):  # generation_config may list several stop ids: the first is the model's own
            value = value[0] if value else None
        token = cfg.get(f"{key}_token")
        if isinstance(token, dict):  # an AddedToken written out
            token = token.get("content")
        if not isinstance(value, int) and isinstance(token, str):
            value = tok.token_to_id(token)
        out[key] = value if isinstance(value, int) else None
    if out["eos"] is None:
        out["eos"] = eos_id(tok, folder)
        out["bos"] = out["bos"] if out["bos"] is not None else out["eos"]
    return out


def tokenizer_difference(a: Tokenizer | GuardedTokenizer, b: Tokenizer | GuardedTokenizer) -> str | None:
    """Why two tokenizers would give the same text other ids (None: they would not): their
    vocabularies (every token and its id, added tokens included) and which tokens are special."""
    va, vb = a.get_vocab(with_added_tokens=True), b.get_vocab(with_added_tokens=True)
    if len(va) != len(vb):
        return f"{len(va):,} tokens vs {len(vb):,}"
    moved = sorted(t for t in va if vb.get(t) != va[t])
    if moved:
        t = moved[0]
        return f"same size, but {len(moved):,} tokens differ (e.g. {t!r}: id {va[t]} vs {vb.get(t)})"
    sa = {t.content for t in a.get_added_tokens_decoder().values() if t.special}
    sb = {t.content for t in b.get_added_tokens_decoder().values() if t.special}
    if sa != sb:
        return f"special tokens differ ({', '.join(sorted(sa ^ sb)[:3])})"
    return None


def parse_tokenizer_spec(spec: str) -> int | Path:
    """`bpe:VOCAB` -> the vocab size to train; anything else -> a tokenizer.json path (the one
    inside it, for a Hugging Face model folder)."""
    if spec.startswith("bpe:"):
        try:
            return _bpe_vocab(int(spec[4:]))
        except ValueError:
            raise DataError(f"data.tokenizer {spec!r}: expected bpe:VOCAB with an integer, e.g. bpe:4096") from None
    p = Path(spec)
    return p / "tokenizer.json" if p.is_dir() and (p / "tokenizer.json").is_file() else p
