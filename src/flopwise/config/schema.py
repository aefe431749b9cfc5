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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flopwise.config.hf_mapping import check_layers, model_fields, read_hf_config, refuse
from flopwise.config.presets import ARCH_DEFAULTS, PRESETS
from flopwise.errors import ConfigError
from flopwise.hardware.catalogue import auto_dtype, cluster_hardware


class Section(BaseModel):
    """Every config table: unknown keys and non-finite floats (inf, nan) are refused in every field."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class RunConfig(Section):
    name: str = Field("demo", description="run label in banners, metrics and exported configs")
    dir: str = Field("runs/demo", description="run folder: metrics, checkpoints, prepared data, plots")
    seed: int = Field(
        1337,
        ge=0,
        lt=2**63,
        description="seed of initialisation, data order, validation split and dropout (0 to 2^63-1)",
    )


class RopeScaling(Section):
    """Llama-3 RoPE frequency scaling (Dubey et al. 2024, used from Llama 3.1 on)."""

    factor: float = Field(gt=0, description="how much longer the extended context is than the original")
    low_freq_factor: float = Field(
        gt=0, description="wavelengths above original_max_seq_len / this are scaled by factor"
    )
    high_freq_factor: float = Field(
        gt=0, description="wavelengths below original_max_seq_len / this are left as they are"
    )
    original_max_seq_len: int = Field(gt=0, description="the context the model was first trained with")


class ModelConfig(Section):
    preset: str | None = Field(
        None, description="a published architecture from `flopwise presets`; explicit model keys override it"
    )
    init_from: str | None = Field(None, description="hf:PATH: shape and weights from a Hugging Face folder")
    arch: str = Field(
        "llama", description="family defaults: gpt2, opt, neox, bloom, llama, mistral, qwen3, palm, gopher"
    )
    n_layers: int = Field(4, ge=1, description="transformer blocks")
    d_model: int = Field(256, ge=1, description="width of the residual stream")
    n_heads: int = Field(4, ge=1, description="query heads")
    # derived defaults: factories of the fields validated above them (so mlp comes before ffn_dim)
    n_kv_heads: int = Field(
        default_factory=lambda v: v["n_heads"], ge=1, description="default: n_heads (1 = multi-query)"
    )
    head_dim: int = Field(
        default_factory=lambda v: v["d_model"] // v["n_heads"], ge=1, description="default: d_model // n_heads"
    )
    mlp: Literal["swiglu", "gelu", "gelu_tanh", "relu"] = Field("swiglu", description="MLP activation")
    ffn_dim: int = Field(
        default_factory=lambda v: (
            4 * v["d_model"] if v["mlp"] != "swiglu" else 256 * -(-(8 * v["d_model"] // 3) // 256)
        ),
        ge=1,
        description="default: 4·d_model, or 8/3·d_model rounded to 256 for swiglu",
    )
    vocab_size: int = Field(4096, ge=2, description="embedding rows; at least the tokenizer's vocabulary")
    max_seq_len: int = Field(256, ge=1, description="longest sequence the model takes (positions, generation)")
    norm: Literal["layernorm", "rmsnorm"] = Field("rmsnorm", description="normalisation layer")
    norm_eps: float = Field(1e-5, gt=0, description="epsilon of the norms")
    pos: Literal["rope", "learned", "alibi", "relative", "none"] = Field(
        "rope", description="positions: RoPE, learned absolute, ALiBi, Transformer-XL relative, or none"
    )
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base")
    rope_scaling: RopeScaling | None = Field(None, description="Llama-3 RoPE frequency scaling table; none: unscaled")
    rotary_pct: float = Field(1.0, gt=0, le=1, description="share of each head's dims that rotate (GPT-NeoX: 0.25)")
    pos_offset: int = Field(0, ge=0, description="extra learned-position rows before position 0 (OPT: 2)")
    tie_embeddings: bool = Field(False, description="the output head shares the embedding's weight")
    qk_norm: bool = Field(False, description="RMSNorm on q and k per head (Qwen3)")
    sliding_window: int | None = Field(
        None, ge=1, description="attend to the last W positions only (Mistral); none: full causal"
    )
    bias: bool = Field(False, description="biases in every linear layer and LayerNorm")
    qkv_bias: bool = Field(False, description="biases on the q, k and v projections only (Qwen2)")
    parallel_block: bool = Field(False, description="attention and MLP side by side from one norm (GPT-J, NeoX, PaLM)")
    embed_norm: bool = Field(False, description="LayerNorm right after the embedding (BLOOM)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout probability on attention and residual outputs")
    init_std: float = Field(
        0.02, gt=0, description="std of the initial weights; residual output projections get it / sqrt(2·n_layers)"
    )

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
            raise ValueError(
                f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}; "
                "choose a divisor or set model.head_dim"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_kv_heads={self.n_kv_heads} does not divide model.n_heads={self.n_heads}")
        if self.pos == "rope" and int(self.head_dim * self.rotary_pct) % 2:
            raise ValueError(
                f"model.rotary_pct={self.rotary_pct} gives an odd number of rotary dims "
                f"for head_dim={self.head_dim}; rotary dims must be even"
            )
        return self

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_pct)


def hf_model_fields(path: str | Path) -> dict:
    """The validated `model.*` keys that reproduce the Hugging Face model in `path` (its config.json);
    a missing or malformed field is one line naming the folder and the field."""
    try:
        fields = ModelConfig(**model_fields(read_hf_config(path), path)).model_dump(exclude_none=True)
        check_layers(path, fields["n_layers"])
        return fields
    except KeyError as e:
        refuse(Path(path), f"config.json lacks {e}")
    except ValidationError as e:
        err = e.errors()[0]
        refuse(
            Path(path),
            f"config.json gives model.{'.'.join(map(str, err['loc']))}: {err['msg'].removeprefix('Value error, ')}",
        )
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
    sources: list[SourceConfig] = Field(
        default_factory=list,
        description="weighted mixture [{path, weight, name}, ...]; empty: data.path alone, weight 1",
    )
    tokenizer: str = Field(
        "bpe:4096",
        description="tokenizer.json path, or bpe:VOCAB to train one; default "
        "bpe:4096, or the tokenizer of model.init_from",
    )
    seq_len: int = Field(256, ge=1, description="tokens per training sequence; at most model.max_seq_len")
    val_fraction: float = Field(0.05, ge=0, lt=1, description="share of documents held out for validation")
    document_mask: bool = Field(
        False, description="attention stays inside each document of a packed window (Llama 3); documents end at EOS"
    )
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
    steps: int = Field(300, ge=1, description="optimizer steps of the whole run (the LR schedule spans them)")
    stop_after: int | None = Field(
        None,
        ge=1,
        description="end this invocation at this step (schedule still "
        "spans train.steps); resume continues, e.g. across job time limits",
    )
    global_batch: int = Field(16, ge=1, description="sequences per optimizer step")
    micro_batch: int = Field(
        default_factory=lambda v: max(
            d for d in range(1, min(16, v["global_batch"]) + 1) if v["global_batch"] % d == 0
        ),
        ge=1,
        description="sequences per forward/backward on one rank; default: the largest divisor of global_batch up to 16",
    )
    dtype: Literal["auto", "bf16", "fp32"] = Field(
        "bf16",
        description="bf16 autocast (fp32 master weights) or fp32; auto: bf16 where cluster.hardware multiplies "
        "bf16 at speed (a GPU with a bf16 peak; cpu: this machine's CPU, with AMX or AVX512-BF16), else fp32",
    )
    float8: Literal["none", "rowwise", "tensorwise"] = Field(
        "none",
        description="the blocks' linear layers in "
        "float8 (torchao; embedding and head stay in train.dtype); "
        "needs a GPU of compute capability >= 8.9",
    )
    float8_emulate: bool = Field(False, description="with train.float8: torchao's emulation (any device, slow; tests)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu")
    compile: bool | Literal["auto"] = Field(
        "auto",
        description="torch.compile each block and the loss; auto: "
        "for runs of >= 1000 steps on one process or plain data parallel",
    )
    loss_chunk_tokens: int | Literal["auto"] = Field(
        "auto",
        description="tokens per checkpointed chunk of the head and loss (0: the whole micro-batch at once); "
        "auto: chunks of 256 MiB of fp32 logits where a micro-batch's exceed that",
    )

    @field_validator("loss_chunk_tokens")
    @classmethod
    def _chunk_not_negative(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 0:
            raise ValueError(f"must be >= 0 tokens (0: no chunks) or auto, not {v}")
        return v

    eval_every: int = Field(100, ge=0, description="0 = only at the end")
    eval_batches: int = Field(8, ge=1, description="validation batches per evaluation (a fixed set)")
    sample_tokens: int = Field(120, ge=0, description="tokens of sample text generated at the end")
    sample_prompt: str = Field("Romeo.\n", description="prompt of the sample generated at the end")
    eval_tasks: list[str] = Field(default_factory=list, description="task names run at every evaluation")
    eval_task_limit: int = Field(100, ge=1, description="examples per task during training")
    preflight: bool = Field(
        True,
        description="before preparing data or allocating, predict every rank's peak "
        "memory with the planner and refuse (exit 2, with the nearest change that fits) a run "
        "that will not fit its devices",
    )
    memory_snapshot: bool = Field(
        False,
        description="CUDA: record the allocator's history from the start, so an "
        "out-of-memory step also writes memory_snapshot.pickle (pytorch.org/memory_viz)",
    )


class OptimConfig(Section):
    lr: float = Field(3e-3, gt=0, description="peak learning rate")
    min_lr: float = Field(3e-4, ge=0, description="learning rate at the end of the decay")
    warmup_steps: int = Field(30, ge=0, description="linear warmup from 0 to optim.lr")
    schedule: Literal["cosine", "linear", "wsd", "constant"] = Field(
        "cosine", description="decay after warmup (wsd: warmup-stable-decay)"
    )
    decay_fraction: float = Field(0.2, gt=0, le=1, description="WSD: share of steps spent decaying")
    weight_decay: float = Field(
        0.1, ge=0, description="AdamW decoupled weight decay; norms, biases and embeddings are not decayed"
    )
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW first-moment decay")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW second-moment decay")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float = Field(1.0, ge=0, description="clip the global gradient norm to this; 0 = off")


class ParallelConfig(Section):
    dp: int | None = Field(None, ge=1, description="default: what is left of the world size")
    dp_replicate: int = Field(1, ge=1, description="HSDP: replica groups across which shards are replicated")
    zero: Literal[0, 1, 2, 3] = Field(
        0, description="ZeRO stage: 0 replicate (DDP), 1 shard optimizer state, 2 + gradients, 3 + parameters (FSDP2)"
    )
    tp: int = Field(1, ge=1, description="tensor-parallel degree (Megatron column/row split)")
    pp: int = Field(1, ge=1, description="pipeline-parallel stages")
    cp: int = Field(1, ge=1, description="context-parallel degree (sequence split across ranks)")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "dualpipev"] = Field(
        "1f1b", description="pipeline schedule (torch.distributed.pipelining)"
    )
    virtual_stages: int = Field(1, ge=1, description="model chunks per pipeline rank (interleaved schedules)")
    pp_layers: list[int] | None = Field(
        None, description="layers per pipeline stage (pp·virtual_stages entries); default: balanced by parameter count"
    )
    sequence_parallel: bool = Field(False, description="with tp: norms and dropout on a sequence shard")
    recompute: Literal["none", "selective", "op", "full", "auto"] = Field(
        "none",
        description="activation checkpointing: selective = the attention core; op = per operator, each block keeps "
        "its matmul and attention outputs and recomputes the rest; full = whole blocks; auto = the cheapest "
        "that fits the device, by the planner",
    )
    recompute_every: int = Field(
        1, ge=1, description="with recompute=op or full: checkpoint every Nth block of a stage (the others keep all)"
    )
    layout: Literal["manual", "auto"] = Field(
        "manual", description="auto: the planner picks the unset degrees for cluster.hardware and the world size"
    )


class CheckpointConfig(Section):
    model_config = ConfigDict(populate_by_name=True)

    interval: int | Literal["auto"] = Field(
        0,
        description="steps between checkpoints; 0 = only at the end; "
        "auto = Young/Daly interval from the measured write time and "
        "cluster.gpu_mtbf_hours",
    )
    keep: int = Field(2, ge=1, description="newest complete checkpoints kept")
    resume: str = Field("auto", description="auto (latest complete), none, or a checkpoint path")
    async_save: bool = Field(
        False, alias="async", description="write with DCP's async save while training goes on (at most one in flight)"
    )
    on_error: Literal["stop", "continue"] = Field(
        "stop", description="a failed write (disk full, unwritable dir): stop cleanly, or warn and keep training"
    )
    verify: Literal["sha256", "size"] = Field(
        "sha256",
        description="what resume checks before trusting a checkpoint: every file's checksum, or only sizes (fast)",
    )

    @model_validator(mode="after")
    def _interval(self) -> CheckpointConfig:
        if isinstance(self.interval, int) and self.interval < 0:
            raise ValueError(f'checkpoint.interval={self.interval}: use a step count >= 0 or "auto"')
        return self


class GuardConfig(Section):
    """Loss-spike and NaN guard (PaLM's recipe: roll back, skip the offending data)."""

    enabled: bool = Field(True, description="skip non-finite updates and roll back on loss spikes")
    spike_zscore: float = Field(6.0, gt=0, description="a loss this many running std above the running mean is a spike")
    window: int = Field(50, ge=2, description="steps in the running loss window")
    min_window: int = Field(10, ge=2, description="steps of history before spikes are judged")
    max_skips: int = Field(3, ge=1, description="consecutive non-finite steps that trigger a rollback")
    skip_batches: int = Field(200, ge=0, description="batches skipped after a rollback (at least up to the bad one)")
    max_rollbacks: int = Field(3, ge=0, description="rollbacks before stopping (counted across resumes)")


class WatchdogConfig(Section):
    collective_timeout_s: float = Field(
        600.0, gt=0, description="a collective waiting longer fails the job (torchrun then restarts it)"
    )
    hang_factor: float = Field(
        10.0, gt=1, description="dump every thread's stack when a step runs this many times the median step time"
    )
    min_s: float = Field(300.0, gt=0, description="never dump before a step has run this long")


class LogConfig(Section):
    every: int = Field(10, ge=1, description="log a metrics row (and sync with the device) every N steps")
    tensorboard: bool = Field(False, description="mirror metrics to TensorBoard event files (flopwise[tensorboard])")


# The largest cluster the planner describes: 2^20 devices, five times the largest training cluster
# published by 2026 (xAI's Colossus, ~200k GPUs); beyond it a layout search would only count divisors.
MAX_DEVICES = 1 << 20


class ClusterConfig(Section):
    hardware: str = Field(
        "cpu",
        description="the device the planner plans for (a name in the hardware catalogue, or cluster.hardware_file)",
    )
    hardware_file: str | None = Field(None, description="TOML with extra or replaced hardware entries")
    gpus: int = Field(
        1,
        ge=1,
        le=MAX_DEVICES,
        description="devices the planner plans for",
    )
    gpus_per_node: int | None = Field(
        None, ge=1, le=MAX_DEVICES, description="default: the hardware's devices per node"
    )
    storage_gbps_per_gpu: float | None = Field(
        None,
        gt=0,
        description="checkpoint write bandwidth per device, GB/s; default: measured by `hardware calibrate` "
        "(cluster.hardware_file), else Llama 3's 2 TB/s over 16,384 GPUs",
    )
    gpu_mtbf_hours: float | None = Field(
        None,
        gt=0,
        description="mean time between failures of one device; "
        "default: Llama 3's 466 interruptions in 54 days on 16,384 GPUs",
    )
    restart_minutes: float | None = Field(
        None,
        ge=0,
        description="time to detect a failure, restart and reload; default: measured by `hardware calibrate` "
        "(cluster.hardware_file), else 10",
    )
    price_per_gpu_hour: float | None = Field(
        None,
        gt=0,
        description="what one device costs an hour (any currency): prices `plan serve`'s cost per million "
        "tokens; none: GPU-hours only",
    )


class PlanConfig(Section):
    tokens: float | None = Field(None, gt=0, description="training token budget; default 20 tokens per parameter")
    stack: Literal["flopwise", "megatron-2021", "megatron-2022"] = Field(
        "flopwise", description="software assumptions of the step-time model (see flopwise.plan.step)"
    )
    float8: bool = Field(
        False,
        description="let the layout search also consider train.float8 for the "
        "blocks' linear layers (hardware with a float8 peak)",
    )


class ServeConfig(Section):
    """The serving regime `flopwise plan serve` prices: one request's tokens and the batch decoded together."""

    batch: int | None = Field(
        None,
        ge=1,
        description="sequences decoded together per model replica; default: the largest that fits "
        "(and meets serve.latency_ms)",
    )
    prompt_tokens: int = Field(1024, ge=1, description="new input tokens per request (prefilled)")
    cached_tokens: int = Field(0, ge=0, description="tokens already in the KV cache per request (a chat's history)")
    output_tokens: int = Field(256, ge=1, description="tokens generated per request (the served tokens)")
    weights_dtype: Literal["bf16", "fp8", "int8"] = Field(
        "bf16", description="stored weights (weight-only quantisation: matmuls still run at the 16-bit peak)"
    )
    latency_ms: float | None = Field(
        None, gt=0, description="target decode time per token; a layout or batch over it does not qualify"
    )


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
    serve: ServeConfig = ServeConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        m, t = self.model, self.train
        if m.init_from and "tokenizer" not in self.data.model_fields_set:
            self.data.tokenizer = str(Path(m.init_from[3:]) / "tokenizer.json")
        if m.init_from and self.data.tokenizer.startswith("bpe:"):
            raise ValueError(
                f"data.tokenizer={self.data.tokenizer} trains a new tokenizer, whose ids mean nothing to "
                f"the embeddings of model.init_from={m.init_from}; leave data.tokenizer unset (the "
                "default with init_from is its folder's tokenizer.json)"
            )
        if self.data.seq_len > m.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
                "lower data.seq_len or raise model.max_seq_len"
            )
        if t.global_batch % t.micro_batch:
            raise ValueError(f"train.micro_batch={t.micro_batch} does not divide train.global_batch={t.global_batch}")
        if self.optim.min_lr > self.optim.lr:
            raise ValueError(f"optim.min_lr={self.optim.min_lr} exceeds optim.lr={self.optim.lr}")
        if self.guard.min_window > self.guard.window:
            raise ValueError(f"guard.min_window={self.guard.min_window} exceeds guard.window={self.guard.window}")
        if self.optim.warmup_steps > t.steps:
            raise ValueError(f"optim.warmup_steps={self.optim.warmup_steps} exceeds train.steps={t.steps}")
        if t.dtype == "auto":  # resolved here, once: every reader of the config sees bf16 or fp32
            t.dtype = auto_dtype(cluster_hardware(self.cluster))
        return self


# ---------------------------------------------------------------------------------------------
# Loading


def _builtin_config_path(name: str) -> Path:
    return Path(str(resources.files("flopwise") / "configs" / f"{name}.toml"))


def _read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.suffix and not p.exists() and _builtin_config_path(str(path)).exists():
        p = _builtin_config_path(str(path))
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


# Continued pre-training (model.init_from): the recipe's defaults, used where the user set no
# value (a built-in config such as demo sets none: its values are for training from scratch).
# - learning rate 1e-4, cosine to 1e-5: a small fraction of a from-scratch rate (the demo's 3e-3 is
#   30x that; at it a pretrained model's loss rose 2.93 -> 6.21 in two steps). Gupta et al. 2023,
#   "Continual Pre-Training of Large Language Models: How to (re)warm your model?" (arXiv
#   2308.04014): re-warming to a high maximum rate costs upstream loss, and a lower maximum rate
#   forgets less; Ibrahim et al. 2024, "Simple and Scalable Strategies to Continually Pre-train
#   Large Language Models" (arXiv 2403.08763): re-warm then re-decay (cosine) to a tenth of the max.
# - warm-up 1% of train.steps (at least 1): Gupta et al. found the warm-up length matters little;
#   both papers warm up over about 1% of the steps.
# - data.seq_len the model's own context (model.max_seq_len, at most 4096 on the first try): the
#   windows it was trained on, so the first loss equals the pretrained model's.
CONTINUED_LR, CONTINUED_MIN_LR, CONTINUED_WARMUP, CONTINUED_MAX_SEQ = 1e-4, 1e-5, 0.01, 4096


def _continued_defaults(tree: dict[str, Any], user: dict[str, Any]) -> list[str]:
    """With model.init_from in `tree`, set the continued-pretraining defaults (above) for every key
    that `user` (the keys the user gave) does not set, and drop a preset the user did not name
    (init_from gives the shape); the `key=value`s applied."""
    model = tree.get("model")
    if not isinstance(model, dict) or not str(model.get("init_from")).startswith("hf:"):
        return []  # none, or not hf:PATH (which validation refuses)
    mine = {sec: keys for sec, keys in user.items() if isinstance(keys, dict)}
    if "preset" not in mine.get("model", {}):
        model.pop("preset", None)
    steps = tree.get("train", {}).get("steps", TrainConfig.model_fields["steps"].default)
    values: dict[str, Any] = {
        "optim.lr": lambda: CONTINUED_LR,
        "optim.min_lr": lambda: tree["optim"]["lr"] * CONTINUED_MIN_LR / CONTINUED_LR,
        "optim.warmup_steps": lambda: max(1, round(CONTINUED_WARMUP * steps)),
        "data.seq_len": lambda: min(
            tree["model"].get("max_seq_len") or hf_model_fields(model["init_from"][3:])["max_seq_len"],
            CONTINUED_MAX_SEQ,
        ),
    }
    applied = []
    for key, value in values.items():
        section, name = key.split(".")
        if name in mine.get(section, {}) or not isinstance(tree.setdefault(section, {}), dict):
            continue
        try:
            tree[section][name] = value()
        except (TypeError, ValueError, KeyError):  # a malformed value the user gave: validation names it
            continue
        applied.append(f"{key}={tree[section][name]:g}")
    return applied


def load_tree(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), applied: list[str] | None = None
) -> dict[str, Any]:
    """The raw key tree a user gave: TOML (a path, a built-in name, or none) plus overrides, with
    the continued-pretraining defaults where model.init_from is set (appended to `applied`)."""
    tree = _read_toml(path) if path is not None else {}
    builtin = path is not None and not Path(path).is_file() and _builtin_config_path(str(path)).is_file()
    user = {} if path is None or builtin else _read_toml(path)
    for item in overrides:
        apply_override(tree, item)
        apply_override(user, item)
    done = _continued_defaults(tree, user)
    if applied is not None:
        applied += done
    return tree


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), applied: list[str] | None = None
) -> Config:
    """Load TOML (a path, a built-in name, or none for defaults), apply overrides, validate
    (`applied`: see load_tree)."""
    return validate(load_tree(path, overrides, applied))


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
