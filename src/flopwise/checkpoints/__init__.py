"""The checkpoint format (DCP + a manifest): written by train, read by eval and interop, exported
and consolidated."""

from flopwise import public_api

HOMES = {
    "checkpoint": [
        "abandon",
        "begin",
        "CHECKPOINT_FORMAT",
        "claim_step",
        "finish",
        "is_complete",
        "latest",
        "list_complete",
        "load",
        "not_written",
        "prune",
        "read_dcp_metadata",
        "read_state",
        "reason",
        "resolve",
        "rng_state",
        "save",
        "scratch_dir",
        "set_rng_state",
        "step_dir",
        "verify",
    ],
    "export": ["checkpoint_config", "CheckpointTensors", "export_checkpoint", "resume_advice"],
}
__all__ = [name for names in HOMES.values() for name in names]
__getattr__, __dir__ = public_api(__name__, HOMES)
