"""Structure-aware mutation of real files, for tests/test_fuzz.py.

Each `*_mutants` function takes a valid file's content (one flopwise itself wrote) and returns the
complete, deterministic list of its mutants as (label, bytes): every field of a JSON/TOML tree
replaced by each value of `REPLACEMENTS`, removed, duplicated under a new name, renamed; binary
files truncated at several points, bit-flipped at seeded positions, and (safetensors) their header
length field corrupted and their header JSON mutated field by field; pickles (DCP `.metadata`)
mutated as objects and opcode by opcode. Every mutant is a function of the file's bytes and a
seed alone, so the files mutated must not hold anything machine-specific (tests/test_fuzz.py
writes them with relative paths and normalises `.metadata`): then a seed means the same mutants
on every machine. `pick` draws a bounded, seeded sample when FLOPWISE_FUZZ_CASES=N asks for one.
"""

from __future__ import annotations

import copy
import json
import os
import random
import struct
from collections.abc import Iterator
from typing import Any

import tomli_w

Path_ = tuple[Any, ...]  # keys and list indices from the root to a field

# Every JSON type, and the values of each that break readers most often.
REPLACEMENTS: list[tuple[str, Any]] = [
    ("null", None),
    ("true", True),
    ("false", False),
    ("zero", 0),
    ("one", 1),
    ("neg", -1),
    ("huge", 2**64 + 1),
    ("float", 0.5),
    ("negfloat", -1e308),
    ("nan", float("nan")),
    ("inf", float("inf")),
    ("str-nan", "NaN"),
    ("str-inf", "-Infinity"),
    ("str", "x"),
    ("empty-str", ""),
    ("dotdot", "../escape"),
    ("empty-list", []),
    ("list", [1, "a", None]),
    ("empty-dict", {}),
    ("dict", {"a": 1, "b": [2]}),
]

DEFAULT_CASES = 0  # 0: every mutant (6,406 over the 13 readers, about 75 s on 2 CPU cores; a sample of 120: 25 s)


def budget(default: int = DEFAULT_CASES) -> int:
    """Cases per reader: FLOPWISE_FUZZ_CASES (a seeded sample of N, plus the regressions), or
    the CI default; 0 means every mutant."""
    n = int(os.environ.get("FLOPWISE_FUZZ_CASES", default))
    return n if n > 0 else 1 << 62


def pick(
    cases: list[tuple[str, bytes]], n: int, seed: int = 0, always: tuple[str, ...] = ()
) -> list[tuple[str, bytes]]:
    """A seeded sample of n cases (all of them if n >= len), in a fixed order; cases whose label
    ends with one of `always` (those that once found a bug) are always among them."""
    if n >= len(cases):
        return cases
    kept = [c for c in cases if c[0].endswith(always)] if always else []
    rest = [c for c in cases if c not in kept]
    return kept + random.Random(seed).sample(rest, max(0, n - len(kept)))


def paths(tree: Any, fanout: int = 6, seed: int = 0, prefix: Path_ = ()) -> Iterator[Path_]:
    """Every field's path, depth first. Containers with more than `fanout` children (a vocabulary,
    a merge list) contribute their first and last children and a seeded few between."""
    if isinstance(tree, dict):
        keys = list(tree)
    elif isinstance(tree, list):
        keys = list(range(len(tree)))
    else:
        return
    if len(keys) > fanout:
        rng = random.Random(f"{seed}:{prefix}")
        keys = [*keys[:2], *rng.sample(keys[2:-1], fanout - 3), keys[-1]]
    for k in keys:
        yield (*prefix, k)
        yield from paths(tree[k], fanout, seed, (*prefix, k))


def _parent(tree: Any, path: Path_) -> Any:
    for k in path[:-1]:
        tree = tree[k]
    return tree


def tree_mutants(tree: Any, fanout: int = 6) -> Iterator[tuple[str, Any]]:
    """(label, mutated copy) for every field: each replacement value, removed, duplicated under
    another name (a list: the item repeated), renamed; and the whole document replaced."""
    for label, value in REPLACEMENTS:
        yield f"<root>={label}", copy.deepcopy(value)
    for path in paths(tree, fanout):
        name = "/".join(map(str, path))
        for label, value in REPLACEMENTS:
            t = copy.deepcopy(tree)
            _parent(t, path)[path[-1]] = copy.deepcopy(value)
            yield f"{name}={label}", t
        t = copy.deepcopy(tree)
        del _parent(t, path)[path[-1]]
        yield f"{name}:removed", t
        t = copy.deepcopy(tree)
        parent = _parent(t, path)
        if isinstance(parent, dict):
            parent[f"{path[-1]}_dup"] = copy.deepcopy(parent[path[-1]])
            yield f"{name}:duplicated", t
            t = copy.deepcopy(tree)
            parent = _parent(t, path)
            parent[f"{path[-1]}X"] = parent.pop(path[-1])
            yield f"{name}:renamed", t
        else:
            parent.insert(path[-1], copy.deepcopy(parent[path[-1]]))
            yield f"{name}:duplicated", t


def json_mutants(raw: bytes, fanout: int = 6) -> list[tuple[str, bytes]]:
    """Tree mutants of a JSON document (NaN/Infinity written as Python's json does), plus the
    document truncated and with a key literally duplicated (the last value wins in json.loads)."""
    tree = json.loads(raw)
    out = [(label, json.dumps(t).encode()) for label, t in tree_mutants(tree, fanout)]
    out += truncations(raw, "json")
    text = raw.decode()
    brace = text.find("{")
    if brace >= 0 and isinstance(tree, dict) and tree:
        first = next(iter(tree))
        out.append(
            ("duplicate-key-text", (text[: brace + 1] + json.dumps(first) + ": null, " + text[brace + 1 :]).encode())
        )
    return out


def _toml_safe(tree: Any) -> Any:
    """TOML has no null: drop None values (removal covers them); tomli_w writes the rest."""
    if isinstance(tree, dict):
        return {k: _toml_safe(v) for k, v in tree.items() if v is not None}
    if isinstance(tree, list):
        return [_toml_safe(v) for v in tree if v is not None]
    return tree


def toml_mutants(raw: bytes, fanout: int = 8) -> list[tuple[str, bytes]]:
    """Tree mutants of a TOML document (replacements that TOML cannot hold are skipped), plus
    truncations. Huge integers TOML cannot hold are written as text by hand."""
    import tomllib

    tree = tomllib.loads(raw.decode())
    out, seen = [], set()
    for label, t in tree_mutants(tree, fanout):
        if not isinstance(t, dict) or label.endswith("=null"):
            continue
        try:
            text = tomli_w.dumps(_toml_safe(t))
        except (TypeError, ValueError, OverflowError):
            continue
        if text not in seen:
            seen.add(text)
            out.append((label, text.encode()))
    return out + truncations(raw, "toml")


def truncations(raw: bytes, what: str) -> list[tuple[str, bytes]]:
    """The file cut at 0, 1, 8 bytes, a third, a half, and one byte short."""
    points = sorted({0, 1, 8, len(raw) // 3, len(raw) // 2, max(0, len(raw) - 1)} - {len(raw)})
    return [(f"{what}:truncated@{n}", raw[:n]) for n in points]


def bitflips(raw: bytes, what: str, n: int = 24, seed: int = 0) -> list[tuple[str, bytes]]:
    """n single-bit flips at seeded positions, half of them within the first 256 bytes (headers)."""
    rng = random.Random(f"{seed}:{what}:{len(raw)}")
    out = []
    for i in range(n):
        pos = rng.randrange(min(len(raw), 256)) if i % 2 == 0 else rng.randrange(len(raw))
        b = bytearray(raw)
        b[pos] ^= 1 << rng.randrange(8)
        out.append((f"{what}:bitflip@{pos}", bytes(b)))
    return out


def binary_mutants(raw: bytes, what: str, flips: int = 24) -> list[tuple[str, bytes]]:
    return (
        truncations(raw, what)
        + bitflips(raw, what, flips)
        + [(f"{what}:empty", b""), (f"{what}:doubled", raw + raw), (f"{what}:zeros", bytes(len(raw)))]
    )


def safetensors_mutants(raw: bytes, fanout: int = 6) -> list[tuple[str, bytes]]:
    """A safetensors file: 8-byte little-endian header length, JSON header, tensor bytes. Its
    length field set wrong, its header mutated field by field (length kept consistent, so the
    mutated header is what the reader parses), truncations and bit flips."""
    (n,) = struct.unpack("<Q", raw[:8])
    header, body = raw[8 : 8 + n], raw[8 + n :]
    out = [
        (f"st:length={v}", struct.pack("<Q", v) + raw[8:])
        for v in (0, 1, n - 1, n + 1, n + 8, len(raw), 2**32, 2**63, 2**64 - 1)
    ]
    for label, t in tree_mutants(json.loads(header), fanout):
        h = json.dumps(t).encode()
        h += b" " * (-len(h) % 8)
        out.append((f"st:header/{label}", struct.pack("<Q", len(h)) + h + body))
    return out + binary_mutants(raw, "st", 16)


def jsonl_mutants(raw: bytes, fanout: int = 6) -> list[tuple[str, bytes]]:
    """A JSONL file: each record mutated as a JSON tree, lines removed, repeated, cut, not JSON."""
    lines = raw.decode().splitlines()
    out = []
    for i, line in enumerate(lines):
        for label, t in tree_mutants(json.loads(line), fanout):
            out.append((f"line{i + 1}:{label}", "\n".join([*lines[:i], json.dumps(t), *lines[i + 1 :]]).encode()))
        out.append((f"line{i + 1}:cut", "\n".join([*lines[:i], line[: len(line) // 2], *lines[i + 1 :]]).encode()))
        out.append((f"line{i + 1}:removed", "\n".join(lines[:i] + lines[i + 1 :]).encode()))
    out += [
        ("all-removed", b""),
        ("blank-lines", b"\n\n\n"),
        ("not-utf8", b"\xff\xfe" + raw),
        ("not-json", b"{context: x}\n"),
    ]
    return out + truncations(raw, "jsonl")


def dcp_metadata_mutants(raw: bytes, keys: int = 4, seed: int = 0) -> list[tuple[str, bytes]]:
    """DCP `.metadata` mutated as objects, then pickled again: for a seeded few tensor entries, the
    size, dtype and chunk boxes changed; storage records pointed at other offsets, lengths and
    files; entries dropped, added, renamed; plus the byte-level mutants of the stream. `raw` must
    be a file flopwise wrote (the test unpickles it with the stock unpickler)."""
    import pickle

    import torch

    def variants(md) -> Iterator[tuple[str, Any]]:
        rng = random.Random(seed)
        entries = sorted(md.state_dict_metadata)
        model = [k for k in entries if k.startswith("model.")]  # what eval, export and resume all read
        names = rng.sample(model, keys - 1) + rng.sample([k for k in entries if k not in model] or model, 1)
        storage = {i.fqn: i for i in md.storage_data}
        for name in names:
            tm = md.state_dict_metadata[name]
            size = list(tm.size)
            for label, new in (
                ("bigger", [s + 1 for s in size]),
                ("smaller", [max(0, s - 1) for s in size]),
                ("rank+1", [*size, 1]),
                ("scalar", []),
                ("negative", [-s for s in size]),
                ("huge", [2**40] * len(size)),
            ):
                yield (
                    f"{name}:size={label}",
                    lambda m, n=name, v=new: setattr(m.state_dict_metadata[n], "size", torch.Size(v)),
                )
                yield (
                    f"{name}:chunk.sizes={label}",
                    lambda m, n=name, v=new: setattr(m.state_dict_metadata[n].chunks[0], "sizes", torch.Size(v)),
                )
            yield (
                f"{name}:chunk.offsets+1",
                lambda m, n=name: setattr(
                    m.state_dict_metadata[n].chunks[0],
                    "offsets",
                    torch.Size([o + 1 for o in m.state_dict_metadata[n].chunks[0].offsets]),
                ),
            )
            yield f"{name}:chunks=[]", lambda m, n=name: setattr(m.state_dict_metadata[n], "chunks", [])
            yield (
                f"{name}:chunks*2",
                lambda m, n=name: m.state_dict_metadata[n].chunks.append(m.state_dict_metadata[n].chunks[0]),
            )
            for dt in (torch.float16, torch.int64, torch.bool, torch.complex64, torch.uint8):
                yield (
                    f"{name}:dtype={dt}",
                    lambda m, n=name, d=dt: setattr(m.state_dict_metadata[n].properties, "dtype", d),
                )
            yield f"{name}:entry=dropped", lambda m, n=name: m.state_dict_metadata.pop(n)
            yield (
                f"{name}:entry=renamed",
                lambda m, n=name: m.state_dict_metadata.__setitem__(n + "X", m.state_dict_metadata.pop(n)),
            )
            idx = storage[name]
            for label, attr, value in (
                ("offset=-1", "offset", -1),
                ("offset=huge", "offset", 2**40),
                ("length=0", "length", 0),
                ("length=1", "length", 1),
                ("length=huge", "length", 2**40),
                ("length=-1", "length", -1),
                ("file=state.json", "relative_path", "state.json"),
                ("file=.metadata", "relative_path", ".metadata"),
                ("file=missing", "relative_path", "__9_9.distcp"),
            ):
                yield f"{name}:storage.{label}", lambda m, i=idx, a=attr, v=value: setattr(m.storage_data[i], a, v)
            yield f"{name}:storage=dropped", lambda m, i=idx: m.storage_data.pop(i)
            yield f"{name}:planner=dropped", lambda m, n=name: (m.planner_data or {}).pop(n, None)
            yield f"{name}:planner=bogus", lambda m, n=name: (m.planner_data or {}).__setitem__(n, ("x",))
        yield "state_dict_metadata={}", lambda m: setattr(m, "state_dict_metadata", {})
        yield "storage_data={}", lambda m: setattr(m, "storage_data", {})
        yield "planner_data=None", lambda m: setattr(m, "planner_data", None)
        yield "storage_meta=None", lambda m: setattr(m, "storage_meta", None)

    out = []
    for label, mutate in variants(pickle.loads(raw)):
        md = pickle.loads(raw)  # trusted: flopwise's own file
        mutate(md)
        out.append((f"md:{label}", pickle.dumps(md)))
    return out + pickle_opcode_mutants(raw, "metadata") + binary_mutants(raw, "metadata", 60)


def pickle_opcode_mutants(raw: bytes, what: str, sites: int = 3) -> list[tuple[str, bytes]]:
    """A pickle's opcodes swapped for the ones that make an unpickler allocate or reference what
    the stream declares (counted bytes, strings, bytearrays, longs, frames, out-of-band buffers):
    at the first `sites` MEMOIZE opcodes and the first `sites` short strings, each opcode byte is
    replaced by each of them, so the bytes after it are read as a length. One bit turns MEMOIZE
    (0x94) into BYTEARRAY8 (0x96): the bit flip that made CPython 3.11 print or raise "SystemError:
    deallocated bytearray object has exported buffers" from a refused `.metadata`."""
    import pickletools

    targets = ("BYTEARRAY8", "BINBYTES8", "BINUNICODE8", "LONG4", "FRAME", "READONLY_BUFFER", "NEXT_BUFFER", "STOP")
    codes = {op.name: op.code.encode("latin-1") for op in pickletools.opcodes}
    found: dict[str, list[int]] = {"MEMOIZE": [], "SHORT_BINUNICODE": []}
    for op, _arg, pos in pickletools.genops(raw):
        if op.name in found and len(found[op.name]) < sites:
            found[op.name].append(pos)
    out = []
    for name, positions in found.items():
        for pos in positions:
            for target in targets:
                out.append((f"{what}:op@{pos}:{name}={target}", raw[:pos] + codes[target] + raw[pos + 1 :]))
    return out


def normalise_dcp_metadata(raw: bytes) -> bytes:
    """DCP's `.metadata` with what differs from machine to machine fixed: its storage_meta's
    checkpoint_id (the folder DCP wrote into, an absolute path unless given a relative one) cut to
    its last part and the random save_id zeroed. Tensors, chunks and storage records are kept, so
    the file still loads; mutants of it are then the same bytes on every machine."""
    import pickle  # trusted: a file flopwise itself just wrote

    md = pickle.loads(raw)
    meta = md.storage_meta
    if meta is not None:
        if meta.checkpoint_id is not None:
            meta.checkpoint_id = type(meta.checkpoint_id)(os.path.basename(str(meta.checkpoint_id)))
        if meta.save_id is not None:
            meta.save_id = "00000000-0000-0000-0000-000000000000"
        meta.load_id = None
    return pickle.dumps(md)


def with_original(raw: bytes, mutants: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """("original", raw) first, then the mutants: tests read the unmutated file as a control."""
    return [("original", raw), *mutants]
