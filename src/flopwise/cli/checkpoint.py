"""`flopwise checkpoint export` and `flopwise convert from-hf|to-hf`: checkpoints consolidated and
carried to and from Hugging Face's format."""

from __future__ import annotations

from pathlib import Path

import typer

from flopwise.cli.common import stdout

checkpoint_app = typer.Typer(no_args_is_help=True, help="Consolidate sharded checkpoints.")
convert_app = typer.Typer(no_args_is_help=True, help="Convert checkpoints to and from Hugging Face format.")


@checkpoint_app.command("export")
def export_cmd(
    path: str = typer.Argument(..., help="a run dir (its newest complete checkpoint) or a step-N folder"),
    out: Path = typer.Option(..., "--out", help="folder to write <out>/checkpoints/step-N into"),
    force: bool = typer.Option(False, "--force", help="replace a checkpoint of the same step in OUT"),
) -> None:
    """Consolidate a checkpoint written by any parallel layout into a one-process checkpoint
    (added beside OUT's checkpoints; none is deleted)."""
    from flopwise.checkpoints.export import export_checkpoint, resume_advice

    dest = export_checkpoint(path, out, force)
    stdout.print(f"exported {path} -> {dest} (one process; resume with {resume_advice(out, dest)})")


@convert_app.command("from-hf")
def from_hf_cmd(
    hf_dir: Path = typer.Argument(..., help="config.json + model*.safetensors (+ tokenizer)"),
    out: Path = typer.Argument(..., help="flopwise run folder to write (checkpoints/step-00000000)"),
    force: bool = typer.Option(False, "--force", help="replace a step-00000000 already in OUT"),
) -> None:
    """Import a Hugging Face model as a flopwise checkpoint (usable by eval, generate, train),
    added beside OUT's checkpoints; none is deleted."""
    from flopwise.interop.convert import import_hf

    stdout.print(f"wrote {import_hf(hf_dir, out, force)}")


@convert_app.command("to-hf")
def to_hf_cmd(
    ckpt: Path = typer.Argument(..., help="a checkpoint folder or a run folder"),
    out_dir: Path = typer.Argument(..., help="Hugging Face folder to write"),
    max_shard_gb: float = typer.Option(5.0, "--max-shard-gb", min=0.0001),
) -> None:
    """Export a flopwise checkpoint to config.json + safetensors + tokenizer files."""
    from flopwise.interop.convert import export_hf

    path = export_hf(ckpt, out_dir, int(max_shard_gb * 2**30))
    stdout.print(f"wrote {path} (loads with transformers' AutoModelForCausalLM.from_pretrained)")
