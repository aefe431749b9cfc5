import subprocess
import sys
import tomllib

import pytest

from flopwise.config.schema import Config, load_config, to_toml
from flopwise.errors import ConfigError


def test_defaults_and_overrides():
    cfg = load_config("demo", ["train.steps=70", "model.n_layers=3", "optim.lr=1e-3", 'run.name="x y"'])
    assert cfg.train.steps == 70 and cfg.model.n_layers == 3 and cfg.optim.lr == 1e-3 and cfg.run.name == "x y"
    assert cfg.model.preset == "demo-small" and cfg.model.d_model == 256  # preset fills the rest


def test_preset_then_explicit_keys_win():
    cfg = load_config(None, ["model.preset=llama3-8b", "model.n_layers=2", "data.seq_len=128"])
    m = cfg.model
    assert (m.n_layers, m.d_model, m.n_kv_heads, m.head_dim, m.vocab_size) == (2, 4096, 8, 128, 128256)
    assert m.norm == "rmsnorm" and m.mlp == "swiglu" and m.rope_theta == 500000.0


def test_arch_defaults():
    m = load_config(None, ["model.arch=gpt2", "model.d_model=64", "model.n_heads=4"]).model
    assert (m.norm, m.mlp, m.pos, m.bias, m.tie_embeddings, m.ffn_dim) == (
        "layernorm",
        "gelu_tanh",
        "learned",
        True,
        True,
        256,
    )
    m = load_config(None, ["model.d_model=256", "model.n_heads=4"]).model  # llama: 8/3·d rounded up to 256
    assert m.ffn_dim == 768


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("train.stepz=5", "unknown key 'train.stepz'"),
        ("bogus.x=1", "unknown key 'bogus'"),
        ("train.steps=abc", "train.steps"),
        ("model.n_heads=5", "model.n_heads=5 does not divide model.d_model=256"),
        ("model.n_kv_heads=3", "model.n_kv_heads=3 does not divide model.n_heads"),
        ("data.seq_len=999", "data.seq_len=999 exceeds model.max_seq_len"),
        ("train.micro_batch=3", "train.micro_batch=3 does not divide train.global_batch=16"),
        ("train.dtype=fp8", "train.dtype"),
        ("model.preset=nope", "unknown preset 'nope'"),
        ("model.arch=nope", "unknown arch 'nope'"),
        ("parallel.zero=4", "parallel.zero"),
        ("nodot=1", "key must be section.name"),
        ("novalue", "expected key=value"),
    ],
)
def test_errors_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config("demo", [override])
    msg = str(e.value)
    assert fragment in msg and "\n" not in msg


def test_missing_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_toml_round_trip():
    cfg = load_config("demo", ["model.preset=mistral-7b", "data.seq_len=512"])
    again = Config.model_validate(tomllib.loads(to_toml(cfg)))
    assert again == cfg


def test_cli_error_is_one_line_exit_2():
    r = subprocess.run(
        [sys.executable, "-m", "flopwise", "config", "show", "demo", "model.n_heads=5"], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "model.n_heads=5" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_config_show_prints_resolved_toml():
    r = subprocess.run(
        [sys.executable, "-m", "flopwise", "config", "show", "demo", "train.steps=110"],
        capture_output=True,
        text=True,
        check=True,
    )
    tree = tomllib.loads(r.stdout)
    assert tree["train"]["steps"] == 110 and tree["model"]["d_model"] == 256


# /proc/cpuinfo's flags lines, abridged, of the two CPUs this suite has run on (2026-12): an Intel Xeon
# with AMX (bf16 matmul ceiling 2,364 GFLOP/s on 2 cores) and an AMD EPYC with AVX2 only (1.4, fp32 171)
AMX_XEON = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
AVX2_EPYC = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"


def test_cpu_bf16_instructions_are_read_from_the_flags_line():
    from flopwise.hardware.catalogue import cpu_multiplies_bf16

    assert cpu_multiplies_bf16(AMX_XEON) and not cpu_multiplies_bf16(AVX2_EPYC)
    assert cpu_multiplies_bf16("flags\t: avx512f avx512_bf16\n") and not cpu_multiplies_bf16("")
    assert not cpu_multiplies_bf16("flags\t: avx2\nbugs\t: amx_bf16\n")  # only the flags line counts


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_is_bf16_only_where_the_planned_or_local_device_multiplies_it(native, monkeypatch, tmp_path):
    """The demo's train.dtype=auto: on the built-in cpu entry, this machine's CPU decides; a catalogue
    GPU or a calibrated entry with a bf16 peak is bf16, a V100 (fp16 and fp32 only) fp32; an explicit
    dtype is never changed.
    Every reader sees bf16 or fp32, the run folder's config.toml included."""
    from flopwise.hardware import catalogue as hardware

    monkeypatch.setattr(hardware, "cpu_multiplies_bf16", lambda cpuinfo=None: native)
    demo = load_config("demo")
    assert demo.train.dtype == ("bf16" if native else "fp32")
    assert 'dtype = "auto"' not in to_toml(demo) and f'dtype = "{demo.train.dtype}"' in to_toml(demo)
    assert load_config("demo", ['cluster.hardware="h100-sxm"']).train.dtype == "bf16"
    assert load_config("demo", ['cluster.hardware="v100-32gb"']).train.dtype == "fp32"
    for dtype in ("bf16", "fp32"):
        assert load_config("demo", [f'train.dtype="{dtype}"']).train.dtype == dtype
    mine = tmp_path / "hw.toml"  # a calibrated cpu entry: its tables are bf16 (calibrate measures no other)
    mine.write_text(
        "[cpu]\npeak_flops = {bf16 = 300e9}\nmemory_bytes = 24e9\nmemory_bw = 20e9\nintra_node_bw = 5e9\n"
        'inter_node_bw = 1e9\ndevices_per_node = 2\nsource = "hand-written"\n'
    )
    assert load_config("demo", [f'cluster.hardware_file="{mine}"']).train.dtype == "bf16"
    with pytest.raises(ConfigError, match="cluster.hardware: unknown hardware 'h1000'"):
        load_config("demo", ['cluster.hardware="h1000"'])
