"""Document masking (data.document_mask): a packed window's logits equal each document run alone."""

import pytest
import torch

from flopwise.config.schema import ModelConfig
from flopwise.model.transformer import build_model, document_ids, document_positions

EOS = 0
LENGTHS = [(7, 12, 5, 9), (20, 13), (33,)]  # three windows of 33 tokens: 4, 2 and 1 documents


def small(arch: str) -> ModelConfig:
    return ModelConfig(
        arch=arch,
        n_layers=2,
        d_model=64,
        n_heads=4,
        vocab_size=97,
        max_seq_len=64,
        **({"n_kv_heads": 2} if arch in ("llama", "mistral") else {}),
        **({"sliding_window": 6} if arch == "mistral" else {}),
    )


def packed(seed: int = 0) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """(3, 34) windows of [EOS, doc...] segments (the first cut so every row is 34 long) and the segments."""
    g = torch.Generator().manual_seed(seed)
    rows, segments = [], []
    for lengths in LENGTHS:
        segs = [torch.cat([torch.tensor([EOS]), torch.randint(1, 97, (n,), generator=g)]) for n in lengths]
        row = torch.cat(segs)
        rows.append(row[:34])
        segments.append(segs)
    return torch.stack(rows), segments


@pytest.mark.parametrize(
    "arch,reset",
    [
        ("llama", False),
        ("llama", True),
        ("mistral", False),
        ("gpt2", True),
        ("opt", True),
        ("neox", False),
        ("bloom", False),
        ("gopher", False),
        ("qwen3", True),
    ],
)
def test_packed_window_equals_each_document_alone(arch, reset):
    """Relative schemes (RoPE, ALiBi, Transformer-XL) need no position reset; learned absolute
    positions (GPT-2, OPT) do."""
    model = build_model(small(arch), seed=1).eval()
    windows, segments = packed()
    docs = document_ids(windows, EOS)
    with torch.no_grad():
        out = model(windows, documents=docs, positions=document_positions(docs) if reset else None)
        for b, segs in enumerate(segments):
            start = 0
            for seg in segs:
                seg = seg[: windows.shape[1] - start]
                alone = model(seg[None])
                torch.testing.assert_close(out[b, start : start + len(seg)], alone[0], rtol=1e-5, atol=1e-5)
                start += len(seg)


def test_without_the_mask_documents_see_each_other():
    """The check above can fail: the unmasked window differs from the documents alone."""
    model = build_model(small("llama"), seed=1).eval()
    windows, segments = packed()
    with torch.no_grad():
        out = model(windows)
        second = segments[0][1]
        alone = model(second[None])
    assert not torch.allclose(out[0, 8 : 8 + len(second)], alone[0], atol=1e-3)


def test_document_ids_and_positions():
    t = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, 4]])
    docs = document_ids(t, EOS)
    assert docs.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2]]
    assert document_positions(docs).tolist() == [[0, 1, 0, 1, 2, 3, 0, 1]]


def saved_bytes(model, x, **kw) -> int:
    """Bytes autograd keeps for backward, under bf16 autocast."""
    from flopwise.measure.bytes import SavedBytes

    with torch.autocast("cpu", dtype=torch.bfloat16), SavedBytes(model) as s:
        model(x, **kw).float().sum()
    return s.bytes


def test_planner_books_the_mask_the_engine_keeps():
    """The planner's document-mask term (plan.memory) against the saved bytes the model adds."""
    from flopwise.plan.memory import activation_bytes_per_layer, engine_precision

    m = small("llama").model_copy(update={"n_layers": 3})
    model = build_model(m, seed=0)
    x = torch.randint(1, 97, (2, 48))
    x[:, ::11] = EOS
    added = saved_bytes(model, x, documents=document_ids(x, EOS)) - saved_bytes(model, x)
    bf16 = engine_precision("bf16", fsdp=False, cpu=True)
    per_layer = activation_bytes_per_layer(m, 48, 2, mask_keys=48, precision=bf16) - activation_bytes_per_layer(
        m, 48, 2, precision=bf16
    )
    assert added == m.n_layers * per_layer > 0
