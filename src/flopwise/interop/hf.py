"""Hugging Face interchange of weights: safetensors (single file or sharded with an index) +
tokenizer files, both ways, for the Llama (1/2/3, rope scaling), Mistral, Qwen3, GPT-2, GPT-NeoX
and OPT families. Needs no `transformers` import: the formats are read and written directly
(the config mapping is in hf_config.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flopwise.config import ModelConfig
from flopwise.errors import CheckpointError
from flopwise.interop.hf_config import LLAMA_LIKE, _fail, hf_config_from_model, model_config_from_hf, read_hf_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "generation_config.json")
# --- weights ---------------------------------------------------------------------------------


def _with_bias(f: str, h: str, table) -> list[tuple[str, str]]:
    """Weight and bias pairs for modules named `a` here and `b` there, under prefixes f and h."""
    return [(f + a + suffix, h + b + suffix) for a, b in table for suffix in (".weight", ".bias")]


def _names(m: ModelConfig) -> list[tuple[str, str]]:
    """(flopwise name, HF name) for every tensor that maps one to one."""
    pairs = []
    if m.arch in LLAMA_LIKE:
        pairs += [("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]
        if not m.tie_embeddings:
            pairs.append(("output.weight", "lm_head.weight"))
        for i in range(m.n_layers):
            f, h = f"layers.{i}.", f"model.layers.{i}."
            pairs += [(f + "attention.wq.weight", h + "self_attn.q_proj.weight"),
                      (f + "attention.wk.weight", h + "self_attn.k_proj.weight"),
                      (f + "attention.wv.weight", h + "self_attn.v_proj.weight"),
                      (f + "attention.wo.weight", h + "self_attn.o_proj.weight"),
                      (f + "feed_forward.w1.weight", h + "mlp.gate_proj.weight"),
                      (f + "feed_forward.w3.weight", h + "mlp.up_proj.weight"),
                      (f + "feed_forward.w2.weight", h + "mlp.down_proj.weight"),
                      (f + "attention_norm.weight", h + "input_layernorm.weight"),
                      (f + "ffn_norm.weight", h + "post_attention_layernorm.weight")]
            if m.qk_norm:
                pairs += [(f + "attention.q_norm.weight", h + "self_attn.q_norm.weight"),
                          (f + "attention.k_norm.weight", h + "self_attn.k_norm.weight")]
    elif m.arch == "gpt2":
        pairs += [("tok_embeddings.weight", "transformer.wte.weight"), ("pos_embeddings.weight", "transformer.wpe.weight")]
        pairs += _with_bias("", "transformer.", (("norm", "ln_f"),))
        for i in range(m.n_layers):
            f, h = f"layers.{i}.", f"transformer.h.{i}."
            pairs += _with_bias(f, h, (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")))
            pairs += [(f + "attention.wo.bias", h + "attn.c_proj.bias"), (f + "feed_forward.w1.bias", h + "mlp.c_fc.bias"),
                      (f + "feed_forward.w2.bias", h + "mlp.c_proj.bias")]
    elif m.arch == "neox":
        pairs += [("tok_embeddings.weight", "gpt_neox.embed_in.weight")]
        pairs += _with_bias("", "gpt_neox.", (("norm", "final_layer_norm"),))
        if not m.tie_embeddings:
            pairs.append(("output.weight", "embed_out.weight"))
        for i in range(m.n_layers):
            pairs += _with_bias(f"layers.{i}.", f"gpt_neox.layers.{i}.", (
                ("attention_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                ("attention.wo", "attention.dense"), ("feed_forward.w1", "mlp.dense_h_to_4h"),
                ("feed_forward.w2", "mlp.dense_4h_to_h")))
    elif m.arch == "opt":
        pairs += [("tok_embeddings.weight", "model.decoder.embed_tokens.weight"),
                  ("pos_embeddings.weight", "model.decoder.embed_positions.weight")]
        pairs += _with_bias("", "model.decoder.", (("norm", "final_layer_norm"),))
        if not m.tie_embeddings:
            pairs.append(("output.weight", "lm_head.weight"))
        for i in range(m.n_layers):
            pairs += _with_bias(f"layers.{i}.", f"model.decoder.layers.{i}.", (
                ("attention_norm", "self_attn_layer_norm"), ("ffn_norm", "final_layer_norm"),
                ("attention.wq", "self_attn.q_proj"), ("attention.wk", "self_attn.k_proj"),
                ("attention.wv", "self_attn.v_proj"), ("attention.wo", "self_attn.out_proj"),
                ("feed_forward.w1", "fc1"), ("feed_forward.w2", "fc2")))
    return pairs


def _fused_to_flopwise(m: ModelConfig, hf: dict[str, torch.Tensor], sd: dict[str, torch.Tensor]) -> None:
    """Split HF's fused attention tensors (GPT-2 c_attn, NeoX query_key_value) and transpose Conv1D."""
    d, hd, nh = m.d_model, m.head_dim, m.n_heads
    for i in range(m.n_layers):
        f = f"layers.{i}."
        if m.arch == "gpt2":
            h = f"transformer.h.{i}."
            w, b = hf[h + "attn.c_attn.weight"].t(), hf[h + "attn.c_attn.bias"]  # Conv1D stores (in, out)
            for name, wi, bi in zip(("wq", "wk", "wv"), w.split(d, 0), b.split(d, 0)):
                sd[f + f"attention.{name}.weight"], sd[f + f"attention.{name}.bias"] = wi, bi
            sd[f + "attention.wo.weight"] = hf[h + "attn.c_proj.weight"].t()
            sd[f + "feed_forward.w1.weight"] = hf[h + "mlp.c_fc.weight"].t()
            sd[f + "feed_forward.w2.weight"] = hf[h + "mlp.c_proj.weight"].t()
        elif m.arch == "neox":
            h = f"gpt_neox.layers.{i}."
            w = hf[h + "attention.query_key_value.weight"].view(nh, 3, hd, d)  # per head: q, k, v
            b = hf[h + "attention.query_key_value.bias"].view(nh, 3, hd)
            for k, name in enumerate(("wq", "wk", "wv")):
                sd[f + f"attention.{name}.weight"] = w[:, k].reshape(nh * hd, d)
                sd[f + f"attention.{name}.bias"] = b[:, k].reshape(nh * hd)


def _flopwise_to_fused(m: ModelConfig, sd: dict[str, torch.Tensor], hf: dict[str, torch.Tensor]) -> None:
    d, hd, nh = m.d_model, m.head_dim, m.n_heads
    for i in range(m.n_layers):
        f = f"layers.{i}."
        q, k, v = (sd[f + f"attention.{n}.weight"] for n in ("wq", "wk", "wv"))
        qb, kb, vb = (sd[f + f"attention.{n}.bias"] for n in ("wq", "wk", "wv"))
        if m.arch == "gpt2":
            h = f"transformer.h.{i}."
            hf[h + "attn.c_attn.weight"] = torch.cat([q, k, v], 0).t()
            hf[h + "attn.c_attn.bias"] = torch.cat([qb, kb, vb])
            hf[h + "attn.c_proj.weight"] = sd[f + "attention.wo.weight"].t()
            hf[h + "mlp.c_fc.weight"] = sd[f + "feed_forward.w1.weight"].t()
            hf[h + "mlp.c_proj.weight"] = sd[f + "feed_forward.w2.weight"].t()
        elif m.arch == "neox":
            h = f"gpt_neox.layers.{i}."
            hf[h + "attention.query_key_value.weight"] = torch.stack(
                [t.view(nh, hd, d) for t in (q, k, v)], 1).reshape(3 * nh * hd, d)
            hf[h + "attention.query_key_value.bias"] = torch.stack(
                [t.view(nh, hd) for t in (qb, kb, vb)], 1).reshape(3 * nh * hd)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError):
            _fail(path, "model.safetensors.index.json has no weight_map")
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        _fail(path, "no model.safetensors or model.safetensors.index.json (pickled .bin weights are refused)")
    tensors = {}
    for name in files:
        if Path(name).name != name:
            _fail(path, f"index names a file outside the folder: {name!r}")
        try:
            with safe_open(str(path / name), framework="pt") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for damaged files
            _fail(path, f"{name} is not a readable safetensors file ({str(e).splitlines()[0][:100]})")
    return tensors


def from_hf(path: str | Path, device: str = "cpu"):
    """(model, model_config) from a Hugging Face folder; fp32 weights on `device`."""
    from flopwise.model.transformer import build_model

    path = Path(path)
    hf_cfg = read_hf_config(path)
    try:
        m = model_config_from_hf(hf_cfg, path)
    except KeyError as e:
        _fail(path, f"config.json lacks {e}")
    hf = read_safetensors(path)
    sd: dict[str, torch.Tensor] = {}
    for ours, theirs in _names(m):
        if theirs not in hf:
            _fail(path, f"missing tensor {theirs}")
        sd[ours] = hf[theirs]
    if m.arch in ("gpt2", "neox"):
        try:
            _fused_to_flopwise(m, hf, sd)
        except KeyError as e:
            _fail(path, f"missing tensor {e}")
    model = build_model(m, device="meta")
    expected = set(model.state_dict())
    if m.tie_embeddings:
        expected.discard("output.weight")
    if set(sd) != expected:
        _fail(path, f"tensors do not match the architecture (missing {sorted(expected - set(sd))[:3]}, "
                    f"unexpected {sorted(set(sd) - expected)[:3]})")
    model.to_empty(device=device)
    model.tie_weights()
    model.reset_buffers()
    model.to(device)
    try:
        model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False, assign=False)
    except RuntimeError as e:
        _fail(path, f"tensor shapes do not match config.json ({str(e).splitlines()[-1][:150]})")
    return model, m


def to_hf(model: torch.nn.Module, m: ModelConfig, path: str | Path, tokenizer_dir: str | Path | None = None,
          eos_id: int | None = None, max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json + safetensors (sharded with an index above `max_shard_bytes`) + tokenizer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config_from_model(m, eos_id)
    sd = {k: v.detach().to("cpu", dtype) for k, v in model.state_dict().items()}
    hf: dict[str, torch.Tensor] = {}
    for ours, theirs in _names(m):
        hf[theirs] = sd[ours]
    if m.arch in ("gpt2", "neox"):
        _flopwise_to_fused(m, sd, hf)
    hf = {k: v.contiguous().clone() for k, v in hf.items()}
    shards, current, size = [], {}, 0
    for k, v in hf.items():
        nbytes = v.numel() * v.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[k] = v
        size += nbytes
    shards.append(current)
    for old in path.glob("model*.safetensors*"):
        old.unlink()
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in hf.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, path / name)
    return path
