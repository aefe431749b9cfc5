import torch

from flopwise.config import ModelConfig
from flopwise.eval.perplexity import text_loss
from flopwise.model.transformer import build_model
from flopwise.train.engine import lm_loss


def test_text_loss_scores_every_token_once_and_matches_the_training_loss():
    model = build_model(ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=50, max_seq_len=16), seed=0)
    ids = torch.randint(0, 50, (45,)).tolist()
    r = text_loss(model, ids, seq_len=16, batch=2)
    assert r["tokens"] == len(ids) - 1
    one = text_loss(model, ids[:17], seq_len=16)
    ref = lm_loss(model, torch.tensor([ids[:17]]), torch.device("cpu"), "fp32").item()
    assert abs(one["loss"] - ref) < 1e-6
