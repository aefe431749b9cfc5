import subprocess

import pytest
import torch

from flopwise.config.schema import ModelConfig
from flopwise.errors import DataError
from flopwise.eval.generate import generate_tokens
from flopwise.eval.load import load_for_inference
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


TEXT = "Alice was beginning to get very tired of sitting by her sister on the bank. " * 20


@pytest.fixture(scope="module")
def run_dir(tiny_run):
    return tiny_run(12)


@pytest.mark.slow
def test_generation_stops_where_transformers_max_length_stops(run_dir, tmp_path):
    """Prompt and output fill at most max_seq_len, as transformers' generate with max_length = the
    model's length, with or without the cache; a prompt that leaves no room is refused as it refuses it."""
    transformers = pytest.importorskip("transformers")
    from flopwise.interop.convert import export_hf

    model, cfg, tok = load_for_inference(run_dir)
    L = cfg.model.max_seq_len
    ids = tok.encode(TEXT).ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(run_dir, tmp_path / "hf")).eval()
    prompt = ids[: L - 5]
    ref = hf.generate(torch.tensor([prompt]), max_length=L, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = ref[0, len(prompt) :].tolist()
    assert len(ref) == 5
    assert generate_tokens(model, prompt, 20, temperature=0.0) == ref
    assert generate_tokens(model, prompt, 20, temperature=0.0, use_cache=False) == ref  # was 20: a sliding window
    with pytest.raises(ValueError, match=f"Input length of input_ids is {L}"):
        hf.generate(torch.tensor([ids[:L]]), max_length=L, do_sample=False, eos_token_id=None, pad_token_id=0)
    with pytest.raises(DataError, match=f"prompt is {L} tokens .*max_seq_len={L}.* at most {L - 1} tokens"):
        generate_tokens(model, ids[:L], 5)
    with pytest.raises(DataError, match="prompt is empty"):
        generate_tokens(model, [], 5)


def test_generate_cli_context_limit_and_empty_prompt(run_dir, cli):
    _, cfg, tok = load_for_inference(run_dir)
    L = cfg.model.max_seq_len
    ids = tok.encode(TEXT).ids

    def gen(prompt: str, n: int) -> subprocess.CompletedProcess:
        return cli("generate", run_dir, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", n)

    long = tok.decode(ids[: L + 10])
    r = gen(long, 5)  # was: the prompt's last L tokens echoed back, exit 0, no message
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"prompt is {len(tok.encode(long).ids)} tokens" in r.stderr and f"max_seq_len={L}" in r.stderr
    r = gen("", 5)  # was: ValueError with a traceback
    assert r.returncode == 2 and "prompt is empty" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    near = tok.decode(ids[: L - 3])
    n = len(tok.encode(near).ids)
    r = gen(near, 50)  # was: cut to L - n new tokens without a word
    assert r.returncode == 0 and r.stdout.startswith(near[:40]), r.stderr
    assert r.stderr.strip() == (
        f"note: stopped after {L - n} new tokens at the model's context limit "
        f"(max_seq_len={L}, the prompt is {n} tokens)"
    )
