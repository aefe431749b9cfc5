"""`flopwise audit`: published (or your) training claims checked against the planner."""

from __future__ import annotations

import json

import typer

from flopwise.cli.common import stdout
from flopwise.cli.render import human


def audit_cmd(
    claim: list[str] | None = typer.Argument(
        None,
        help="key=value claim (preset or params, tokens, hardware, "
        "devices, days | device_hours | tokens_per_s_per_device, seq_len, "
        "batch_tokens); or one catalogue entry's name (e.g. llama3-405b); "
        "none: the whole bundled catalogue",
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Check published (or your) training claims: FLOPs, implied MFU, planner's best MFU, verdict."""
    from rich.table import Table

    from flopwise.plan.audit import audit_claims, catalogue, parse_claim

    verdicts = audit_claims([parse_claim(claim)] if claim else list(catalogue().values()))
    if as_json:
        typer.echo(json.dumps([v.to_json() for v in verdicts], indent=1))
        return
    table = Table(title="training claims audited (FLOPs: flopwise convention)")
    for col in ("run", "params", "tokens", "FLOPs", "implied MFU", "basis", "planner best", "verdict", "status"):
        table.add_column(col, no_wrap=col not in ("basis", "verdict"))
    for v in verdicts:
        table.add_row(
            v.name,
            human(v.params),
            human(v.tokens) if v.tokens else "?",
            f"{v.flops:.3g}" if v.flops else "?",
            f"{v.implied_mfu:.1%}" if v.implied_mfu is not None else "?",
            v.basis or "–",
            f"{v.predicted_mfu:.1%}" if v.predicted_mfu else "–",
            v.verdict + (f" (missing: {', '.join(v.missing)})" if v.missing else ""),
            v.status,
        )
    stdout.print(table)
    for v in verdicts:
        for line in v.notes:
            stdout.print(f"[dim]{v.name}: {line}[/]")
    stdout.print(
        "[dim]status: V read in the paper, V2 secondary copy, U recalled (re-check). Wall-clock bases "
        "include downtime, so implied MFU below the planner's is expected.[/]"
    )
