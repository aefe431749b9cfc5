"""Hugging Face interchange of weights: safetensors (single file or sharded with an index) +
tokenizer files, both ways, for the Llama (1/2/3, rope scaling), Mistral, Qwen3, GPT-2, GPT-NeoX
and OPT families. Needs no `transformers` import: the formats are read and written directly
(the config mapping is in config/hf_mapping.py).

Loading reads, for each parameter a rank holds (or its shard), only that box of the HF tensor
(safetensors' lazy slices), so a sharded run never holds the whole checkpoint; writing goes shard
by shard from any tensor source (a model in memory, or a DCP checkpoint read tensor by tensor).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from flopwise.config.hf_mapping import LLAMA_LIKE, hf_config_from_model, refuse, weight_map
from flopwise.config.schema import ModelConfig, hf_model_fields
from flopwise.model.init import canonical_name, global_box

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
# --- weights ---------------------------------------------------------------------------------


def _with_bias(f: str, h: str, table) -> list[tuple[str, str]]:
    """Weight and bias pairs for modules named `a` here and `b` there, under prefixes f and h."""
    return [(f + a + suffix, h + b + suffix) for a, b in table for suffix in (".weight", ".bias")]


def _names(m: ModelConfig) -> list[tuple[str, str]]:
    """(flopwise name, HF name) for every tensor that maps one to one."""
    if m.arch in LLAMA_LIKE:
        return _llama_names(m)
    families = {"gpt2": _gpt2_names, "neox": _neox_names, "opt": _opt_names}
    return families[m.arch](m) if m.arch in families else []


def _llama_names(m: ModelConfig) -> list[tuple[str, str]]:
    pairs = [("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]
    if not m.tie_embeddings:
        pairs.append(("output.weight", "lm_head.weight"))
    for i in range(m.n_layers):
        f, h = f"layers.{i}.", f"model.layers.{i}."
        pairs += [
            (f + "attention.wq.weight", h + "self_attn.q_proj.weight"),
            (f + "attention.wk.weight", h + "self_attn.k_proj.weight"),
            (f + "attention.wv.weight", h + "self_attn.v_proj.weight"),
            (f + "attention.wo.weight", h + "self_attn.o_proj.weight"),
            (f + "feed_forward.w1.weight", h + "mlp.gate_proj.weight"),
            (f + "feed_forward.w3.weight", h + "mlp.up_proj.weight"),
            (f + "feed_forward.w2.weight", h + "mlp.down_proj.weight"),
            (f + "attention_norm.weight", h + "input_layernorm.weight"),
            (f + "ffn_norm.weight", h + "post_attention_layernorm.weight"),
        ]
        if m.qkv_bias:
            pairs += [(f + f"attention.w{x}.bias", h + f"self_attn.{x}_proj.bias") for x in "qkv"]
        if m.qk_norm:
            pairs += [
                (f + "attention.q_norm.weight", h + "self_attn.q_norm.weight"),
                (f + "attention.k_norm.weight", h + "self_attn.k_norm.weight"),
            ]
    return pairs


def _gpt2_names(m: ModelConfig) -> list[tuple[str, str]]:
    """Not the Conv1D weights (q/k/v fused, all transposed): `_sources` maps those."""
    pairs = [
        ("tok_embeddings.weight", "transformer.wte.weight"),
        ("pos_embeddings.weight", "transformer.wpe.weight"),
    ]
    pairs += _with_bias("", "transformer.", (("norm", "ln_f"),))
    for i in range(m.n_layers):
        f, h = f"layers.{i}.", f"transformer.h.{i}."
        pairs += _with_bias(f, h, (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")))
        pairs += [
            (f + "attention.wo.bias", h + "attn.c_proj.bias"),
            (f + "feed_forward.w1.bias", h + "mlp.c_fc.bias"),
            (f + "feed_forward.w2.bias", h + "mlp.c_proj.bias"),
        ]
    return pairs


def _neox_names(m: ModelConfig) -> list[tuple[str, str]]:
    pairs = [("tok_embeddings.weight", "gpt_neox.embed_in.weight")]
    pairs += _with_bias("", "gpt_neox.", (("norm", "final_layer_norm"),))
    if not m.tie_embeddings:
        pairs.append(("output.weight", "embed_out.weight"))
    for i in range(m.n_layers):
        pairs += _with_bias(
            f"layers.{i}.",
            f"gpt_neox.layers.{i}.",
            (
                ("attention_norm", "input_layernorm"),
                ("ffn_norm", "post_attention_layernorm"),
                ("attention.wo", "attention.dense"),
                ("feed_forward.w1", "mlp.dense_h_to_4h"),
                ("feed_forward.w2", "mlp.dense_4h_to_h"),
            ),
        )
    return pairs


def _opt_names(m: ModelConfig) -> list[tuple[str, str]]:
    pairs = [
        ("tok_embeddings.weight", "model.decoder.embed_tokens.weight"),
        ("pos_embeddings.weight", "model.decoder.embed_positions.weight"),
    ]
    pairs += _with_bias("", "model.decoder.", (("norm", "final_layer_norm"),))
    if not m.tie_embeddings:
        pairs.append(("output.weight", "lm_head.weight"))
    for i in range(m.n_layers):
        pairs += _with_bias(
            f"layers.{i}.",
            f"model.decoder.layers.{i}.",
            (
                ("attention_norm", "self_attn_layer_norm"),
                ("ffn_norm", "final_layer_norm"),
                ("attention.wq", "self_attn.q_proj"),
                ("attention.wk", "self_attn.k_proj"),
                ("attention.wv", "self_attn.v_proj"),
                ("attention.wo", "self_attn.out_proj"),
                ("feed_forward.w1", "fc1"),
                ("feed_forward.w2", "fc2"),
            ),
        )
    return pairs


@dataclass(frozen=True)
class _TensorSource:
    """Where one flopwise tensor lives in an HF folder: a tensor, maybe transposed (GPT-2's Conv1D
    stores (in, out)), maybe one of `fused` tensors stacked along its rows (GPT-2's q|k|v at
    row offset k·d; NeoX's per-head [q k v] interleave, `heads` = (n_heads, head_dim, k))."""

    name: str
    transpose: bool = False
    fused: int = 1
    row_offset: int = 0
    heads: tuple[int, int, int] | None = None

    def runs(self, r0: int, r1: int) -> list[tuple[int, int]]:
        """Our rows [r0, r1) as contiguous row ranges of the HF tensor."""
        if self.heads is None:
            return [(r0 + self.row_offset, r1 + self.row_offset)]
        _, hd, k = self.heads
        out, r = [], r0
        while r < r1:
            h, end = r // hd, min(r1, (r // hd + 1) * hd)
            base = h * 3 * hd + k * hd - h * hd
            out.append((base + r, base + end))
            r = end
        return out

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        rows = (ours[0] * self.fused,) + tuple(ours[1:])
        return tuple(reversed(rows)) if self.transpose else rows

    def read(self, sl, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """Our box [offset, offset + shape) from a safetensors slice, reading only its bytes."""
        parts = []
        for a, b in self.runs(offset[0], offset[0] + shape[0]):
            if len(shape) == 1:
                parts.append(sl[a:b])
            elif self.transpose:
                parts.append(sl[offset[1] : offset[1] + shape[1], a:b].t())
            else:
                parts.append(sl[a:b, offset[1] : offset[1] + shape[1]])
        return torch.cat(parts) if len(parts) > 1 else parts[0]


def _sources(m: ModelConfig) -> dict[str, _TensorSource]:
    """flopwise tensor name -> its TensorSource, for every parameter of the model."""
    out = {ours: _TensorSource(theirs) for ours, theirs in _names(m)}
    d, hd, nh = m.d_model, m.head_dim, m.n_heads
    for i in range(m.n_layers):
        f = f"layers.{i}."
        if m.arch == "gpt2":
            h = f"transformer.h.{i}."
            for k, name in enumerate(("wq", "wk", "wv")):
                out[f + f"attention.{name}.weight"] = _TensorSource(h + "attn.c_attn.weight", True, 3, k * d)
                out[f + f"attention.{name}.bias"] = _TensorSource(h + "attn.c_attn.bias", False, 3, k * d)
            out[f + "attention.wo.weight"] = _TensorSource(h + "attn.c_proj.weight", True)
            out[f + "feed_forward.w1.weight"] = _TensorSource(h + "mlp.c_fc.weight", True)
            out[f + "feed_forward.w2.weight"] = _TensorSource(h + "mlp.c_proj.weight", True)
        elif m.arch == "neox":
            h = f"gpt_neox.layers.{i}.attention.query_key_value."
            for k, name in enumerate(("wq", "wk", "wv")):
                out[f + f"attention.{name}.weight"] = _TensorSource(h + "weight", fused=3, heads=(nh, hd, k))
                out[f + f"attention.{name}.bias"] = _TensorSource(h + "bias", fused=3, heads=(nh, hd, k))
    return out


def _recipes(m: ModelConfig) -> list[tuple[str, list[str], Callable[..., torch.Tensor]]]:
    """(HF name, flopwise names, how to make the HF tensor from them), in the order they are written."""
    same = lambda t: t  # noqa: E731
    out: list[tuple[str, list[str], Callable[..., torch.Tensor]]] = [
        (theirs, [ours], same) for ours, theirs in _names(m)
    ]
    d, hd, nh = m.d_model, m.head_dim, m.n_heads
    for i in range(m.n_layers):
        f = f"layers.{i}."
        qkv_w = [f + f"attention.{n}.weight" for n in ("wq", "wk", "wv")]
        qkv_b = [f + f"attention.{n}.bias" for n in ("wq", "wk", "wv")]
        if m.arch == "gpt2":
            h = f"transformer.h.{i}."
            out += [
                (h + "attn.c_attn.weight", qkv_w, lambda q, k, v: torch.cat([q, k, v], 0).t()),
                (h + "attn.c_attn.bias", qkv_b, lambda q, k, v: torch.cat([q, k, v])),
                (h + "attn.c_proj.weight", [f + "attention.wo.weight"], torch.t),
                (h + "mlp.c_fc.weight", [f + "feed_forward.w1.weight"], torch.t),
                (h + "mlp.c_proj.weight", [f + "feed_forward.w2.weight"], torch.t),
            ]
        elif m.arch == "neox":
            h = f"gpt_neox.layers.{i}.attention.query_key_value."
            out += [
                (
                    h + "weight",
                    qkv_w,
                    lambda *t: torch.stack([x.view(nh, hd, d) for x in t], 1).reshape(3 * nh * hd, d),
                ),
                (h + "bias", qkv_b, lambda *t: torch.stack([x.view(nh, hd) for x in t], 1).reshape(3 * nh * hd)),
            ]
    return out


def _open(path: Path, name: str):
    try:
        return safe_open(str(path / name), framework="pt")
    except Exception as e:  # safetensors raises its own error types for damaged files
        refuse(path, f"{name} is not a readable safetensors file ({str(e).splitlines()[0][:100]})")


def _weight_files(path: Path) -> dict[str, str]:
    """The folder's weight_map, refused in one line when it holds no safetensors weights."""
    files = weight_map(path)
    if not files:
        refuse(
            path, "no model.safetensors or model.safetensors.index.json with tensors (pickled .bin weights are refused)"
        )
    return files


@torch.no_grad()
def load_hf_weights(modules: list[nn.Module], path: str | Path) -> None:
    """Overwrite the parameters these modules hold (whole tensors, or this rank's DTensor shards
    under any layout) with their values in an HF folder, reading only the slices held."""
    path = Path(path)
    files = _weight_files(path)
    # DDP's wrapped Transformer, or the Transformer (whose .cfg nn.Module's stub cannot know)
    m: ModelConfig = getattr(modules[0], "module", modules[0]).cfg  # type: ignore[assignment]
    sources = _sources(m)
    ignored = sorted(set(files) - {src.name for src in sources.values()})
    if ignored:  # buffers (GPT-2's attention masks, rotary tables) or tensors of another architecture
        warnings.warn(
            f"{path}: {len(ignored)} tensor(s) not used by a {m.arch} model are ignored: "
            f"{', '.join(ignored[:4])}{', ...' if len(ignored) > 4 else ''}",
            stacklevel=2,
        )
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}
        for module in modules:
            for raw, p in module.named_parameters():
                name = canonical_name(raw)
                src = sources.get(name)
                if src is None or src.name not in files:
                    refuse(path, f"missing tensor {src.name if src else name}")
                fname = files[src.name]
                if fname not in handles:
                    handles[fname] = stack.enter_context(_open(path, fname))
                try:
                    sl = handles[fname].get_slice(src.name)
                    shape = tuple(sl.get_shape())
                except Exception as e:
                    refuse(path, f"{fname}: cannot read {src.name} ({str(e).splitlines()[0][:100]})")
                if shape != src.hf_shape(tuple(p.shape)):
                    refuse(
                        path,
                        f"tensor {src.name} has shape {list(shape)}, config.json implies "
                        f"{list(src.hf_shape(tuple(p.shape)))}",
                    )
                local = p.to_local() if isinstance(p, DTensor) else p
                if local.numel():
                    offset, box = global_box(p)
                    local.copy_(src.read(sl, offset, box))


def from_hf(path: str | Path, device: str = "cpu"):
    """(model, model_config) from a Hugging Face folder; fp32 weights on `device`."""
    from flopwise.model.transformer import build_model

    path = Path(path)
    m = ModelConfig(**hf_model_fields(path))  # its layer count checked against the weights' blocks
    _weight_files(path)  # before anything is built
    try:
        model = build_model(m, device="meta")
        model.to_empty(device=device)
    except (RuntimeError, TypeError, OverflowError, MemoryError) as e:  # sizes no tensor can have
        refuse(path, f"config.json describes a model that cannot be allocated ({' '.join(str(e).split())[:100]})")
    model.tie_weights()
    model.reset_buffers(device)
    load_hf_weights([model], path)
    return model, m


def to_hf(
    model: torch.nn.Module,
    m: ModelConfig,
    path: str | Path,
    tokenizer_dir: str | Path | None = None,
    eos_id: int | None = None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a model in memory as config.json + safetensors + tokenizer (see `write_hf`)."""
    sd = model.state_dict()
    return write_hf(
        m,
        {k: tuple(v.shape) for k, v in sd.items()},
        lambda names: {n: sd[n] for n in names},
        path,
        tokenizer_dir,
        eos_id,
        max_shard_bytes=max_shard_bytes,
        dtype=dtype,
    )


def write_hf(
    m: ModelConfig,
    shapes: dict[str, tuple[int, ...]],
    fetch: Callable[[list[str]], dict[str, torch.Tensor]],
    path: str | Path,
    tokenizer_dir: str | Path | None = None,
    eos_id: int | None = None,
    bos_id: int | None = None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write config.json + safetensors (sharded with an index above `max_shard_bytes`) + tokenizer,
    one shard at a time: `fetch(names)` supplies the flopwise tensors a shard needs, so peak
    memory is one shard (or the largest tensor, if larger), not the model. `bos_id`: default `eos_id`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config_from_model(m, eos_id, bos_id)
    recipes = _recipes(m)
    item = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, list[str], Callable[..., torch.Tensor]]]] = []
    current: list[tuple[str, list[str], Callable[..., torch.Tensor]]] = []
    size = 0
    for recipe in recipes:
        nbytes = sum(math.prod(shapes[n]) for n in recipe[1]) * item
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(recipe)
        size += nbytes
    shards.append(current)
    for old in path.glob("model*.safetensors*"):
        old.unlink()
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    weight_map, total = {}, 0
    for name, shard in zip(names, shards, strict=True):
        ours = fetch(sorted({n for _, inputs, _ in shard for n in inputs}))
        tensors = {
            theirs: make(*(ours[n].detach().to("cpu", dtype) for n in inputs)).contiguous()
            for theirs, inputs, make in shard
        }
        del ours
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        total += sum(v.numel() * v.element_size() for v in tensors.values())
    if len(shards) > 1:
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    if tokenizer_dir is not None:
        for name in _TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, path / name)
    return path
