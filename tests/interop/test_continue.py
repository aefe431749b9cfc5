"""Continuing a real model as users do: a tiny Llama instruct model built with
transformers' own classes and a real HF tokenizer (bos/eos special tokens, a chat template in
tokenizer_config.json), imported, continued, evaluated and exported; each trap a user met there is
a test, and transformers (AutoTokenizer, LlamaForCausalLM) is the reference."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from typer.testing import CliRunner

from flopwise.cli import app
from flopwise.config.schema import load_config
from flopwise.data.shards import resolve_input
from flopwise.errors import CheckpointError, ConfigError, DataError

# every test builds on a small instruct model trained with transformers (a module fixture of ~40 s
# here) or trains itself: the whole file is the continued-pretraining workflow, end to end
pytestmark = [pytest.mark.slow, pytest.mark.e2e]

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM-Instruct: bos 1, eos 2
CONTEXT = 128
CHAT = [{"role": "user", "content": "Who is Alice?"}, {"role": "assistant", "content": "A girl."}]


def _bpe(text: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [text],
        trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tok


@pytest.fixture(scope="module")
def instruct(tmp_path_factory) -> Path:
    """An HF folder as an instruct model ships: LlamaForCausalLM (tied embeddings, GQA) pretrained
    briefly on Alice with a 512-token BPE, its tokenizer files (chat template inside
    tokenizer_config.json), generation_config.json with bos 1 / eos 2."""
    out = tmp_path_factory.mktemp("instruct") / "hf"
    text = resolve_input("builtin:alice").read_text()
    tok = _bpe(text)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=CHATML,
        model_max_length=CONTEXT,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=CONTEXT,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            rms_norm_eps=1e-5,
        )
    )
    ids = torch.tensor(tok.encode(text).ids)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        x = torch.stack([ids[i : i + 65] for i in torch.randint(0, len(ids) - 65, (16,), generator=g)])
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=False)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    if (out / "chat_template.jinja").is_file():  # transformers 5 writes it apart; an instruct model has it here
        cfg["chat_template"] = (out / "chat_template.jinja").read_text()
        (out / "chat_template.jinja").unlink()
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return out


@pytest.fixture(scope="module")
def user_text(tmp_path_factory) -> Path:
    """The user's own text (two plays, another domain than the model's Alice) and a held-out play."""
    d = tmp_path_factory.mktemp("text")
    (d / "train").mkdir()
    for name in ("macbeth_gut.txt", "julius_caesar_gut.txt"):
        shutil.copy(resolve_input("builtin:shakespeare") / name, d / "train" / name)
    (d / "heldout.txt").write_text((resolve_input("builtin:shakespeare") / "tempest_gut.txt").read_text()[:40_000])
    return d


@pytest.fixture(scope="module")
def prepared(instruct, user_text, tmp_path_factory) -> Path:
    """The user's text prepared with the model's own tokenizer (`data prepare --tokenizer HF_FOLDER`),
    as the recipe does; read, never written, by the tests that use it."""
    data = tmp_path_factory.mktemp("prepared") / "data"
    cli("data", "prepare", str(user_text / "train"), "--out", str(data), "--tokenizer", str(instruct), "--workers", "1")
    return data


def cli(*args: str, code: int = 0):
    r = CliRunner().invoke(app, list(args), env={"COLUMNS": "400"})
    if code == 0:
        assert r.exit_code == 0, (r.output, r.exception)
    else:
        assert r.exit_code != 0, r.output
    return r


@pytest.mark.parametrize("given", ["prepared data", "raw text and a tokenizer file"])
def test_data_of_another_tokenizer_is_refused_before_step_1(given, instruct, user_text, tmp_path):
    """Trap 1: data prepared with its own BPE of the model's very vocabulary size (512): the same
    size, other tokens. Refused in one line before anything trains; given as raw text with that
    tokenizer file, said from the file before `run.dir/data` is prepared (every refusal before the
    command's first write of data)."""
    data = tmp_path / "data"
    cli("data", "prepare", str(user_text / "train"), "--out", str(data), "--train-tokenizer", "512", "--workers", "1")
    run = tmp_path / "run"
    source = (
        [f'data.path="{data}"']
        if given == "prepared data"
        else [f'data.path="{user_text / "train"}"', f'data.tokenizer="{data / "tokenizer.json"}"']
    )
    r = cli(
        "train",
        f'model.init_from="hf:{instruct}"',
        *source,
        f'run.dir="{run}"',
        "train.steps=2",
        "data.seq_len=64",
        "optim.warmup_steps=1",
        "train.sample_tokens=0",
        code=2,
    )
    assert isinstance(r.exception, DataError), r.output
    msg = str(r.exception)
    assert "another tokenizer" in msg and "differ" in msg and f"--tokenizer {instruct}" in msg and "\n" not in msg
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists() and not (run / "data").exists()


def test_prepare_takes_an_hf_folder_and_refuses_two_tokenizer_options(instruct, user_text, prepared, tmp_path):
    ours, theirs = (
        Tokenizer.from_file(str(prepared / "tokenizer.json")),
        Tokenizer.from_file(str(instruct / "tokenizer.json")),
    )
    assert ours.get_vocab(with_added_tokens=True) == theirs.get_vocab(with_added_tokens=True)
    r = cli(
        "data",
        "prepare",
        str(user_text / "train"),
        "--out",
        str(tmp_path / "d2"),
        "--tokenizer",
        str(instruct),
        "--train-tokenizer",
        "512",
        code=2,
    )
    assert isinstance(r.exception, ConfigError) and "conflict" in str(r.exception)
    assert not (tmp_path / "d2").exists()


def test_continued_pretraining_defaults_replace_the_demo_schedule(instruct, tmp_path):
    """Trap 2: the demo's from-scratch lr 3e-3 and its preset no longer apply under init_from; what
    the user sets still wins."""
    cfg = load_config("demo", [f'model.init_from="hf:{instruct}"', "train.steps=200"])
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, cfg.data.seq_len) == (1e-4, 1e-5, 2, CONTEXT)
    assert cfg.model.preset is None
    mine = load_config("demo", [f'model.init_from="hf:{instruct}"', "optim.lr=3e-5", "data.seq_len=64"])
    assert (mine.optim.lr, mine.optim.min_lr, mine.data.seq_len) == (3e-5, pytest.approx(3e-6), 64)
    shown = cli("config", "show", f'model.init_from="hf:{instruct}"').output
    assert "preset" not in shown and "demo-small" not in shown
    assert load_config("demo").optim.lr == 3e-3  # from scratch: unchanged


def test_a_rising_loss_is_warned_in_the_first_steps(instruct, user_text, tmp_path):
    """Step-0 validation loss, a line naming what was loaded, and the first-steps watch: at a
    learning rate far too high the training loss climbs over the loaded model's own loss."""
    run = tmp_path / "run"
    r = cli(
        "train",
        f'model.init_from="hf:{instruct}"',
        f'data.path="{user_text / "train"}"',
        f'run.dir="{run}"',
        "train.steps=8",
        "optim.lr=0.05",
        "optim.warmup_steps=1",
        "data.seq_len=64",
        "train.sample_tokens=0",
        "train.eval_every=0",
        "train.eval_batches=2",
        "train.global_batch=4",
        "train.micro_batch=4",
        "log.every=1",
        "checkpoint.interval=0",
    )
    out = " ".join(r.output.split())
    assert f"loaded hf:{instruct}: llama, " in out and "parameters" in out and "eos '<|im_end|>'=2" in out
    assert "step 0: val loss" in out
    assert "far above the loaded model's step-0 validation loss" in out and "optim.lr=0.05" in out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 0 and "val_loss" in records[0]
    assert any(rec.get("event") == "loss_rise" for rec in records)


def test_recipe_import_continue_move_away_export(instruct, user_text, prepared, tmp_path):
    """The recipe end to end: continue with the defaults, then with the HF folder moved away the
    checkpoint still evaluates, generates and exports; the export keeps the chat template,
    special-token ids, generation config and tied weights (transformers as the reference)."""
    src = AutoTok(instruct)
    run = tmp_path / "run"
    hf = tmp_path / "model"
    shutil.copytree(instruct, hf)
    r = cli(
        "train",
        f'model.init_from="hf:{hf}"',
        f'data.path="{prepared}"',
        f'run.dir="{run}"',
        "train.steps=30",
        "train.global_batch=8",
        "train.micro_batch=8",
        "train.eval_every=0",
        "train.eval_batches=2",
        "train.sample_tokens=0",
        "checkpoint.interval=0",
    )
    assert "continued pre-training defaults" in r.output and "optim.lr=0.0001" in r.output
    imported = tmp_path / "imported"
    cli("convert", "from-hf", str(hf), str(imported))
    shutil.move(hf, tmp_path / "moved-away")
    for ckpt in (run, imported):
        for name in ("tokenizer_config.json", "generation_config.json"):
            assert (next((ckpt / "checkpoints").iterdir()) / name).is_file()
    scores = {}
    for name, ckpt in (("before", imported), ("after", run)):
        res = json.loads(cli("eval", str(ckpt), "--text", str(user_text / "heldout.txt"), "--json").output)
        assert res["seq_len"] == CONTEXT
        scores[name] = res["loss"]
    assert scores["after"] < scores["before"]  # held-out text of the user's domain, at the same window
    said = cli("eval", str(run), "--text", str(user_text / "heldout.txt"), "--seq-len", "32").output
    assert "windows of 32 tokens" in said
    cli("generate", str(run), "--prompt", "Enter", "--max-new-tokens", "5")
    export = tmp_path / "export"
    cli("convert", "to-hf", str(run), str(export))
    got = AutoTok(export)
    assert got.chat_template == src.chat_template
    assert got.apply_chat_template(CHAT, tokenize=False) == src.apply_chat_template(CHAT, tokenize=False)
    assert (got.bos_token_id, got.eos_token_id) == (src.bos_token_id, src.eos_token_id) == (1, 2)
    cfg = json.loads((export / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["tie_word_embeddings"]) == (1, 2, True)
    gen = transformers.GenerationConfig.from_pretrained(export)
    assert (gen.bos_token_id, gen.eos_token_id, gen.do_sample) == (1, 2, False)
    model = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def AutoTok(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


def test_eval_text_says_and_takes_its_window(instruct, user_text, tmp_path):
    """Trap 3: `eval --text` scored in windows of data.seq_len and never said which."""
    out = tmp_path / "imported"
    cli("convert", "from-hf", str(instruct), str(out))
    said = " ".join(cli("eval", str(out), "--text", str(user_text / "heldout.txt")).output.split())
    assert f"windows of {CONTEXT} tokens (the model's context" in said
    at = {
        n: json.loads(
            cli("eval", str(out), "--text", str(user_text / "heldout.txt"), "--seq-len", str(n), "--json").output
        )
        for n in (16, CONTEXT)
    }
    assert at[16]["seq_len"] == 16 and at[16]["loss"] > at[CONTEXT]["loss"]  # less context per token: higher loss
    # the reference: transformers on the same windows (seq_len + 1 tokens, one shared between neighbours)
    ids = Tokenizer.from_file(str(instruct / "tokenizer.json")).encode((user_text / "heldout.txt").read_text()).ids
    ref = transformers.AutoModelForCausalLM.from_pretrained(instruct)
    windows = [torch.tensor(ids[s : s + 17]) for s in range(0, len(ids) - 1, 16)]
    total = 0.0
    with torch.no_grad():
        for group in (torch.stack([w for w in windows if len(w) == 17]), *[w[None] for w in windows if len(w) < 17]):
            logits = ref(input_ids=group[:, :-1]).logits
            total += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), group[:, 1:].flatten(), reduction="sum"
            ).item()
    assert at[16]["loss"] == pytest.approx(total / (len(ids) - 1), rel=1e-4)
    r = cli("eval", str(out), "--text", str(user_text / "heldout.txt"), "--seq-len", str(CONTEXT + 1), code=2)
    assert isinstance(r.exception, ConfigError) and "max_seq_len" in str(r.exception)


def test_export_refuses_tensors_that_do_not_match_the_config(instruct, tmp_path):
    """A checkpoint whose tensors disagree with its config (here: another vocabulary size than its
    state.json says) is refused in one line and nothing is written."""
    from flopwise.checkpoints import checkpoint
    from flopwise.config.schema import to_toml
    from flopwise.interop.hf import from_hf

    model, _ = from_hf(instruct)
    cfg = load_config("demo", [f'model.init_from="hf:{instruct}"', "model.vocab_size=600"])
    checkpoint.save(
        tmp_path / "run",
        1,
        model,
        None,
        {"config": to_toml(cfg)},
        files={"tokenizer.json": instruct / "tokenizer.json"},
        keep=None,
    )
    r = cli("convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "out"), code=2)
    assert isinstance(r.exception, CheckpointError), r.output
    assert "weight is [512, 64], its config implies [600, 64]; nothing was written" in str(r.exception)
    assert not (tmp_path / "out").exists()


def test_ctrl_c_is_acknowledged_during_a_step_and_a_second_one_stops_at_once(tmp_path):
    """Trap 7: Python runs a signal handler only between bytecodes, so a Ctrl-C in a long step (one
    C call: here a chain of matmuls holding the main thread for seconds) was acknowledged only
    when the step ended, and a second one in that time was merged into the first."""
    import signal
    import threading
    import time

    from flopwise.config.schema import WatchdogConfig
    from flopwise.train.watch import Watch

    said, aborted = [], []
    watch = Watch(WatchdogConfig(), tmp_path, 0, torch.device("cpu"), report=lambda m: said.append(time.monotonic()))
    watch.abort = lambda: aborted.append(time.monotonic())
    q = torch.linalg.qr(torch.randn(600, 600))[0]  # orthogonal: the product stays finite
    t = time.monotonic()
    q @ q
    k = max(3, int(4.0 / max(time.monotonic() - t, 1e-4)))  # about 4 s of one C call
    kill = lambda: os.kill(os.getpid(), signal.SIGINT)  # noqa: E731
    with watch:
        threading.Timer(0.3, kill).start()
        threading.Timer(0.9, kill).start()
        t0 = time.monotonic()
        torch.linalg.multi_dot([q] * k)
        t1 = time.monotonic()
    assert t1 - t0 > 1.5, "the C call was too short to tell"
    assert len(said) == 2 and said[0] < t1 - 0.5 and aborted and aborted[0] < t1 - 0.2
    assert watch.signal == "SIGINT"


def test_ctrl_c_checkpoints_at_the_end_of_the_step(tiny_data, tmp_path, monkeypatch):
    """One process: a Ctrl-C in step 3 checkpoints at step 3, not at the next log step (50)."""
    from flopwise.train.launch import train
    from tests.conftest import tiny_overrides

    monkeypatch.setenv("FLOPWISE_FAULTS", "sigint:step=3")
    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / "run",
            tiny_data,
            **{"train.steps": 50, "log.every": 50, "train.eval_every": 0, "checkpoint.interval": 0},
        ),
    )
    result = train(cfg)
    assert result.preempted == 3 and result.checkpoint is not None and result.checkpoint.name == "step-00000003"


def test_plan_says_whether_it_assumes_compile_and_answers_uncalibrated_on_a_cpu(instruct):
    """Trap 6: with plan.tokens unset the planner books a compiled run (20 tokens per parameter is
    >= 1000 steps) where `flopwise train` with train.steps=300 runs eager, and said nothing; on a
    CPU without a calibration file it refused to plan at all. Small plans printed "0.0 days"."""
    out = " ".join(
        cli(
            "plan",
            f'model.init_from="hf:{instruct}"',
            "train.steps=300",
            "train.global_batch=1",
            "data.seq_len=16",
            "--top",
            "1",
        ).output.split()
    )
    assert "torch.compile assumed (train.compile=auto and the planned run is" in out
    assert "`flopwise train` with train.steps=300 would not compile" in out
    assert "uncalibrated: UNCALIBRATED nominal rates" in out and "flopwise hardware calibrate --out cpu.toml" in out
    assert "0.0 days" not in out and "0.00 TB" not in out
    eager = " ".join(
        cli("plan", f'model.init_from="hf:{instruct}"', "train.compile=false", "--top", "1").output.split()
    )
    assert "torch.compile not assumed (train.compile=false)" in eager
