"""A checkpoint (or a run's newest) as a whole model in one process, for eval and generation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from flopwise.checkpoints import checkpoint
from flopwise.checkpoints.export import checkpoint_config
from flopwise.config.schema import Config
from flopwise.data.tokenizer import GuardedTokenizer, load_tokenizer
from flopwise.model.transformer import Transformer, build_model


def load_for_inference(
    path: str | Path, device: str = "cpu", report: Callable[[str], None] | None = None
) -> tuple[Transformer, Config, GuardedTokenizer]:
    """(model, config, tokenizer) of a checkpoint folder or a run folder, in eval mode; `report`
    hears which checkpoint of a run folder is used, and why, when its newest is damaged."""
    ckpt = checkpoint.resolve(path, report)
    cfg = checkpoint_config(ckpt, checkpoint.read_state(ckpt))
    model = build_model(cfg.model, torch.device(device))
    checkpoint.load(ckpt, model)
    model.eval()
    return model, cfg, load_tokenizer(ckpt / "tokenizer.json")
