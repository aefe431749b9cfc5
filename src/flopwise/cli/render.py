"""Numbers and tables as the commands print them: sizes, durations and counts in the unit that
shows them, and the planner's tables (layouts, micro-batch limits, predicted beside measured)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from flopwise.cli.common import stdout


def duration(days: float) -> str:
    """A duration in the unit that shows it: "3.2 days", "5.1 h", "12 min", "40 s" (a small plan
    printed "0.0 days")."""
    for unit, per_day, fmt in (("days", 1, ".1f"), ("h", 24, ".1f"), ("min", 1440, ".0f")):
        if days * per_day >= 1:
            return f"{days * per_day:{fmt}} {unit}"
    return f"{days * 86400:.0f} s"


def size(n: float) -> str:
    """Bytes in the decimal unit that shows them: "1.30 TB", "538 MB" (a small plan printed "0.00 TB")."""
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n / 1e3:.3g} kB"


def human(n: float) -> str:
    """A count with a suffix: "8.03B", "12.50K"; under a thousand, three digits ("512", "0.53": a
    32-minute plan's GPU-hours, which a whole number showed as 0)."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.3g}"


def new_table(title: str, columns: tuple[str, ...], left: tuple[str, ...] = (), **options) -> Table:
    """A table with its columns right-aligned (numbers), but those in `left`."""
    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right", **options)
    return t


PLAN_COLUMNS = (
    "dp(rep)",
    "zero",
    "tp",
    "pp",
    "cp",
    "schedule",
    "mb",
    "recompute",
    "GiB",
    "step s",
    "tok/s",
    "MFU",
    "HFU",
    "time",
    "GPU-h",
    "why not first",
)


def print_plan(report, top: int, name: str) -> None:
    """The planned model, its `top` layouts, and the best one's time, compile, reliability and data."""
    _plan_header(report, name)
    stdout.print(_layouts(report, top))
    _plan_footer(report)


def _plan_header(report, name: str) -> None:
    cfg, hw = report.cfg, report.hardware
    stdout.print(
        f"{escape(name)}: {human(report.params)} params ({report.params:,}), "
        f"{report.flops_per_token:.3g} FLOPs/token at seq {cfg.data.seq_len}; batch "
        f"{cfg.train.global_batch} seqs; {cfg.cluster.gpus} × {hw.name}; {human(report.tokens)} tokens "
        f"({'plan.tokens' if cfg.plan.tokens else 'plan.tokens unset: 20 per parameter'}); "
        f"searched {report.result.evaluated} layouts, {report.result.fitting} fit"
    )
    src = report.hf
    if src and src["elements"] is not None:
        same = src["elements"] == report.params
        stdout.print(
            f"HF weights: {src['tensors']} tensors, {src['elements']:,} elements "
            + (
                "= the parameter count"
                if same
                else f"[yellow]≠ the parameter count ({src['elements'] - report.params:+,}): tensors this model "
                "does not hold (buffers such as attention masks or rotary tables) or a misread config[/]"
            )
        )


def _layouts(report, top: int) -> Table:
    t = Table(title="layouts, best first" if report.best.fits else "NOTHING FITS: smallest first")
    for col in PLAN_COLUMNS:
        t.add_column(col, no_wrap=col != "why not first")
    for e, why in list(zip(report.result.ranked, report.reasons(), strict=True))[:top]:
        lo = e.layout
        j = e.to_json(report.tokens, report.cfg.cluster.gpus)
        sched = (lo.pp_schedule + (f"×{lo.virtual_stages}" if lo.virtual_stages > 1 else "")) if lo.pp > 1 else "–"
        t.add_row(
            f"{lo.dp}({lo.dp_replicate})",
            str(lo.zero),
            str(lo.tp) + ("sp" if lo.sequence_parallel else ""),
            str(lo.pp),
            str(lo.cp),
            sched,
            str(lo.micro_batch),
            lo.recompute + ({"rowwise": " +fp8r", "tensorwise": " +fp8t"}.get(e.float8, "")),
            f"{e.memory['total'] / 2**30:.1f}",
            f"{e.step_time:.3g}",
            human(e.tokens_per_s),
            f"{e.mfu:.1%}",
            f"{e.hfu:.1%}",
            duration(j["train_days"]),
            human(j["gpu_hours"]),
            why,
        )
    return t


def _plan_footer(report) -> None:
    from flopwise.plan.planner import compile_note

    cfg, hw, b = report.cfg, report.hardware, report.best
    if note := report.float8_note():
        stdout.print(note)
    stdout.print("time of the best step: " + ", ".join(f"{k} {v:.3g} s" for k, v in b.time.items() if v))
    stdout.print(compile_note(cfg, report.tokens, b.layout), highlight=False)
    if hw.extra.get("uncalibrated"):
        stdout.print(f"[yellow]uncalibrated[/]: {escape(hw.source)}", highlight=False)
    if r := report.reliability:
        days = b.to_json(report.tokens, cfg.cluster.gpus)["train_days"]
        stdout.print(
            f"checkpoint {size(r.checkpoint_bytes)}, write {r.write_s:.3g} s, restart {r.restart_s:.3g} s; cluster "
            f"MTBF {r.cluster_mtbf_h:.2f} h; Young/Daly interval {r.interval_daly_s / 60:.0f} min; expected "
            f"goodput {r.goodput:.1%}, {r.failures_expected:.0f} failures over the run: "
            f"{duration(r.wall_days)} of wall-clock with them ({duration(days)} without)"
        )
        stdout.print(f"[dim]failure rate: {escape(r.failure_source)}[/]", highlight=False)
        stdout.print(f"[dim]write time: {escape(r.write_source)}[/]", highlight=False)
        stdout.print(f"[dim]restart time: {escape(r.restart_source)}[/]", highlight=False)
    for d in report.data or []:
        warn = " [yellow](over 4 epochs: repeats add little)[/]" if d.over_repeated else ""
        stdout.print(
            f"data {d.name}: {human(d.unique_tokens)} unique tokens, {d.share:.0%} of the run = "
            f"{d.epochs:.2f} epochs, {human(d.effective_tokens)} effective{warn}"
        )
    stdout.print(f"[dim]stack: {cfg.plan.stack}; memory keeps a {0.1:.0%} fit margin and a 1 GiB runtime reserve[/]")


def print_max_micro_batch(r, name: str) -> None:
    """The largest micro-batch per recompute policy, the next valid one and why it is refused."""
    lo, gib = r.layout, 2**30
    table = Table(
        title=f"largest micro-batch that fits: {escape(name)}, {lo.name()} on {lo.world} × "
        f"{r.hardware.name} ({r.usable_memory / gib:.1f} GiB usable), global batch "
        f"{r.cfg.train.global_batch}, seq {r.cfg.data.seq_len}"
    )
    for col in ("recompute", "max mb", "GiB", "next mb", "GiB ", "past the batch"):
        table.add_column(col, justify="left" if col == "recompute" else "right")
    for lim in r.limits:
        beyond = "–"
        if lim.beyond:
            mb, gb = lim.beyond
            beyond = f"{'≥ ' if lim.beyond_capped else ''}{mb} (batch {gb})"
        elif lim.micro_batch is not None and lim.next_micro_batch is None:
            beyond = f"{lim.micro_batch} (no larger one fits)"
        table.add_row(
            lim.recompute,
            str(lim.micro_batch) if lim.micro_batch else "[red]none fits[/]",
            f"{lim.memory / gib:.2f}" if lim.memory else "–",
            str(lim.next_micro_batch) if lim.next_micro_batch else "– (batch limit)",
            f"{lim.next_memory / gib:.2f}" if lim.next_memory else "–",
            beyond,
        )
    stdout.print(table)
    a = r.to_json()["assumptions"]
    stdout.print(
        f"[dim]valid micro-batches: {', '.join(map(str, r.valid))} (they divide the per-rank batch "
        f"{r.cfg.train.global_batch // lo.dp} and keep the pipeline's rules); GiB: the search's per-device "
        f"total (worst rank, {a['runtime_reserve_bytes'] / gib:g} GiB runtime reserve included) against "
        f"{1 - a['fit_margin']:.0%} of memory; past the batch: when every valid one fits, the largest "
        "that would with train.global_batch raised (same micro-batches per step)[/]"
    )


def print_measured(r: dict) -> None:
    """Per rank, predicted beside measured: model-state and activation bytes, collective elements
    and seconds per step; then the step's components."""
    from flopwise.measure.step import QUANTITIES

    def row(table: Table, rank: str | None, name: str, v: dict, fmt: str, last: bool = False) -> None:
        """One quantity; `rank` None: a table without the rank column."""
        ratio = f"{v['measured'] / v['predicted']:.3f}" if v["predicted"] else "–"
        cells = [
            name,
            "–" if v["predicted"] is None else format(v["predicted"], fmt),
            format(v["measured"], fmt),
            ratio,
        ]
        table.add_row(*([] if rank is None else [rank]), *cells, end_section=last)

    table = Table(
        title=f"{r['layout']} on {r['world']} local processes: planner vs engine "
        f"(last of {r['steps']} steps, {r['dtype']})"
    )
    for col in ("rank", "quantity", "predicted", "measured", "measured/predicted"):
        table.add_column(col, justify="left" if col == "quantity" else "right")
    for rank in r["ranks"]:
        rows = [
            (f"{q} bytes", rank[q], ",.0f")
            for q in QUANTITIES
            if q not in ("gathered", "fsdp_copies") or rank[q]["predicted"] or rank[q]["measured"]
        ]
        rows += [(f"{k} elements", v, ",.0f") for k, v in rank["collectives"].items()]
        rows += [
            (
                "step time s",
                {"predicted": r["step_time_s"]["predicted"], "measured": rank["step_time_s"]["measured"]},
                ".4g",
            )
        ]
        for i, (name, v, fmt) in enumerate(rows):
            row(table, str(rank["rank"]) if i == 0 else "", name, v, fmt, i == len(rows) - 1)
        if rank["layers"]["predicted"] != rank["layers"]["measured"]:
            stdout.print(
                f"[red]rank {rank['rank']}: planner's layers {rank['layers']['predicted']}, engine's "
                f"{rank['layers']['measured']}[/]"
            )
    stdout.print(table)
    stdout.print(
        "[dim]params at rest, grads as the optimizer steps, optimizer: AdamW moments; activations: peak "
        "saved for backward (the planner's: this engine's, eager or compiled as the run is); gathered: "
        "FSDP2's all-gathered parameters then; peak: the step's high-water mark above the resident states; "
        "fsdp_copies: what FSDP2's copy kernels read and write around its collectives in a step; "
        "collectives: elements per step by kind, single-element ones (loss, norm, flags) left out; step "
        "time: the median of the timed steps[/]"
    )
    parts = Table(title=f"step time s by component: rank {r['components_rank']}'s profiled step (torch.profiler)")
    for col in ("component", "predicted", "measured", "measured/predicted"):
        parts.add_column(col, justify="left" if col == "component" else "right")
    items = list(r["step_time_components_s"].items())
    for i, (name, v) in enumerate(items):
        row(parts, None, name.replace("_", " "), v, ".4g", i == len(items) - 1)
    row(parts, None, "step (median, slowest rank)", r["step_time_s"], ".4g")
    stdout.print(parts)
    stdout.print(f"[dim]{r['step_time_note']}[/]")


def serve_regime(s) -> str:
    """A `serve.*` regime in words (a ServeConfig)."""
    return (
        f"per request {s.prompt_tokens} prompt + {s.cached_tokens} cached → {s.output_tokens} generated tokens; "
        f"{s.weights_dtype} weights; batch {s.batch or 'the largest that fits'}"
        + (f"; decode ≤ {s.latency_ms:g} ms/token" if s.latency_ms else "")
    )


def print_serve(plan, top: int, name: str) -> None:
    """The served model and regime, then its `top` layouts, cheapest per served token first."""
    cfg, hw, s = plan.cfg, plan.hardware, plan.cfg.serve
    price = cfg.cluster.price_per_gpu_hour
    stdout.print(f"{escape(name)}: {human(plan.params)} params; {cfg.cluster.gpus} × {hw.name}; {serve_regime(s)}")
    t = new_table(
        "serving layouts, cheapest per served token first",
        ("tp", "pp", "replicas", "batch", "GiB", "weights", "KV", "prefill s", "MFU", "ms/token", "bound", "tok/s")
        + ("GPU-h/M", "cost/M", "why not"),
        left=("bound", "why not"),
    )
    for lay in plan.layouts[:top]:
        gib = {k: f"{v / 2**30:.1f}" for k, v in lay.memory.items()}
        cost = lay.cost_per_million_tokens
        t.add_row(
            str(lay.tp),
            str(lay.pp),
            str(lay.replicas),
            str(lay.batch),
            gib["total"],
            gib["weights"],
            gib["kv_cache"],
            f"{lay.prefill_s:.3g}",
            f"{lay.prefill_mfu:.1%}",
            f"{lay.decode_s_per_token * 1e3:.3g}",
            lay.decode_bound,
            human(lay.tokens_per_s),
            f"{lay.gpu_hours_per_million:.3g}",
            "–" if cost is None else f"{cost:.3g}",
            lay.reason,
        )
    stdout.print(t)
    stdout.print(
        "[dim]per device: GiB (total, runtime reserve included, against 90% of memory), weights, KV cache; prefill: "
        "one batch's prompts, MFU against the 16-bit peak; ms/token: one decode step, its bound the slowest of "
        "compute, memory and communication; tok/s: generated tokens of all replicas; GPU-h/M and cost/M: per "
        "million generated tokens" + ("" if price else " (cost: set cluster.price_per_gpu_hour)") + "[/]"
    )


def print_serve_measured(layout, measured: dict) -> None:
    """The one-device layout's planned prefill and decode beside what `--measure` timed here."""
    t = new_table(
        f"measured here: {measured['device']}, {measured['dtype']}, batch {measured['batch']}",
        ("", "planned", "measured", "measured / planned"),
        left=("",),
    )
    rows = [
        ("prefill (s)", "prefill_s", "prefill_s", 1),
        ("decode (ms/token)", "decode_s_per_token", "decode_s_per_token", 1e3),
    ]
    cpu = measured["device"] == "cpu"
    if cpu:
        rows += [
            ("prefill CPU (s)", "prefill_s", "prefill_cpu_s", 1),
            ("decode CPU (ms)", "decode_s_per_token", "decode_cpu_s_per_token", 1e3),
        ]
    for label, key, got_key, scale in rows:
        planned, got = getattr(layout, key), measured[got_key]
        t.add_row(label, f"{planned * scale:.3g}", f"{got * scale:.3g}", f"{got / planned:.2f}")
    stdout.print(t)
    load = measured["load_average"]
    stdout.print(
        f"[dim]measured: the median of {measured['rounds']} rounds of the workload"
        + ("; CPU: the process's CPU seconds of the same spans (what the work cost, whatever else runs)" if cpu else "")
        + (f"; load average {load:.1f}" if load is not None else "")
        + "[/]"
    )


def print_rehearsal(r: dict) -> None:
    """Per rehearsed rank: the bytes it held (fake tensors, one step) beside the planner's, and
    its collectives; a rank torch could not rehearse, with torch's error."""
    gib = 2**30
    table = new_table(
        f"{r['layout']}: one step of each rank below as rank r of {r['world']:,} (fake process group, "
        f"fake tensors), beside the planner",
        ("rank", "stage", "quantity", "planned", "rehearsed", "difference"),
        left=("quantity",),
    )
    for rank in r["ranks"]:
        head = [str(rank["rank"]), str(rank["stage"])]
        if "error" in rank:
            table.add_row(*head, "[red]not rehearsed[/]", "", escape(rank["error"][:120]), "", end_section=True)
            continue
        names = [*rank["rehearsed"], "total"]
        for i, q in enumerate(names):
            want, got = (
                (rank["total"]["planned"], rank["total"]["rehearsed"])
                if q == "total"
                else (rank["planned"][q], rank["rehearsed"][q])
            )
            diff = f"{(got - want) / want:+.1%}" if want else "–"
            cells = head if i == 0 else ["", ""]
            table.add_row(*cells, q, size(want), size(got), diff, end_section=i == len(names) - 1)
    stdout.print(table)
    for rank in r["ranks"]:
        if "error" in rank:
            continue
        kinds = ", ".join(
            f"{k} {size(v['rehearsed_bytes'])} ({human(v['rehearsed_elements'])} elements, planned "
            f"{human(v['planned_elements'])})"
            for k, v in rank["collectives"].items()
        )
        stdout.print(
            f"rank {rank['rank']}: collectives per step: {kinds}; rehearsed in {rank['seconds']:.0f} s, "
            f"{size(rank['max_rss_bytes'])} RSS"
        )
    verdict = "[green]fits[/]" if r["fits"] else "[red]does not fit[/]"
    stdout.print(
        f"{verdict} {r['hardware']} ({r['usable_bytes'] / gib:.1f} GiB usable); rehearsed in {r['seconds']:.0f} s. "
        "[dim]peak: the step's high-water mark above the resident states; total: parameters, optimizer, "
        "buffers, the runtime's reserve and the peak; the planner's account is of the CPU engine, eager "
        "(what is rehearsed)[/]"
    )
