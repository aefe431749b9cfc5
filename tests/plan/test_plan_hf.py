"""`flopwise plan --hf` on real checkpoints built offline with transformers (the exact parameter
count against the checkpoint's own tensors), and `flopwise plan max-micro-batch` against the
layout search's own verdict on a small made-up device and against the engine's measured memory."""

import json
import os
import shutil

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

from flopwise.config.schema import load_config, load_tree, validate  # noqa: E402
from flopwise.measure.step import measure_rank  # noqa: E402
from flopwise.plan.planner import plan  # noqa: E402
from flopwise.plan.rank_memory import FIT_MARGIN, RUNTIME_RESERVE  # noqa: E402
from flopwise.train.build import build_run  # noqa: E402
from tests.conftest import tiny_overrides  # noqa: E402

V = 97
SMALL = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)
FAMILIES = {  # name: (config class, model class, config kwargs, max shard size for save_pretrained)
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(SMALL, num_key_value_heads=2), None),
    "llama-tied-sharded": ("LlamaConfig", "LlamaForCausalLM", dict(SMALL, tie_word_embeddings=True), "20KB"),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(SMALL, num_key_value_heads=2, sliding_window=32), None),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(SMALL, num_key_value_heads=2), None),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(SMALL, num_key_value_heads=2, head_dim=16), None),
    "neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(SMALL, rotary_pct=0.5), None),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0),
        None,
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            vocab_size=V,
            hidden_size=32,
            ffn_dim=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
        ),
        None,
    ),
}
PLAN = ["cluster.hardware=h100-sxm", "data.seq_len=64"]


def save(folder, family: tuple):
    cfg_cls, model_cls, kw, shard = family
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw))
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (folder, parameters by transformers, elements of the tensors safetensors loads back)."""
    out = {}
    for name, family in FAMILIES.items():
        folder = tmp_path_factory.mktemp(name)
        model = save(folder, family)
        saved = {}
        for f in folder.glob("*.safetensors"):
            saved.update(load_file(f))
        out[name] = (folder, sum(p.numel() for p in model.parameters()), sum(t.numel() for t in saved.values()))
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_params_equal_the_checkpoint(checkpoints, name, cli):
    folder, by_transformers, by_safetensors = checkpoints[name]
    r = cli("plan", *PLAN, "--hf", str(folder), "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["params"] == by_transformers == by_safetensors
    assert got["hf"]["elements"] == by_safetensors  # the headers alone, every shard, a tied table once
    assert got["layouts"] and got["layouts"][0]["fits"]
    if name == "llama-tied-sharded":
        assert len(list(folder.glob("*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").is_file()


def test_hf_overrides_and_search_work_as_for_a_preset(checkpoints, cli):
    """cluster.*, parallel.*, train.* and model.* overrides apply over the HF model; the text
    output states the checkpoint agrees."""
    folder, n, _ = checkpoints["llama-gqa"]
    r = cli("plan", *PLAN, "cluster.gpus=2", "parallel.tp=2", "train.global_batch=8", "--hf", str(folder), "--json")
    got = json.loads(r.stdout)
    assert got["params"] == n and got["hardware"]["gpus"] == 2 and got["model"]["global_batch"] == 8
    assert {lo["tp"] for lo in got["layouts"]} == {2}
    # the config file's model (demo: a preset) gives way to the HF one; a model.* override lands on it
    longer = json.loads(cli("plan", "demo", *PLAN, "model.n_layers=3", "--hf", str(folder), "--json").stdout)
    cls, model_cls, kw, _ = FAMILIES["llama-gqa"]
    three = getattr(transformers, model_cls)(getattr(transformers, cls)(**{**kw, "num_hidden_layers": 3}))
    assert longer["params"] == sum(p.numel() for p in three.parameters()) > n
    text = cli("plan", *PLAN, "--hf", str(folder))
    assert text.returncode == 0 and "elements = the parameter count" in text.stdout


def test_hf_config_json_alone(checkpoints, tmp_path, cli):
    """A config.json without weights plans the same model, with no checkpoint to compare."""
    folder, n, _ = checkpoints["qwen3"]
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    got = json.loads(cli("plan", *PLAN, "--hf", str(tmp_path / "config.json"), "--json").stdout)
    assert got["params"] == n and got["hf"]["model_type"] == "qwen3" and got["hf"]["elements"] is None


def test_hf_unknown_architecture_is_one_line(tmp_path, cli):
    """A state-space model has no flopwise equivalent: one line naming it and the supported ones."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 32, "vocab_size": V}))
    r = cli("plan", *PLAN, "--hf", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "'mamba'" in r.stderr and "supported: llama, mistral, qwen2, qwen3, gpt2, gpt_neox, opt" in r.stderr


def test_hf_missing_field_is_one_line(checkpoints, tmp_path, cli):
    folder, _, _ = checkpoints["llama-gqa"]
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = cli("plan", *PLAN, "--hf", str(tmp_path / "config.json"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "hidden_size" in r.stderr


# --- plan max-micro-batch -------------------------------------------------------------------------

TINY = """[tiny]
peak_flops = {bf16 = 1e14}
memory_bytes = 1.5e9
memory_bw = 1e12
intra_node_bw = 1e11
inter_node_bw = 1e10
devices_per_node = 8
source = "test: a made-up device with little memory"
"""


@pytest.fixture
def tiny_device(tmp_path):
    (tmp_path / "hw.toml").write_text(TINY)
    return ["cluster.hardware=tiny", f'cluster.hardware_file="{tmp_path / "hw.toml"}"', "train.global_batch=64"]


def search_verdict(overrides: list[str], mb: int, recompute: str) -> dict:
    """The layout search's own estimate of the config's layout at this micro-batch and recompute
    (every layout key given, so the search evaluates exactly that one)."""
    tree = load_tree(
        "demo",
        [
            *overrides,
            f"train.micro_batch={mb}",
            f'parallel.recompute="{recompute}"',
            "parallel.zero=0",
            "parallel.tp=1",
            "parallel.pp=1",
            "parallel.cp=1",
            "parallel.dp_replicate=1",
            "parallel.sequence_parallel=false",
        ],
    )
    best = plan(validate(tree), tree).best
    return {"fits": best.fits, "total": best.memory["total"]}


def test_max_micro_batch_is_the_search_boundary(tiny_device, cli):
    r = cli("plan", "max-micro-batch", "demo", *tiny_device, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["valid_micro_batches"] == [1, 2, 4, 8, 16, 32, 64]  # the divisors of the per-rank batch
    limits = {lim["recompute"]: lim for lim in got["limits"]}
    assert list(limits) == ["none", "selective", "op", "full"]
    for rc, lim in limits.items():
        mb, nxt = lim["micro_batch"], lim["next_micro_batch"]
        assert mb is not None and nxt is not None, lim  # the device's memory, not the batch, is the limit here
        fits, refused = search_verdict(tiny_device, mb, rc), search_verdict(tiny_device, nxt, rc)
        assert fits["fits"] and not refused["fits"]
        assert (lim["memory_bytes"], lim["next_memory_bytes"]) == (fits["total"], refused["total"])
        assert lim["next_memory_bytes"] > got["usable_memory_bytes"] >= lim["memory_bytes"]
    # recompute only ever frees memory
    assert limits["none"]["micro_batch"] <= limits["selective"]["micro_batch"] <= limits["full"]["micro_batch"]
    assert limits["none"]["micro_batch"] <= limits["op"]["micro_batch"] <= limits["full"]["micro_batch"]
    assert limits["none"]["micro_batch"] < limits["full"]["micro_batch"]


def test_max_micro_batch_past_the_batch_and_pipeline_rules(tiny_device, cli):
    """With a small batch every valid micro-batch fits: the table says how far a larger batch
    would go. Under pp=2 a micro-batch leaving fewer than 2 micro-batches is not offered."""
    small = [*tiny_device, "train.global_batch=4", "train.micro_batch=1"]
    got = json.loads(cli("plan", "max-micro-batch", "demo", *small, "--json").stdout)
    full = next(lim for lim in got["limits"] if lim["recompute"] == "full")
    assert full["micro_batch"] == 4 and full["next_micro_batch"] is None
    mb, gb = full["beyond"]["micro_batch"], full["beyond"]["global_batch"]
    assert mb == gb > 4
    assert search_verdict([*tiny_device, f"train.global_batch={gb}"], mb, "full")["fits"]
    assert not search_verdict([*tiny_device, f"train.global_batch={gb + 1}"], mb + 1, "full")["fits"]
    pp = cli(
        "plan",
        "max-micro-batch",
        "demo",
        *tiny_device,
        "cluster.gpus=2",
        "parallel.pp=2",
        "model.tie_embeddings=false",
        "--json",
    )
    assert pp.returncode == 0, pp.stderr
    assert json.loads(pp.stdout)["valid_micro_batches"] == [1, 2, 4, 8, 16, 32]


# One process, ZeRO-0, no recompute, eager, at a global batch whose divisors 5 and 6 are neighbours.
# LayerNorm and fp32 because the planner books the GPU engine, and only there does the CPU engine
# demo-tiny's own RMSNorm and bf16 autocast, under which a CPU keeps more than a GPU (RMSNorm's
# composite ops keep the fp32 normalised input; the attention core computes in fp32): the `cpu`
# entry books the CPU engine's tensors (plan.memory.engine_precision)
JOINT = {
    "train.dtype": '"bf16"',
    "data.seq_len": 128,
    "train.global_batch": 60,
    "train.compile": "false",
    "parallel.zero": 0,
    "parallel.recompute": '"none"',
    "train.steps": 4,
    "optim.warmup_steps": 1,
    "checkpoint.resume": '"none"',
}


@pytest.mark.slow
def test_max_micro_batch_is_where_the_engines_measured_memory_runs_out(tiny_data, tmp_path, cli):
    """`plan max-micro-batch` against the engine's measured memory (`plan measure`'s path on one
    process: build_run, then measure_rank's steps under PeakMemory): the parameters, the AdamW
    moments and the second step's high-water mark above them (which holds the gradients).

    The budget (the device's usable memory less the planner's runtime reserve, a CUDA context a CPU
    does not allocate) sits halfway between the measured totals at micro-batch 5 and 6, one
    sequence's activations (~2.4 MB of ~15 MB) apart: the answer is 5 only if the planner's bytes
    are within half a sequence's activations of the engine's at both, and an error larger than that,
    either way, moves the answer off the measured boundary. Before the `cpu` entry booked a CPU's
    tensors the planner answered 6 here (13.5 MB booked for 6, 15.2 MB measured, 14.2 MB budget)."""
    measured: dict[int, int] = {}

    def total(mb: int) -> int:
        if mb not in measured:
            keys = tiny_overrides(tmp_path / f"mb{mb}", tiny_data, **JOINT, **{"train.micro_batch": mb})
            m = measure_rank(build_run(load_config(None, keys)), 2, collectives=False)
            measured[mb] = m["params"] + m["optimizer"] + m["peak"]
        return measured[mb]

    budget = (total(5) + total(6)) / 2
    memory = (budget + RUNTIME_RESERVE) / (1 - FIT_MARGIN)
    cpu = TINY.replace("[tiny]", "[cpu]").replace("memory_bytes = 1.5e9", f"memory_bytes = {memory!r}")
    (tmp_path / "hw.toml").write_text(cpu)
    r = cli(
        "plan",
        "max-micro-batch",
        *tiny_overrides(tmp_path / "plan", tiny_data, **JOINT),
        "cluster.hardware=cpu",
        f'cluster.hardware_file="{tmp_path / "hw.toml"}"',
        "--json",
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["usable_memory_bytes"] - got["assumptions"]["runtime_reserve_bytes"] == pytest.approx(budget)
    lim = next(lim for lim in got["limits"] if lim["recompute"] == "none")
    mb, nxt = lim["micro_batch"], lim["next_micro_batch"]
    assert total(mb) <= budget < total(nxt), (lim, measured, budget)
