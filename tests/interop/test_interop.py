"""Hugging Face parity: logits equal to transformers' for every supported family, both ways."""

import json
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

from flopwise.config.schema import load_config  # noqa: E402
from flopwise.errors import CheckpointError, ConfigError  # noqa: E402
from flopwise.eval.generate import generate_tokens  # noqa: E402
from flopwise.eval.load import load_for_inference  # noqa: E402
from flopwise.interop.convert import export_hf, import_hf  # noqa: E402
from flopwise.interop.hf import from_hf, to_hf  # noqa: E402
from flopwise.train.launch import train  # noqa: E402
from tests.conftest import tiny_overrides  # noqa: E402

V, S = 128, 40
LLAMA = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA),
    "llama3-rope-scaling": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            LLAMA,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(LLAMA, sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", LLAMA),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(LLAMA, head_dim=32, tie_word_embeddings=True)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            vocab_size=V,
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            rotary_pct=0.25,
        ),
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            vocab_size=V,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
        ),
    ),
}


def hf_model(family):
    cfg_cls, model_cls, kw = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw)).eval()
    with torch.no_grad():  # perturb every tensor, norms and biases included, so no mapping error hides
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(params=list(FAMILIES), ids=list(FAMILIES))
def family(request):
    return request.param


def test_from_hf_logits_match_transformers(family, tmp_path):
    ref = hf_model(family)
    ref.save_pretrained(tmp_path)
    model, m = from_hf(tmp_path)
    x = torch.randint(0, V, (2, S))
    with torch.no_grad():
        assert (model(x) - ref(input_ids=x).logits).abs().max() < 1e-4
    if family == "mistral-window":
        assert m.sliding_window == 8 and S > 8
    if family == "llama3-rope-scaling":
        assert m.rope_scaling.factor == 8.0 and m.rope_theta == 500000.0


def test_to_hf_round_trip_loads_in_transformers(family, tmp_path):
    ref = hf_model(family)
    ref.save_pretrained(tmp_path / "src")
    model, m = from_hf(tmp_path / "src")
    to_hf(model, m, tmp_path / "out", max_shard_bytes=60_000)  # small shards: exercise the index
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = torch.randint(0, V, (2, S))
    with torch.no_grad():
        assert (again(input_ids=x).logits - model(x)).abs().max() < 1e-4
    model2, m2 = from_hf(tmp_path / "out")  # and back again, sharded
    assert m2 == m
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True)
    )


def test_trained_demo_checkpoint_exports_and_generates_the_same_text(tiny_run, tmp_path):
    out = export_hf(tiny_run(12), tmp_path / "hf")
    model, cfg, tok = load_for_inference(tiny_run(12))
    prompt = tok.encode("Alice was").ids
    ours = generate_tokens(model, prompt, 20, temperature=0.0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = hf_tok("Alice was", return_tensors="pt").input_ids
    assert ids[0].tolist() == prompt
    gen = hf.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert gen[0, len(prompt) :].tolist() == ours
    assert hf_tok.decode(gen[0]) == tok.decode(prompt + ours)


@pytest.mark.slow
def test_import_then_continue_training_from_hf(tiny_data, tmp_path):
    cfg_cls, model_cls, kw = FAMILIES["llama"]
    torch.manual_seed(0)
    ref = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**kw, "vocab_size": 512})).eval()
    ref.save_pretrained(tmp_path / "hf")
    ckpt = import_hf(tmp_path / "hf", tmp_path / "imported")
    assert ckpt.name == "step-00000000" and (ckpt / "manifest.json").is_file()
    # continued pretraining: shape and weights from the HF folder, the data's tokenizer given explicitly
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / "cont",
            tiny_data,
            **{
                "model.init_from": f'"hf:{tmp_path / "hf"}"',
                "train.steps": 2,
                "optim.warmup_steps": 1,
                "data.tokenizer": f'"{tiny_data / "tokenizer.json"}"',
            },
        ),
    )
    assert (cfg.model.n_kv_heads, cfg.model.ffn_dim, cfg.model.vocab_size) == (2, 96, 512)
    result = train(cfg)
    from flopwise.data.loader import TokenLoader

    batch = TokenLoader(tiny_data, "train", 32, 8, cfg.run.seed).next_batch()
    with torch.no_grad():
        logits = ref(input_ids=batch[:, :-1]).logits
    first = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert result.losses[0] == pytest.approx(first, rel=1e-5)  # step 1 ran on the HF weights


def test_continued_pretraining_keeps_the_hf_tokenizer(tmp_path):
    """The demo config with model.init_from takes the HF folder's tokenizer; a bpe: spec (a new
    tokenizer, whose ids the HF embeddings were not trained on) is refused in one line."""
    hf_model("llama").save_pretrained(tmp_path / "hf")
    init = f'model.init_from="hf:{tmp_path / "hf"}"', "data.seq_len=32"
    assert load_config("demo", [*init]).data.tokenizer == str(tmp_path / "hf" / "tokenizer.json")
    with pytest.raises(ConfigError, match="ids mean nothing to the embeddings"):
        load_config("demo", [*init, 'data.tokenizer="bpe:4096"'])


def test_unsupported_fields_are_refused(tmp_path):
    ref = hf_model("llama")
    ref.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for bad, fragment in [
        ({"model_type": "falcon"}, "not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
        ({"hidden_act": "gelu"}, "non-SiLU"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(CheckpointError, match=fragment):
            from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="pickled .bin weights are refused"):
        from_hf(tmp_path)
