"""Compute-optimal allocation: published scaling laws, inference-aware and data-constrained
optima, a concrete shape near N_opt, and the batch size and learning rate to train it with.

Pure Python (math only). Conventions: C = 6·N·D training FLOPs (Kaplan eq. 2.1, Hoffmann §3);
N counts embeddings for the Chinchilla/Epoch laws (Hoffmann App. F) and excludes them for Kaplan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flopwise.errors import ConfigError
from flopwise.flops import scaling_flops, scaling_tokens

if TYPE_CHECKING:
    from flopwise.config.schema import ModelConfig

_PF_DAY = 8.64e19  # FLOPs in one petaflop/s-day (Kaplan §2.1)


@dataclass(frozen=True)
class ParametricLaw:
    """L(N, D) = E + A/N^α + B/D^β (Hoffmann et al. 2022, eq. 2)."""

    name: str
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str = ""
    embeddings: bool = True  # N counts the embeddings (Hoffmann); False: a law fitted to a sweep's non-embedding N

    def loss(self, n: float, d: float) -> float:
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    @property
    def a(self) -> float:
        """Exponent of N_opt ∝ C^a: β/(α+β)."""
        return self.beta / (self.alpha + self.beta)

    def frontier(self, flops: float) -> tuple[float, float]:
        """Closed-form optimum under C = 6ND (Hoffmann eq. 4): N_opt = G·(C/6)^a, D_opt = (C/6)^b / G."""
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))
        n = g * (flops / 6) ** self.a
        return n, scaling_tokens(flops, n)


@dataclass(frozen=True, kw_only=True)
class PowerLawAllocation:
    """N_opt = k·C^a, D_opt = C/(6·N_opt): Approaches 1 and 2, and Kaplan's compute-efficient frontier."""

    name: str
    k: float
    a: float
    source: str = ""
    flops_unit: float = 1.0  # Kaplan's fit takes C in PF-days

    def frontier(self, flops: float) -> tuple[float, float]:
        n = self.k * (flops / self.flops_unit) ** self.a
        return n, scaling_tokens(flops, n)


# Hoffmann et al. 2022 Table 3 (Approach 1) and Table A3 (Approach 2): (params, FLOPs).
CHINCHILLA_TABLE3 = [
    (400e6, 1.92e19),
    (1e9, 1.21e20),
    (10e9, 1.23e22),
    (67e9, 5.76e23),
    (175e9, 3.85e24),
    (280e9, 9.90e24),
    (520e9, 3.43e25),
    (1e12, 1.27e26),
    (10e12, 1.30e28),
]
_CHINCHILLA_TABLE_A3_A2 = [
    (400e6, 1.84e19),
    (1e9, 1.20e20),
    (10e9, 1.32e22),
    (67e9, 6.88e23),
    (175e9, 4.54e24),
    (280e9, 1.18e25),
    (520e9, 4.19e25),
    (1e12, 1.59e26),
    (10e12, 1.75e28),
]


def _power_law(rows: list[tuple[float, float]]) -> dict[str, float]:
    """k and a of N = k·C^a by least squares in log space over a paper's (N, C) table."""
    xs, ys = [math.log(c) for _, c in rows], [math.log(n) for n, _ in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return {"k": math.exp(my - a * mx), "a": a}


# Kaplan et al. 2020 Table 2: L(N, D) = [(N_c/N)^(α_N/α_D) + D_c/D]^α_D (non-embedding N, nats on WebText2).
_KAPLAN_LND = dict(alpha_n=0.076, alpha_d=0.103, n_c=6.4e13, d_c=1.8e13)


def _kaplan_loss(n: float, d: float) -> float:
    k = _KAPLAN_LND
    return ((k["n_c"] / n) ** (k["alpha_n"] / k["alpha_d"]) + k["d_c"] / d) ** k["alpha_d"]


HOFFMANN = ParametricLaw(
    name="chinchilla-3",
    E=math.exp(0.5267228),
    A=math.exp(6.0073404),
    B=math.exp(6.0179186),
    alpha=0.33917084,
    beta=0.2849083,
    source="Hoffmann et al. 2022 eq. 10, unrounded constants from the TeX source (as used by Epoch)",
)
EPOCH = ParametricLaw(
    name="epoch",
    E=math.exp(0.59711196),
    A=math.exp(6.17795598),
    B=math.exp(7.64273236),
    alpha=0.34781303,
    beta=0.36585412,
    source="Besiroglu et al. 2024 (Epoch AI) refit of Hoffmann's Figure 4 data, 240 points",
)

LAWS: dict[str, ParametricLaw | PowerLawAllocation] = {
    # Training at the critical batch costs C = 2·C_min (Kaplan eq. 5.5, §6): C_min = C/2. This reproduces
    # the 4.68B that Hoffmann et al. §D.4 quote as Kaplan's optimum for 1e21 FLOPs.
    "kaplan": PowerLawAllocation(
        name="kaplan",
        k=1.3e9,
        a=0.73,
        flops_unit=2 * _PF_DAY,
        source="Kaplan et al. 2020 §6: N_opt = 1.3e9·C_min^0.73, C_min = C/2 in PF-days (non-embedding N)",
    ),
    # The papers give the exponents (Table 2: 0.50 and 0.49) but not the coefficients; both are read
    # back from the tables of their projections (a = 0.498 and 0.488, inside Table 2's intervals).
    "chinchilla-1": PowerLawAllocation(
        name="chinchilla-1",
        **_power_law(CHINCHILLA_TABLE3),
        source="Hoffmann et al. 2022 Approach 1, fitted to its Table 3 projections",
    ),
    "chinchilla-2": PowerLawAllocation(
        name="chinchilla-2",
        **_power_law(_CHINCHILLA_TABLE_A3_A2),
        source="Hoffmann et al. 2022 Approach 2, fitted to its Table A3 projections",
    ),
    "chinchilla-3": HOFFMANN,
    "epoch": EPOCH,
    # Not a published law: this setting's own optimum sits near a third of chinchilla-1's N (a 512-token
    # vocabulary, 128-token context), so `scale sweep --preset cpu-tiny` centres its sizes on this fit.
    "cpu-tiny": ParametricLaw(
        name="cpu-tiny",
        E=2.20,
        A=6.63,
        B=841.0,
        alpha=0.23,
        beta=0.52,
        embeddings=False,
        source="scale fit of the first cpu-tiny ladder (3e11-3e12 FLOPs, 15 runs; docs/scaling-laws.md), "
        "non-embedding N, Shakespeare with a 512-token BPE at seq 128",
    ),
}


def get_law(name: str, fitted: ParametricLaw | None = None) -> ParametricLaw | PowerLawAllocation:
    if name.startswith("fitted:"):
        if fitted is None:
            raise ConfigError("--law fitted:FILE needs the fit file (written by `flopwise scale fit --out`)")
        return fitted
    if name not in LAWS:
        raise ConfigError(f"--law {name!r}: unknown (known: {', '.join(LAWS)}, fitted:FILE)")
    return LAWS[name]


def loss_law(law) -> ParametricLaw | None:
    """The parametric law that predicts loss for an allocation: its own, else Hoffmann's Approach 3.
    Kaplan's allocation is evaluated with Kaplan's own L(N, D) instead (see `predicted_loss`)."""
    return law if isinstance(law, ParametricLaw) else (None if law.name == "kaplan" else HOFFMANN)


def predicted_loss(law, n: float, d: float) -> tuple[float, str]:
    pl = loss_law(law)
    if pl is None:  # Kaplan's allocation
        return _kaplan_loss(n, d), "kaplan L(N, D), Table 2 (WebText2 nats)"
    return pl.loss(n, d), pl.name


# --- inference-aware and data-constrained optima --------------------------------------------


def _golden_min(f, lo: float, hi: float, iters: int = 200) -> float:
    """Minimise a unimodal f on [lo, hi] (log-space arguments are passed in by the callers)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    for _ in range(iters):
        if f(c) < f(d):
            b = d
        else:
            a = c
        c, d = b - g * (b - a), a + g * (b - a)
    return (a + b) / 2


def _flops_per_served_token(n: float) -> float:
    return 2 * n  # a forward pass (Kaplan eq. 2.1)


@dataclass(frozen=True)
class Pricing:
    """A model's lifetime cost in one unit: training N on D tokens, and each served token.
    `iters`: golden-section steps of the search (fewer where each prices a planned model)."""

    train: Callable[[float, float], float] = scaling_flops
    serve: Callable[[float], float] = _flops_per_served_token
    unit: str = "FLOPs (6·N·D + 2·N per served token)"
    iters: int = 200


FLOP_PRICING = Pricing()


def inference_aware(
    law: ParametricLaw, flops: float, inference_tokens: float, pricing: Pricing = FLOP_PRICING
) -> tuple[float, float]:
    """Sardana & Frankle 2024: reach the loss the compute-optimal model reaches with C, minimising
    the lifetime cost train(N, D) + T·serve(N) instead of training alone: in FLOPs by default
    (their formulation), in device-hours of the serving plan from `scale.lifetime`."""
    n0, d0 = law.frontier(flops)
    target = law.loss(n0, d0)

    def tokens_for(n: float) -> float:
        gap = target - law.E - law.A / n**law.alpha
        return (law.B / gap) ** (1 / law.beta) if gap > 0 else math.inf

    def total(log_n: float) -> float:
        n = math.exp(log_n)
        d = tokens_for(n)
        return pricing.train(n, d) + inference_tokens * pricing.serve(n) if math.isfinite(d) else math.inf

    # N below n_min cannot reach the target loss with any amount of data
    n_min = (law.A / (target - law.E)) ** (1 / law.alpha)
    log_n = _golden_min(total, math.log(n_min) + 1e-9, math.log(n0) + 1e-9, pricing.iters)
    n = math.exp(log_n)
    return n, tokens_for(n)


_R_STAR_D = 15.4  # Muennighoff et al. 2023 eq. 5: fitted R*_D, the repetitions after which data is ~worthless


def effective_tokens(tokens: float, unique: float) -> float:
    """Muennighoff et al. 2023: D' = U + U·R*·(1 − exp(−R/R*)), R = D/U − 1 repeated epochs."""
    if tokens <= unique:
        return tokens
    repeats = tokens / unique - 1
    return unique + unique * _R_STAR_D * (1 - math.exp(-repeats / _R_STAR_D))


def data_constrained(law: ParametricLaw, flops: float, unique_tokens: float) -> tuple[float, float]:
    """Best N for C when only `unique_tokens` exist: minimise L(N, D'(C/6N)), repeats discounted."""
    n0, _ = law.frontier(flops)

    def loss(log_n: float) -> float:
        n = math.exp(log_n)
        return law.loss(n, effective_tokens(scaling_tokens(flops, n), unique_tokens))

    log_n = _golden_min(loss, math.log(n0) - 6, math.log(n0) + 6)
    n = math.exp(log_n)
    return n, scaling_tokens(flops, n)


# --- shape, batch, learning rate -------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ChosenShape:
    n_layers: int
    d_model: int
    n_heads: int
    ffn_dim: int
    head_dim: int
    params: int
    non_embedding_params: int
    model: ModelConfig = field(repr=False, compare=False)  # the shape as a model the planner prices


# Shapes within this share of the target parameter count are as good for the law (its loss is flat
# there), so among them the most usual aspect ratio wins (ASPECT_CENTRE); with none that close,
# the closest
_SHAPE_TOLERANCE = 0.02
# d_model/n_layers a shape leans to: the geometric centre of Chinchilla's Table A9 models (64-110);
# Llama 2 7B-70B (102-128) and GPT-3 13B-175B (128-133) sit above it, inside Kaplan §3.1's flat range
_ASPECT_CENTRE = math.sqrt(64 * 110)


def choose_shape(
    target: float, vocab_size: int, count_embeddings: bool, mlp: str = "swiglu", aspect: tuple[float, float] = (32, 128)
) -> ChosenShape:
    """A Llama-style shape whose parameter count is within SHAPE_TOLERANCE of `target` (else the
    closest), and among those the one whose d_model/n_layers is nearest ASPECT_CENTRE (the closest
    count alone picks extremes of the range for large targets: 130 × 6656 for 70B).

    Heads divide the width: head_dim 128 with d_model a multiple of 1024 from 1024 up (n_heads a
    multiple of 8, so tensor parallelism within a node of 8 splits them; a prime count such as 59
    allows no tensor parallelism at all), head_dim 64 with d_model a multiple of 128 from 512, 32
    with a multiple of 32 from 128, 16 with a multiple of 16 below (the ladder's tiny CPU models,
    tens of thousands of parameters, in steps fine enough to bracket an optimum). The SwiGLU ffn is
    8/3·d rounded up to 256 (to 32 below d_model 1024; 4·d otherwise), and d_model/n_layers stays
    inside `aspect`, the range Kaplan §3.1 found flat and Chinchilla's Table A9 models use (64-110).
    """
    from flopwise.config.schema import ModelConfig
    from flopwise.flops import count_params

    shapes = []  # (|log(count/target)|, n_layers, d_model, head_dim, ffn)
    for n_layers in range(1, 513):
        # only the d_model the aspect range allows (the rest were skipped one by one)
        for d in range(
            16 * max(1, math.ceil(aspect[0] * n_layers / 16)), min(131072, int(aspect[1] * n_layers)) + 1, 16
        ):
            head_dim = _head_dim(d)
            if head_dim is None or not aspect[0] <= d / n_layers <= aspect[1]:
                continue
            unit = 256 if d >= 1024 else 32
            ffn = unit * math.ceil(8 * d / 3 / unit) if mlp == "swiglu" else 4 * d
            approx = n_layers * (4 * d * d + (3 if mlp == "swiglu" else 2) * d * ffn)
            approx += vocab_size * d * 2 if count_embeddings else 0
            shapes.append((abs(math.log(approx / target)), n_layers, d, head_dim, ffn))
            if approx > 3 * target:
                break
    if not shapes:
        raise ConfigError(f"no shape near {target:.3g} parameters within aspect ratio {aspect}")
    closest = min(shapes)[0]
    _, n_layers, d, head_dim, ffn = min(
        (s for s in shapes if s[0] <= max(closest, _SHAPE_TOLERANCE)),
        key=lambda s: (abs(math.log(s[2] / s[1] / _ASPECT_CENTRE)), s[0]),
    )
    m = ModelConfig.model_validate(
        dict(
            arch="llama",
            n_layers=n_layers,
            d_model=d,
            n_heads=d // head_dim,
            head_dim=head_dim,
            ffn_dim=ffn,
            vocab_size=vocab_size,
            max_seq_len=8192,
            mlp=mlp,
        )
    )
    c = count_params(m)
    return ChosenShape(
        n_layers=n_layers,
        d_model=d,
        n_heads=d // head_dim,
        ffn_dim=ffn,
        head_dim=head_dim,
        params=c.total,
        non_embedding_params=c.non_embedding,
        model=m,
    )


def _head_dim(d: int) -> int | None:
    """The head size of width `d` (see choose_shape), or None for a width the shapes skip."""
    for floor, step, head in ((1024, 1024, 128), (512, 128, 64), (128, 32, 32), (0, 16, 16)):
        if d >= floor:
            return head if d % step == 0 else None
    return None


def batch_and_lr(flops: float) -> tuple[float, float, str]:
    """DeepSeek LLM (Bi et al. 2024, eq. 1) power laws fitted over 1e17-2e19 FLOPs:
    B_opt = 0.2920·C^0.3271 tokens, η_opt = 0.3118·C^-0.1250."""
    return 0.2920 * flops**0.3271, 0.3118 * flops**-0.1250, "DeepSeek LLM eq. 1 (B and η as power laws of C)"


@dataclass(kw_only=True)
class Allocation:
    law: str
    flops: float
    params: float
    tokens: float
    predicted_loss: float
    loss_law: str
    shape: ChosenShape
    global_batch_tokens: float
    lr: float
    batch_rule: str
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params

    def to_json(self) -> dict:
        return {
            "params": self.params,
            "tokens": self.tokens,
            "tokens_per_param": self.tokens_per_param,
            "flops": self.flops,
            "predicted_loss": self.predicted_loss,
            "loss_law": self.loss_law,
            "law": self.law,
            "shape": {
                "n_layers": self.shape.n_layers,
                "d_model": self.shape.d_model,
                "n_heads": self.shape.n_heads,
                "ffn_dim": self.shape.ffn_dim,
                "head_dim": self.shape.head_dim,
                "params": self.shape.params,
            },
            "global_batch_tokens": self.global_batch_tokens,
            "lr": self.lr,
            "batch_rule": self.batch_rule,
            "notes": self.notes,
        }


def allocate(
    flops: float,
    law_name: str = "chinchilla-3",
    inference_tokens: float = 0.0,
    unique_tokens: float | None = None,
    vocab_size: int = 32000,
    fitted: ParametricLaw | None = None,
    pricing: Pricing = FLOP_PRICING,
) -> Allocation:
    """N and D under `law_name` for `flops`; with `inference_tokens`, the same loss at the least
    lifetime cost under `pricing`; with `unique_tokens`, repeats discounted."""
    if not (math.isfinite(flops) and flops > 0):
        raise ConfigError(f"--flops {flops:g}: expected a finite budget > 0 in FLOPs, e.g. --flops 1e21")
    if not (math.isfinite(inference_tokens) and inference_tokens >= 0):
        raise ConfigError(
            f"--inference-tokens {inference_tokens:g}: expected a finite token count >= 0 (0: training cost only)"
        )
    if unique_tokens is not None and not (math.isfinite(unique_tokens) and unique_tokens > 0):
        raise ConfigError(
            f"--unique-tokens {unique_tokens:g}: expected a finite token count > 0 (or prepared "
            "data dirs holding tokens)"
        )
    law = get_law(law_name, fitted)
    notes: list[str] = []
    n, d = law.frontier(flops)
    if inference_tokens > 0:
        pl = loss_law(law)
        if pl is None:
            raise ConfigError("--inference-tokens needs a parametric loss law (chinchilla-3, epoch or fitted:FILE)")
        n, d = inference_aware(pl, flops, inference_tokens, pricing)
        flops = scaling_flops(n, d)
        notes.append(
            f"inference-aware: same loss as the compute-optimal model, {inference_tokens:.3g} inference "
            f"tokens priced in {pricing.unit}; training FLOPs become {flops:.3g}"
        )
    if unique_tokens is not None and d > unique_tokens:
        pl = loss_law(law)
        if pl is None:
            raise ConfigError("--unique-tokens needs a parametric loss law (chinchilla-3, epoch or fitted:FILE)")
        n, d = data_constrained(pl, flops, unique_tokens)
        epochs = d / unique_tokens
        notes.append(
            f"data-constrained: {epochs:.1f} epochs over {unique_tokens:.3g} unique tokens "
            f"(repeats discounted as Muennighoff et al. 2023, R*={_R_STAR_D})"
        )
        if epochs > 4:
            notes.append("over 4 epochs: returns from repeated data fall off quickly; consider more unique data")
    loss, loss_name = predicted_loss(law, n, effective_tokens(d, unique_tokens) if unique_tokens else d)
    is_kaplan = isinstance(law, PowerLawAllocation) and law.name == "kaplan"
    embeddings = not is_kaplan and (law.embeddings if isinstance(law, ParametricLaw) else True)
    shape = choose_shape(n, vocab_size, count_embeddings=embeddings)
    shape_n = shape.params if embeddings else shape.non_embedding_params
    if abs(shape_n / n - 1) > 0.1:
        notes.append(f"nearest allowed shape has {shape_n:.3g} parameters ({100 * (shape_n / n - 1):+.0f}%)")
    batch, lr, rule = batch_and_lr(flops)
    return Allocation(
        law=law.name,
        flops=flops,
        params=n,
        tokens=d,
        predicted_loss=loss,
        loss_law=loss_name,
        shape=shape,
        global_batch_tokens=batch,
        lr=lr,
        batch_rule=rule,
        notes=notes,
    )


def round_batch(sequences: float) -> int:
    """A global batch near `sequences` with many divisors: a multiple of the largest power of two
    that leaves 4-8 of it (within 12.5% of the rule's value), so data-parallel degrees up to that
    power divide it (5,672 = 8 x 709, a prime, admits no data parallelism beyond 8)."""
    if sequences < 8:
        return max(1, round(sequences))
    unit = 2 ** (math.floor(math.log2(sequences)) - 2)
    return unit * round(sequences / unit)


def allocation_config(a: Allocation, seq_len: int, vocab_size: int, hardware: str, gpus: int) -> str:
    """A training TOML for the allocation that `flopwise plan` searches and `flopwise train` runs:
    the shape, `plan.tokens` (the allocation's D), `gpus` devices of `hardware`, a global batch near
    the rule's with many divisors, and the layout left to the search (parallel.layout=auto, no
    parallel.* or train.micro_batch given); a tokenizer trained to the model's vocabulary."""
    import tomli_w

    from flopwise.config.schema import validate

    global_batch = round_batch(a.global_batch_tokens / seq_len)
    steps = max(1, round(a.tokens / (global_batch * seq_len)))
    s = a.shape
    name = f"{a.law.replace(':', '-')}-{s.params / 1e9:.2f}B"
    tree = {
        "run": {"name": name, "dir": f"runs/{name}"},
        "model": {
            "arch": "llama",
            "n_layers": s.n_layers,
            "d_model": s.d_model,
            "n_heads": s.n_heads,
            "head_dim": s.head_dim,
            "ffn_dim": s.ffn_dim,
            "vocab_size": vocab_size,
            "max_seq_len": seq_len,
        },
        "data": {"seq_len": seq_len, "tokenizer": f"bpe:{vocab_size}"},
        "train": {"steps": steps, "global_batch": global_batch, "eval_every": max(1, steps // 20)},
        "optim": {
            "lr": a.lr,
            "min_lr": 0.1 * a.lr,
            "warmup_steps": min(2000, max(1, steps // 100)),
            "schedule": "cosine",
        },
        "parallel": {"layout": "auto"},
        "checkpoint": {"interval": max(1, steps // 50)},
        "cluster": {"hardware": hardware, "gpus": gpus},
        "plan": {"tokens": float(round(a.tokens))},
    }
    validate(tree)
    header = (
        f"# {a.law}: N = {a.params:.4g} (shape {s.params:.4g}), D = {a.tokens:.4g} tokens, C = {a.flops:.4g} "
        f"FLOPs, predicted loss {a.predicted_loss:.3f} ({a.loss_law}); batch/LR: {a.batch_rule}\n"
        f"# the layout is the planner's (`flopwise plan` this file; parallel.layout=auto when it trains); "
        f"data.path: the shipped sample until you point it at your corpus (data.tokenizer trains a "
        f"{vocab_size:,}-token BPE on it)\n"
    )
    return header + tomli_w.dumps(tree)
