"""The one config tree: TOML file + dotted `key=value` overrides, validated by pydantic.

Pure Python (no torch) so the planner can use it. Key names are public interface. Errors become a
one-line `ConfigError` that names the key and what is allowed.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flopwise.errors import ConfigError
from flopwise.hf_config import model_fields, read_hf_config, refuse
from flopwise.presets import ARCH_DEFAULTS, PRESETS


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunConfig(Section):
    name: str = "demo"
    dir: str = "runs/demo"
    seed: int = 1337


class RopeScaling(Section):
    """Llama-3 RoPE frequency scaling (Dubey et al. 2024, used from Llama 3.1 on)."""

    factor: float = Field(gt=0)
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_max_seq_len: int = Field(gt=0)


class ModelConfig(Section):
    preset: str | None = None
    init_from: str | None = Field(None, description='hf:PATH: shape and weights from a Hugging Face folder')
    arch: str = "llama"
    n_layers: int = Field(4, ge=1)
    d_model: int = Field(256, ge=1)
    n_heads: int = Field(4, ge=1)
    # derived defaults: factories of the fields validated above them (so mlp comes before ffn_dim)
    n_kv_heads: int = Field(default_factory=lambda v: v["n_heads"], ge=1,
                            description="default: n_heads (1 = multi-query)")
    head_dim: int = Field(default_factory=lambda v: v["d_model"] // v["n_heads"], ge=1,
                          description="default: d_model // n_heads")
    mlp: Literal["swiglu", "gelu", "gelu_tanh", "relu"] = "swiglu"
    ffn_dim: int = Field(default_factory=lambda v: 4 * v["d_model"] if v["mlp"] != "swiglu"
                         else 256 * -(-(8 * v["d_model"] // 3) // 256), ge=1,
                         description="default: 4·d_model, or 8/3·d_model rounded to 256 for swiglu")
    vocab_size: int = Field(4096, ge=2)
    max_seq_len: int = Field(256, ge=1)
    norm: Literal["layernorm", "rmsnorm"] = "rmsnorm"
    norm_eps: float = Field(1e-5, gt=0)
    pos: Literal["rope", "learned", "alibi", "relative", "none"] = "rope"
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    rotary_pct: float = Field(1.0, gt=0, le=1)
    pos_offset: int = Field(0, ge=0, description="extra learned-position rows before position 0 (OPT: 2)")
    tie_embeddings: bool = False
    qk_norm: bool = False
    sliding_window: int | None = Field(None, ge=1)
    bias: bool = False
    qkv_bias: bool = Field(False, description="biases on the q, k and v projections only (Qwen2)")
    parallel_block: bool = False
    embed_norm: bool = False
    dropout: float = Field(0.0, ge=0, lt=1)
    init_std: float = Field(0.02, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        """Resolve arch defaults < preset < explicit keys."""
        if not isinstance(data, dict):
            return data
        preset = data.get("preset")
        base: dict[str, Any] = {}
        init_from = data.get("init_from")
        if init_from is not None:
            if not str(init_from).startswith("hf:"):
                raise ValueError(f"model.init_from={init_from!r}: expected hf:PATH to a Hugging Face folder")
            base = hf_model_fields(str(init_from)[3:])
        elif preset is not None:
            if not isinstance(preset, str) or preset not in PRESETS:
                raise ValueError(f"model.preset: unknown preset {preset!r} (see `flopwise presets`)")
            base = PRESETS[preset].model_fields()
        arch = data.get("arch", base.get("arch", "llama"))
        if not isinstance(arch, str) or arch not in ARCH_DEFAULTS:
            raise ValueError(f"model.arch: unknown arch {arch!r} (allowed: {', '.join(ARCH_DEFAULTS)})")
        return {**ARCH_DEFAULTS[arch], **base, **data, "arch": arch}

    @model_validator(mode="after")
    def _derive_and_check(self) -> ModelConfig:
        if "head_dim" not in self.model_fields_set and self.d_model % self.n_heads:
            raise ValueError(f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}; "
                             "choose a divisor or set model.head_dim")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_kv_heads={self.n_kv_heads} does not divide model.n_heads={self.n_heads}")
        if self.pos == "rope" and int(self.head_dim * self.rotary_pct) % 2:
            raise ValueError(f"model.rotary_pct={self.rotary_pct} gives an odd number of rotary dims "
                             f"for head_dim={self.head_dim}; rotary dims must be even")
        return self

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_pct)


def hf_model_fields(path: str | Path) -> dict:
    """The validated `model.*` keys that reproduce the Hugging Face model in `path` (its config.json);
    a missing or malformed field is one line naming the folder and the field."""
    try:
        return ModelConfig(**model_fields(read_hf_config(path), path)).model_dump(exclude_none=True)
    except KeyError as e:
        refuse(Path(path), f"config.json lacks {e}")
    except ValidationError as e:
        err = e.errors()[0]
        refuse(Path(path), f"config.json gives model.{'.'.join(map(str, err['loc']))}: "
                           f"{err['msg'].removeprefix('Value error, ')}")
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        refuse(Path(path), f"config.json has a malformed field ({type(e).__name__}: {str(e).splitlines()[0][:100]})")


class SourceConfig(Section):
    """One source of a weighted mixture (Llama 3, Gopher's MassiveText): its share of every batch."""

    path: str = Field(..., description="prepared data dir (with index.json) or raw text input")
    weight: float = Field(1.0, gt=0, description="relative share of sampled sequences (normalised over sources)")
    name: str | None = Field(None, description="label in metrics and reports; default: the path's last part")

    @property
    def label(self) -> str:
        return self.name or self.path.rstrip("/").split("/")[-1].split(":")[-1] or "data"


class DataConfig(Section):
    path: str = Field("builtin:shakespeare", description="prepared data dir (with index.json) or raw text input")
    sources: list[SourceConfig] = Field(default_factory=list, description="weighted mixture "
                                        "[{path, weight, name}, ...]; empty: data.path alone, weight 1")
    tokenizer: str = Field("bpe:4096", description="tokenizer.json path, or bpe:VOCAB to train one; default "
                           "bpe:4096, or the tokenizer of model.init_from")
    seq_len: int = Field(256, ge=1)
    val_fraction: float = Field(0.05, ge=0, lt=1)
    document_mask: bool = Field(False, description="attention stays inside each document of a packed window "
                                "(Llama 3); documents end at EOS")
    reset_positions: bool = Field(False, description="with document_mask: positions restart at 0 in every document")

    @property
    def mixture(self) -> list[SourceConfig]:
        """The sources to sample from: data.sources, or data.path as the only one."""
        return self.sources or [SourceConfig(path=self.path)]

    @model_validator(mode="after")
    def _check_sources(self) -> DataConfig:
        labels = [s.label for s in self.sources]
        dup = sorted({n for n in labels if labels.count(n) > 1})
        if dup:
            raise ValueError(f"data.sources: name {dup[0]!r} used twice; give each source its own name")
        if self.reset_positions and not self.document_mask:
            raise ValueError("data.reset_positions=true needs data.document_mask=true")
        return self


class TrainConfig(Section):
    steps: int = Field(300, ge=1)
    stop_after: int | None = Field(None, ge=1, description="end this invocation at this step (schedule still "
                                   "spans train.steps); resume continues, e.g. across job time limits")
    global_batch: int = Field(16, ge=1, description="sequences per optimizer step")
    micro_batch: int = Field(default_factory=lambda v: max(d for d in range(1, min(16, v["global_batch"]) + 1)
                                                           if v["global_batch"] % d == 0), ge=1,
                             description="sequences per forward/backward on one rank; "
                             "default: the largest divisor of global_batch up to 16")
    dtype: Literal["bf16", "fp32"] = Field("bf16", description="bf16 autocast (fp32 master weights) or fp32")
    float8: Literal["none", "rowwise", "tensorwise"] = Field("none", description="the blocks' linear layers in "
                                                             "float8 (torchao; embedding and head stay in train.dtype); "
                                                             "needs a GPU of compute capability >= 8.9")
    float8_emulate: bool = Field(False, description="with train.float8: torchao's emulation (any device, slow; tests)")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compile: bool | Literal["auto"] = Field("auto", description="torch.compile each block and the loss; auto: "
                                            "for runs of >= 1000 steps on one process or plain data parallel")
    eval_every: int = Field(100, ge=0, description="0 = only at the end")
    eval_batches: int = Field(8, ge=1)
    sample_tokens: int = Field(120, ge=0, description="tokens of sample text generated at the end")
    sample_prompt: str = "Romeo.\n"
    eval_tasks: list[str] = Field(default_factory=list, description="task names run at every evaluation")
    eval_task_limit: int = Field(100, ge=1, description="examples per task during training")
    preflight: bool = Field(True, description="before preparing data or allocating, predict every rank's peak "
                            "memory with the planner and refuse (exit 2, with the nearest change that fits) a run "
                            "that will not fit its devices")
    memory_snapshot: bool = Field(False, description="CUDA: record the allocator's history from the start, so an "
                                  "out-of-memory step also writes memory_snapshot.pickle (pytorch.org/memory_viz)")


class OptimConfig(Section):
    lr: float = Field(3e-3, gt=0)
    min_lr: float = Field(3e-4, ge=0)
    warmup_steps: int = Field(30, ge=0)
    schedule: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    decay_fraction: float = Field(0.2, gt=0, le=1, description="WSD: share of steps spent decaying")
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0, description="0 = off")


class ParallelConfig(Section):
    dp: int | None = Field(None, ge=1, description="default: what is left of the world size")
    dp_replicate: int = Field(1, ge=1)
    zero: Literal[0, 1, 2, 3] = 0
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "dualpipev"] = "1f1b"
    virtual_stages: int = Field(1, ge=1)
    pp_layers: list[int] | None = Field(None, description="layers per pipeline stage (pp·virtual_stages "
                                        "entries); default: balanced by parameter count")
    sequence_parallel: bool = False
    recompute: Literal["none", "selective", "full"] = "none"
    layout: Literal["manual", "auto"] = Field("manual", description="auto: the planner picks the unset degrees "
                                              "for cluster.hardware and the world size")


class CheckpointConfig(Section):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    interval: int | Literal["auto"] = Field(0, description="steps between checkpoints; 0 = only at the end; "
                                            "auto = Young/Daly interval from the measured write time and "
                                            "cluster.gpu_mtbf_hours")
    keep: int = Field(2, ge=1)
    resume: str = Field("auto", description="auto (latest complete), none, or a checkpoint path")
    async_save: bool = Field(False, alias="async", description="write with DCP's async save while training "
                             "goes on (at most one in flight)")
    on_error: Literal["stop", "continue"] = Field("stop", description="a failed write (disk full, unwritable "
                                                  "dir): stop cleanly, or warn and keep training")
    verify: Literal["sha256", "size"] = Field("sha256", description="what resume checks before trusting a "
                                              "checkpoint: every file's checksum, or only sizes (fast)")

    @model_validator(mode="after")
    def _interval(self) -> CheckpointConfig:
        if isinstance(self.interval, int) and self.interval < 0:
            raise ValueError(f"checkpoint.interval={self.interval}: use a step count >= 0 or \"auto\"")
        return self


class GuardConfig(Section):
    """Loss-spike and NaN guard (PaLM's recipe: roll back, skip the offending data)."""

    enabled: bool = True
    spike_zscore: float = Field(6.0, gt=0, description="a loss this many running std above the running mean "
                                "is a spike")
    window: int = Field(50, ge=2, description="steps in the running loss window")
    min_window: int = Field(10, ge=2, description="steps of history before spikes are judged")
    max_skips: int = Field(3, ge=1, description="consecutive non-finite steps that trigger a rollback")
    skip_batches: int = Field(200, ge=0, description="batches skipped after a rollback (at least up to the bad one)")
    max_rollbacks: int = Field(3, ge=0, description="rollbacks before stopping (counted across resumes)")


class WatchdogConfig(Section):
    collective_timeout_s: float = Field(600.0, gt=0, description="a collective waiting longer fails the job "
                                        "(torchrun then restarts it)")
    hang_factor: float = Field(10.0, gt=1, description="dump every thread's stack when a step runs this many "
                               "times the median step time")
    min_s: float = Field(300.0, gt=0, description="never dump before a step has run this long")


class LogConfig(Section):
    every: int = Field(10, ge=1)
    tensorboard: bool = False


class ClusterConfig(Section):
    hardware: str = "cpu"
    hardware_file: str | None = Field(None, description="TOML with extra or replaced hardware entries")
    gpus: int = Field(1, ge=1)
    gpus_per_node: int | None = Field(None, ge=1, description="default: the hardware's devices per node")
    storage_gbps_per_gpu: float | None = Field(None, gt=0, description="checkpoint write bandwidth per device, "
                                               "GB/s; default: Llama 3's 2 TB/s over 16,384 GPUs")
    gpu_mtbf_hours: float | None = Field(None, gt=0, description="mean time between failures of one device; "
                                         "default: Llama 3's 466 interruptions in 54 days on 16,384 GPUs")
    restart_minutes: float = Field(10.0, ge=0, description="time to detect a failure, restart and reload")


class PlanConfig(Section):
    tokens: float | None = Field(None, gt=0, description="training token budget; default 20 tokens per parameter")
    stack: Literal["flopwise", "megatron-2021", "megatron-2022"] = Field("flopwise", description="software assumptions of the "
                                                        "step-time model (see flopwise.plan.perf)")
    float8: bool = Field(False, description="let the layout search also consider train.float8 for the "
                         "blocks' linear layers (hardware with a float8 peak)")


class Config(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    parallel: ParallelConfig = ParallelConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    guard: GuardConfig = GuardConfig()
    watchdog: WatchdogConfig = WatchdogConfig()
    log: LogConfig = LogConfig()
    cluster: ClusterConfig = ClusterConfig()
    plan: PlanConfig = PlanConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        m, t = self.model, self.train
        if m.init_from and "tokenizer" not in self.data.model_fields_set:
            self.data.tokenizer = str(Path(m.init_from[3:]) / "tokenizer.json")
        if m.init_from and self.data.tokenizer.startswith("bpe:"):
            raise ValueError(f"data.tokenizer={self.data.tokenizer} trains a new tokenizer, whose ids mean nothing to "
                             f"the embeddings of model.init_from={m.init_from}; leave data.tokenizer unset (the "
                             "default with init_from is its folder's tokenizer.json)")
        if self.data.seq_len > m.max_seq_len:
            raise ValueError(f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
                             "lower data.seq_len or raise model.max_seq_len")
        if t.global_batch % t.micro_batch:
            raise ValueError(f"train.micro_batch={t.micro_batch} does not divide "
                             f"train.global_batch={t.global_batch}")
        if self.optim.min_lr > self.optim.lr:
            raise ValueError(f"optim.min_lr={self.optim.min_lr} exceeds optim.lr={self.optim.lr}")
        if self.guard.min_window > self.guard.window:
            raise ValueError(f"guard.min_window={self.guard.min_window} exceeds guard.window={self.guard.window}")
        if self.optim.warmup_steps > t.steps:
            raise ValueError(f"optim.warmup_steps={self.optim.warmup_steps} exceeds train.steps={t.steps}")
        return self


# ---------------------------------------------------------------------------------------------
# Loading


def builtin_config_path(name: str) -> Path:
    return Path(str(resources.files("flopwise") / "configs" / f"{name}.toml"))


def _read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.suffix and not p.exists() and builtin_config_path(str(path)).exists():
        p = builtin_config_path(str(path))
    if not p.is_file():
        raise ConfigError(f"config file {path}: not found (give a .toml path or a built-in name such as 'demo')")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p}: not valid TOML ({e})") from None


def parse_value(text: str) -> Any:
    """A TOML literal (1, 2.5, true, "x", [1, 2]) or, failing that, the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(tree: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=200")
    key, _, value = item.partition("=")
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override {item!r}: key must be section.name, e.g. model.n_layers=4")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {p} is not a section")
        node = child
    node[parts[-1]] = parse_value(value.strip())


def _format_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        section = _section_model(err["loc"][:-1])
        allowed = ", ".join(section.model_fields) if section else ""
        return f"unknown key {loc!r}" + (f" (allowed here: {allowed})" if allowed else "")
    if err["type"] in ("model_type", "dict_type"):
        return f"{loc}: expected a section (table), got {err['input']!r}"
    value = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
    return f"{loc}: {msg}{value}" if loc and not msg.startswith(loc.split(".")[0] + ".") else msg


def _section_model(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def validate(tree: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"config error: {_format_error(e)}") from None


def load_tree(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The raw key tree a user gave: TOML (a path, a built-in name, or none) plus overrides."""
    tree = _read_toml(path) if path is not None else {}
    for item in overrides:
        apply_override(tree, item)
    return tree


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load TOML (a path, a built-in name, or none for defaults), apply overrides, validate."""
    return validate(load_tree(path, overrides))


def split_cli_args(args: list[str] | None) -> tuple[str | None, list[str]]:
    """`[CONFIG] [key=value ...]`: the first argument is a config unless it is an override."""
    args = list(args or [])
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def to_toml(cfg: Config) -> str:
    return tomli_w.dumps(cfg.model_dump(mode="json", exclude_none=True, by_alias=True))


def config_hash(cfg: Config) -> str:
    import hashlib

    return hashlib.sha256(to_toml(cfg).encode()).hexdigest()[:16]
