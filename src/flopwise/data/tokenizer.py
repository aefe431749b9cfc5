"""Byte-level BPE through Hugging Face `tokenizers`: trained on the corpus or loaded from a file."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from flopwise.errors import DataError

EOS = "<|endoftext|>"
MIN_VOCAB = 257  # 256 byte symbols + EOS


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    if vocab_size < MIN_VOCAB:
        raise DataError(f"tokenizer vocab {vocab_size}: a byte-level BPE needs at least {MIN_VOCAB} "
                        "(256 bytes + EOS); use e.g. bpe:4096")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"tokenizer {p}: not found (give a tokenizer.json, or bpe:VOCAB to train one)")
    _check_bpe_prefix(p)
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise DataError(f"tokenizer {p}: not a Hugging Face tokenizer.json ({str(e).splitlines()[0][:120]})") from None
    eos_id(tok, p)
    return tok


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
        for field, affix, ok in (("continuing_subword_prefix", prefix, parts[1].startswith),
                                 ("end_of_word_suffix", suffix, parts[0].endswith)):
            if isinstance(affix, str) and affix and not ok(affix):
                raise DataError(f"tokenizer {p}: model.{field}={affix!r} but merge {' '.join(parts)!r} lacks it; "
                                "fix the tokenizer.json (or set the field to null)")


def eos_id(tok: Tokenizer, where: str | Path = "tokenizer") -> int:
    for name in (EOS, "</s>", "<|end_of_text|>", "<eos>"):
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise DataError(f"{where}: no end-of-text token ({EOS} or </s>) in the vocabulary; add one as a special token")


def parse_tokenizer_spec(spec: str) -> int | Path:
    """`bpe:VOCAB` -> the vocab size to train; anything else -> a tokenizer.json path."""
    if spec.startswith("bpe:"):
        try:
            return int(spec[4:])
        except ValueError:
            raise DataError(f"data.tokenizer {spec!r}: expected bpe:VOCAB with an integer, e.g. bpe:4096") from None
    return Path(spec)
