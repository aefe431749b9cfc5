import json

import numpy as np
import pytest

from flopwise.data.loader import TokenLoader, eval_batches
from flopwise.data.prepare import prepare_data
from flopwise.data.shards import open_split, read_index, tokenizer_of
from flopwise.data.tokenizer import load_tokenizer, train_bpe
from flopwise.errors import DataError


def test_tokenizer_round_trip():
    tok = train_bpe(["hello world, 世界 🌍 — naïve café\n" * 50, "The quick brown fox."], 300)
    text = "hello 世界 🌍 café, brand-new text never seen: ζ∂ƒ!\n\ttabs"
    assert tok.decode(tok.encode(text).ids) == text


def test_prepare_counts_and_split_by_document(tiny_data):
    meta = read_index(tiny_data)
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 512
    assert meta["counts"]["documents"] == len(train["documents"]) + len(val["documents"]) == 13
    assert len(val["documents"]) == 2  # ceil(0.1 · 13)
    assert meta["counts"]["tokens"] == train["tokens"] + val["tokens"]
    tokens = np.asarray(open_split(tiny_data, "train"))
    eos = meta["eos_id"]
    assert len(tokens) == train["tokens"] and int((tokens == eos).sum()) == len(train["documents"])
    for start, length in train["documents"]:
        assert tokens[start + length - 1] == eos
    # documents decode back to the source text; the two splits share no document
    tok = tokenizer_of(tiny_data)
    docs = {tok.decode(list(tokens[s : s + n - 1])) for s, n in train["documents"]}
    vtok = open_split(tiny_data, "val")
    vdocs = {tok.decode(list(vtok[s : s + n - 1])) for s, n in val["documents"]}
    sources = {open(f).read() for f in meta["sources"]}
    assert not docs & vdocs and docs | vdocs == sources


def test_prepare_is_deterministic(tiny_data, tmp_path):
    src = read_index(tiny_data)
    tokens = open_split(tiny_data, "train")
    again = tmp_path / "again"
    prepare_data(
        [s for s in {str(p.rsplit("/", 1)[0]) for p in src["sources"]}],
        again,
        tokenizer="bpe:512",
        val_fraction=0.1,
        seed=0,
    )
    assert np.array_equal(open_split(again, "train"), tokens)


def test_jsonl_input_and_given_tokenizer(tiny_data, tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text(
        "\n".join(json.dumps({"text": f"Document {i}: Alice was beginning to get very tired."}) for i in range(10))
    )
    out = tmp_path / "jsonl"
    stats = prepare_data([str(f)], out, tokenizer=str(tiny_data / "tokenizer.json"), val_fraction=0.2)
    assert stats.documents == 10 and stats.splits["val"] > 0
    assert read_index(out)["vocab_size"] == 512


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b"", "contains no text"),
        (b"   \n\n", "contains no text"),
        (b"\x00\x01\x02binary\x00" * 100, "looks binary"),
        (b"caf\xe9 latin-1 text", "not UTF-8"),
    ],
)
def test_bad_text_inputs(tmp_path, content, fragment):
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    with pytest.raises(DataError, match=fragment):
        prepare_data([str(f)], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_jsonl_and_missing_path(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match="line 2 has no string field 'text'"):
        prepare_data([str(f)], tmp_path / "out")
    with pytest.raises(DataError, match="no such file"):
        prepare_data([str(tmp_path / "missing.txt")], tmp_path / "out")


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _first_shard(d, split="train"):
    return d / json.loads((d / "index.json").read_text())["splits"][split]["files"][0]["file"]


def test_shard_that_disagrees_with_index(tiny_data, tmp_path):
    d = _copy(tiny_data, tmp_path / "d")
    with open(_first_shard(d), "ab") as f:
        f.write(b"\x01\x00\x02")
    with pytest.raises(DataError, match="but the index says"):
        open_split(d, "train")


def test_a_shard_missing_not_a_file_or_unreadable_is_said_as_such(tiny_data, tmp_path, monkeypatch):
    """An unreadable shard was reported as missing: each case now has its own words."""
    d = _copy(tiny_data, tmp_path / "d")
    shard = _first_shard(d)
    data, whole = shard.read_bytes(), len(open_split(d, "train"))

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as m:  # root reads any file: the kernel's answer to anyone else
        m.setattr(np, "memmap", denied)
        with pytest.raises(DataError, match=r"unreadable \(Permission denied\)"):
            open_split(d, "train")
    shard.unlink()
    with pytest.raises(DataError, match="missing"):
        open_split(d, "train")
    shard.mkdir()
    with pytest.raises(DataError, match="not a file"):
        open_split(d, "train")
    shard.rmdir()
    shard.write_bytes(data)
    assert len(open_split(d, "train")) == whole


def test_token_ids_beyond_vocab_and_vocab_beyond_dtype(tiny_data, tmp_path):
    d = _copy(tiny_data, tmp_path / "d")
    shard = _first_shard(d)
    tokens = np.fromfile(shard, dtype=np.uint16)
    tokens[5] = 9999
    tokens.tofile(shard)
    with pytest.raises(DataError, match="token id 9999 >= vocab_size 512"):
        open_split(d, "train")
    meta = json.loads((d / "index.json").read_text())
    meta["vocab_size"] = 70000
    (d / "index.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="does not fit dtype uint16"):
        read_index(d)


def test_index_cannot_point_outside_the_data_dir(tiny_data, tmp_path):
    d = _copy(tiny_data, tmp_path / "d")
    meta = json.loads((d / "index.json").read_text())
    meta["splits"]["train"]["files"][0]["file"] = "../../etc/passwd"
    meta["tokenizer"] = "../tokenizer.json"
    (d / "index.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="must be a plain name"):
        open_split(d, "train")
    with pytest.raises(DataError, match="must be a plain name"):
        tokenizer_of(d)


def test_bad_tokenizer_file(tmp_path):
    f = tmp_path / "tokenizer.json"
    f.write_text("{not json")
    with pytest.raises(DataError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer(f)


def test_loader_order_is_a_function_of_seed_and_epoch(tiny_data):
    a = TokenLoader(tiny_data, "train", 32, 8, seed=1)
    b = TokenLoader(tiny_data, "train", 32, 8, seed=1)
    c = TokenLoader(tiny_data, "train", 32, 8, seed=2)
    xa, xb, xc = a.next_batch(), b.next_batch(), c.next_batch()
    assert xa.shape == (8, 33) and xa.dtype.is_floating_point is False
    assert (xa == xb).all() and not (xa == xc).all()
    # targets are inputs shifted by one inside the packed stream
    tokens = open_split(tiny_data, "train")
    first = int(np.random.default_rng([1, 0]).permutation(a.streams[0].n_windows)[0])
    assert xa[0].tolist() == tokens[first * 32 : first * 32 + 33].tolist()


def test_loader_epochs_cover_every_window_once(tiny_data):
    loader = TokenLoader(tiny_data, "train", 32, 8, seed=0)
    stream = loader.streams[0]
    n = stream.n_windows
    seen = []
    while stream.epoch == 0:
        pairs = loader._take_global()
        assert (pairs[:, 0] == 0).all()
        seen.extend(pairs[:, 1].tolist())
    first_epoch = seen[:n]
    assert sorted(first_epoch) == list(range(n))
    assert stream.epoch == 1 and stream.cursor == (len(seen) - n)


def test_dp_ranks_read_disjoint_slices_of_the_global_batch(tiny_data):
    whole = TokenLoader(tiny_data, "train", 32, 8, seed=0)
    ranks = [TokenLoader(tiny_data, "train", 32, 8, seed=0, dp_rank=r, dp_size=4) for r in range(4)]
    for _ in range(3):
        full = whole.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert all(p.shape == (2, 33) for p in parts)
        assert (full == np.concatenate(parts)).all()


def test_loader_resume_and_dp_change(tiny_data):
    """Position is global: resuming under another dp degree continues the same stream."""
    ref = TokenLoader(tiny_data, "train", 32, 8, seed=0)
    stream = [ref.next_batch() for _ in range(5)]
    a = TokenLoader(tiny_data, "train", 32, 8, seed=0)
    for _ in range(2):
        a.next_batch()
    state = a.state_dict()
    halves = []
    for r in range(2):
        b = TokenLoader(tiny_data, "train", 32, 8, seed=0, dp_rank=r, dp_size=2)
        b.load_state_dict(state)
        halves.append([b.next_batch() for _ in range(3)])
    for k in range(3):
        assert (np.concatenate([halves[0][k], halves[1][k]]) == stream[2 + k]).all()


def test_loader_state_mismatch_is_refused(tiny_data):
    a = TokenLoader(tiny_data, "train", 32, 8, seed=0)
    b = TokenLoader(tiny_data, "train", 16, 8, seed=0)
    with pytest.raises(DataError, match="seq_len"):
        b.load_state_dict(a.state_dict())


def test_eval_batches_are_fixed(tiny_data):
    a = list(eval_batches(tiny_data, 32, 4, 3))
    b = list(eval_batches(tiny_data, 32, 4, 3))
    assert len(a) == 3 and all((x == y).all() for x, y in zip(a, b, strict=True))
    val = open_split(tiny_data, "val")
    assert a[0][0].tolist() == val[:33].tolist()


def test_parquet_input(tmp_path, tiny_data):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "docs.parquet"
    pq.write_table(
        pa.table(
            {"text": [f"Row {i}: the Queen of Hearts, she made some tarts." for i in range(8)], "id": list(range(8))}
        ),
        f,
    )
    stats = prepare_data([str(f)], tmp_path / "pq", tokenizer=str(tiny_data / "tokenizer.json"), val_fraction=0.25)
    assert stats.documents == 8 and stats.splits["val"] > 0
