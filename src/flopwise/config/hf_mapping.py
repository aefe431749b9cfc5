"""Hugging Face `config.json` <-> flopwise `model.*` fields, both ways. Pure Python (no torch) and
below the config tree (it imports no flopwise type), so flopwise.config.schema can resolve
`model.init_from="hf:PATH"` like a preset and validate the fields it gets.

Every field that would change the computation is mapped or refused with a clear error; a
conversion never silently drops one.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, NoReturn

from flopwise.errors import CheckpointError

LLAMA_LIKE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def refuse(path: Any, msg: str) -> NoReturn:
    raise CheckpointError(f"Hugging Face folder {path}: {msg}")


def check_inside(folder: str | Path) -> None:
    """A handed Hugging Face folder is read only inside itself: a file at its top level that is a
    symbolic link leaving it (a `chat_template.jinja` pointing at ~/.aws/credentials would be copied
    into every checkpoint and export) is refused in one line. The hub cache's own links, from a
    snapshot into its repository's blobs/, stay inside the download."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    root = Path(os.path.realpath(folder))
    inside = [root, *([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])]
    for entry in sorted(folder.iterdir()):
        target = Path(os.path.realpath(entry))
        if entry.is_symlink() and not any(target.is_relative_to(a) for a in inside):
            refuse(
                folder,
                f"{entry.name} is a symbolic link to {target}, outside the folder; flopwise reads nothing outside "
                "a handed folder: copy the file in, or remove the link",
            )


def read_hf_config(path: str | Path) -> dict:
    """The config.json of an HF folder (checked to reach nothing outside it), or `path` itself when
    it is a JSON file."""
    check_inside(path)
    p = Path(path) if Path(path).is_file() else Path(path) / "config.json"
    if not p.is_file():
        refuse(Path(path), "no config.json")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        refuse(Path(path), "config.json is not valid JSON")
    if not isinstance(cfg, dict):
        refuse(Path(path), "config.json is not a JSON object")
    return cfg


_MAX_HEADER = 100_000_000  # bytes: the safetensors format's own limit on a header (MAX_HEADER_SIZE)


def _header_shapes(folder: Path, name: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors in one safetensors file, from its header alone (an 8-byte
    little-endian length, then JSON): a 70B checkpoint costs kilobytes, not its weights."""
    try:
        with open(folder / name, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= _MAX_HEADER:
                raise ValueError(f"header length {n}")
            header = json.loads(f.read(n))
        return {key: tuple(int(d) for d in entry["shape"]) for key, entry in header.items() if key != "__metadata__"}
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError, OverflowError) as e:
        refuse(folder, f"{name} is not a readable safetensors file ({type(e).__name__}: {str(e)[:80]})")


def weight_map(path: str | Path) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it, as transformers reads a folder: the
    index's weight_map, else the names in model.safetensors; empty for a bare config. The one
    reader of the index, for the planner (torch-free) and interop.hf's loader alike."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(files, dict) or not all(isinstance(f, str) for f in files.values()):
                raise TypeError
        except (ValueError, UnicodeDecodeError, KeyError, TypeError):
            refuse(folder, "model.safetensors.index.json has no weight_map of tensor -> file")
        outside = sorted(f for f in set(files.values()) if Path(f).name != f)
        if outside:
            refuse(folder, f"model.safetensors.index.json names a file outside the folder: {outside[0]!r}")
        return files
    if (folder / "model.safetensors").is_file():
        return dict.fromkeys(_header_shapes(folder, "model.safetensors"), "model.safetensors")
    return {}


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in an HF folder's safetensors files, read from their headers
    alone. A tensor stored once (tied weights) is counted once."""
    folder, shapes = Path(path), {}
    for name in sorted(set(weight_map(folder).values())):
        shapes.update(_header_shapes(folder, name))
    return shapes


_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")  # the block index in an HF tensor name (model.layers.3., h.3.)


def check_layers(path: str | Path, n_layers: int) -> None:
    """A folder with weights holds the blocks its config.json counts: each of 0..n_layers-1 and no
    other, checked from the safetensors headers before any model is built (a config claiming 1e9
    layers would otherwise build for ever). A bare config (no weights) is not checked here."""
    if not Path(path).is_dir():
        return
    shapes = tensor_shapes(path)
    found = {int(m.group(1)) for name in shapes if (m := _LAYER.search(name))}
    if shapes and (len(found) != n_layers or max(found, default=-1) != n_layers - 1):  # i.e. not 0..n_layers-1
        held = f"blocks 0-{max(found)} ({len(found)} of them)" if found else "no numbered blocks"
        refuse(path, f"config.json counts {n_layers:,} layers but its safetensors hold {held}; fix num_hidden_layers")


# --- config ----------------------------------------------------------------------------------


def _rope(cfg: dict, path) -> tuple[float, dict | None]:
    """(theta, llama-3 scaling) from v5 `rope_parameters` or legacy `rope_theta`/`rope_scaling`."""
    rp = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rp.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        refuse(path, f"rope type {kind!r} is not supported (only default and llama3)")
    src = {**legacy, **rp}
    return float(theta), dict(
        factor=src["factor"],
        low_freq_factor=src["low_freq_factor"],
        high_freq_factor=src["high_freq_factor"],
        original_max_seq_len=src["original_max_position_embeddings"],
    )


def model_fields(cfg: dict, path: Any = "") -> dict:
    """The flopwise `model.*` fields of an HF config.json (not yet validated: flopwise.config.schema does
    that); a field that would change the computation and has no flopwise equivalent is refused."""
    mt = cfg.get("model_type")
    if mt in LLAMA_LIKE:
        return _llama_fields(cfg, mt, path)
    readers = {"gpt2": _gpt2_fields, "gpt_neox": _neox_fields, "opt": _opt_fields}
    if mt not in readers:
        refuse(
            path, f"model_type {mt!r} is not supported (supported: llama, mistral, qwen2, qwen3, gpt2, gpt_neox, opt)"
        )
    return readers[mt](cfg, path)


def _llama_fields(cfg: dict, mt: str, path: Any) -> dict:
    """Llama, Mistral, Qwen2 and Qwen3: RMSNorm, SwiGLU, RoPE; Qwen2's q/k/v biases, Mistral's window."""
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias") or (cfg.get("attention_bias") and mt != "qwen3"):
        refuse(path, "biases or a non-SiLU activation in a Llama-family config are not supported")
    if cfg.get("attention_bias"):
        refuse(path, "attention_bias=true is not supported")
    theta, scaling = _rope(cfg, path)
    window = cfg.get("sliding_window") if (mt == "mistral" or cfg.get("use_sliding_window")) else None
    if mt in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        refuse(path, f"{mt} sliding-window layers (use_sliding_window=true) are not supported")
    return dict(
        arch=mt,
        n_layers=cfg["num_hidden_layers"],
        d_model=cfg["hidden_size"],
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        ffn_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_seq_len=cfg["max_position_embeddings"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_window=window,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=mt == "qwen2",
    )


def _gpt2_fields(cfg: dict, path: Any) -> dict:
    """GPT-2: LayerNorm, tanh-GELU MLP, learned positions, biases, a tied head."""
    if cfg.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        refuse(path, f"GPT-2 activation {cfg.get('activation_function')!r} is not supported (gelu_new)")
    if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn"):
        refuse(path, "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
    return dict(
        arch="gpt2",
        n_layers=cfg["n_layer"],
        d_model=cfg["n_embd"],
        n_heads=cfg["n_head"],
        ffn_dim=cfg.get("n_inner") or 4 * cfg["n_embd"],
        vocab_size=cfg["vocab_size"],
        max_seq_len=cfg["n_positions"],
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def _neox_fields(cfg: dict, path: Any) -> dict:
    """GPT-NeoX (Pythia): parallel residual blocks, partial rotary, biases."""
    if cfg.get("hidden_act", "gelu") != "gelu":
        refuse(path, f"GPT-NeoX activation {cfg.get('hidden_act')!r} is not supported (gelu)")
    theta, scaling = _rope({**cfg, "rope_theta": cfg.get("rotary_emb_base", cfg.get("rope_theta", 10000.0))}, path)
    rp = cfg.get("rope_parameters") or {}
    return dict(
        arch="neox",
        n_layers=cfg["num_hidden_layers"],
        d_model=cfg["hidden_size"],
        n_heads=cfg["num_attention_heads"],
        ffn_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_seq_len=cfg["max_position_embeddings"],
        norm_eps=cfg.get("layer_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_pct=rp.get("partial_rotary_factor", cfg.get("rotary_pct", 0.25)),
        parallel_block=bool(cfg.get("use_parallel_residual", True)),
        bias=bool(cfg.get("attention_bias", True)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _opt_fields(cfg: dict, path: Any) -> dict:
    """OPT (125m-style: pre-layer-norm, unprojected embedding): ReLU MLP, learned positions, biases."""
    if (
        not cfg.get("do_layer_norm_before", True)
        or cfg.get("word_embed_proj_dim", cfg["hidden_size"]) != cfg["hidden_size"]
    ):
        refuse(path, "OPT with post-layer-norm or a projected embedding (opt-350m style) is not supported")
    if cfg.get("activation_function", "relu") != "relu" or not cfg.get("enable_bias", True):
        refuse(path, "OPT without biases or with a non-ReLU activation is not supported")
    return dict(
        arch="opt",
        n_layers=cfg["num_hidden_layers"],
        d_model=cfg["hidden_size"],
        n_heads=cfg["num_attention_heads"],
        ffn_dim=cfg["ffn_dim"],
        vocab_size=cfg["vocab_size"],
        max_seq_len=cfg["max_position_embeddings"],
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def hf_config_from_model(m, eos_id: int | None = None, bos_id: int | None = None) -> dict:
    """The HF config.json of a flopwise ModelConfig `m` (any object with its fields); `bos_id`
    defaults to `eos_id` (a flopwise-trained tokenizer's end-of-text token does both)."""
    base = {"vocab_size": m.vocab_size, "tie_word_embeddings": m.tie_embeddings, "torch_dtype": "float32"}
    if eos_id is not None:
        base.update(eos_token_id=eos_id, bos_token_id=eos_id if bos_id is None else bos_id)
    if m.arch in LLAMA_LIKE:
        return _hf_llama(m, base)
    writers = {"gpt2": _hf_gpt2, "neox": _hf_neox, "opt": _hf_opt}
    if m.arch not in writers:
        raise CheckpointError(
            f"to_hf: arch {m.arch!r} has no Hugging Face export here "
            "(supported: llama, mistral, qwen2, qwen3, gpt2, neox, opt)"
        )
    return writers[m.arch](m, base)


def _exportable(m, cond: bool, what: str) -> None:
    """Refuse an export whose `what` has no Hugging Face equivalent for m.arch."""
    if not cond:
        raise CheckpointError(f"to_hf: arch {m.arch!r} with {what} has no Hugging Face equivalent")


def _hf_llama(m, base: dict) -> dict:
    """Llama, Mistral, Qwen2, Qwen3: the rope parameters in both the current and the legacy keys."""
    _exportable(
        m,
        m.norm == "rmsnorm"
        and m.mlp == "swiglu"
        and m.pos == "rope"
        and not m.bias
        and not m.parallel_block
        and not m.embed_norm
        and m.rotary_pct == 1.0,
        "these norm/mlp/pos/bias settings",
    )
    _exportable(m, m.qk_norm == (m.arch == "qwen3"), f"qk_norm={m.qk_norm}")
    _exportable(m, m.qkv_bias == (m.arch == "qwen2"), f"qkv_bias={m.qkv_bias}")
    _exportable(m, m.arch == "mistral" or not m.sliding_window, "a sliding window")
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    legacy_scaling = None
    if m.rope_scaling:
        s = m.rope_scaling
        rope.update(
            rope_type="llama3",
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_seq_len,
        )
        legacy_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    cfg = {
        **base,
        "model_type": m.arch,
        "architectures": [LLAMA_LIKE[m.arch]],
        "hidden_size": m.d_model,
        "intermediate_size": m.ffn_dim,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_parameters": rope,
        "rope_theta": m.rope_theta,
    }
    if legacy_scaling:
        cfg["rope_scaling"] = legacy_scaling
    if m.arch == "mistral":
        cfg["sliding_window"] = m.sliding_window
    if m.arch in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None)
    return cfg


def _hf_gpt2(m, base: dict) -> dict:
    _exportable(
        m,
        m.norm == "layernorm"
        and m.mlp == "gelu_tanh"
        and m.pos == "learned"
        and m.bias
        and m.tie_embeddings
        and m.head_dim * m.n_heads == m.d_model
        and m.n_kv_heads == m.n_heads,
        "this configuration",
    )
    return {
        **base,
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": m.n_layers,
        "n_embd": m.d_model,
        "n_head": m.n_heads,
        "n_inner": m.ffn_dim,
        "n_positions": m.max_seq_len,
        "layer_norm_epsilon": m.norm_eps,
        "activation_function": "gelu_new",
    }


def _hf_neox(m, base: dict) -> dict:
    _exportable(
        m,
        m.norm == "layernorm"
        and m.mlp == "gelu"
        and m.pos == "rope"
        and m.bias
        and m.n_kv_heads == m.n_heads
        and m.head_dim * m.n_heads == m.d_model
        and not m.rope_scaling,
        "this configuration",
    )
    return {
        **base,
        "model_type": "gpt_neox",
        "architectures": ["GPTNeoXForCausalLM"],
        "hidden_size": m.d_model,
        "intermediate_size": m.ffn_dim,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "max_position_embeddings": m.max_seq_len,
        "layer_norm_eps": m.norm_eps,
        "hidden_act": "gelu",
        "use_parallel_residual": m.parallel_block,
        "attention_bias": True,
        "rotary_pct": m.rotary_pct,
        "rotary_emb_base": m.rope_theta,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": m.rope_theta,
            "partial_rotary_factor": m.rotary_pct,
        },
    }


def _hf_opt(m, base: dict) -> dict:
    _exportable(
        m,
        m.norm == "layernorm"
        and m.mlp == "relu"
        and m.pos == "learned"
        and m.pos_offset == 2
        and m.bias
        and m.n_kv_heads == m.n_heads
        and m.head_dim * m.n_heads == m.d_model,
        "this configuration",
    )
    return {
        **base,
        "model_type": "opt",
        "architectures": ["OPTForCausalLM"],
        "hidden_size": m.d_model,
        "ffn_dim": m.ffn_dim,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "max_position_embeddings": m.max_seq_len,
        "word_embed_proj_dim": m.d_model,
        "do_layer_norm_before": True,
        "activation_function": "relu",
        "enable_bias": True,
    }
