"""Measurements on this machine that feed or check the planner: hardware calibration,
`plan measure` (the engine beside the planner), `plan serve --measure` (generation beside the
serving plan), measured bytes, restart costs, the Hopper tables, `plan --rehearse` (one rank of
the full world on fake tensors, beside the planner)."""

from flopwise import public_api

HOMES = {
    "machine": ["calibrate_machine", "calibration_device"],
    "bytes": ["CommCounter", "grad_bytes", "HostSyncCounter", "optimizer_bytes", "param_bytes", "SavedBytes"],
    "calibrate": [
        "calibrate_device",
        "calibration_config",
        "native_dtype",
        "require_native_dtype",
        "save_hardware",
        "steps_of",
        "sweep",
    ],
    "serve": ["measure_serve"],
    "hopper_tables": ["derive", "predict", "run_config", "SHAPE_1B"],
    "rehearse": ["CATEGORIES", "distinct_ranks", "rehearse_plan", "rehearse_rank"],
    "step": ["gather", "measure_plan", "measure_rank", "predicted_time", "QUANTITIES"],
}
__all__ = [name for names in HOMES.values() for name in names]
__getattr__, __dir__ = public_api(__name__, HOMES)
