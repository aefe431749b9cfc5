"""A run from a config to its end: build (layout, mesh, data, meta model, parallelize, shards,
optimizer, resume), launch, the loop with its guards, and the scaling ladder's runner."""

from flopwise import public_api

HOMES = {
    "build": ["build_engine", "build_run", "claim_run_dir", "ensure_data", "TRAIN_WRITES", "planned_draws"],
    "chaos": ["exponential_gaps", "run_under_failures", "Timeline"],
    "engine": ["autocast", "lm_loss", "token_loss"],
    "faults": ["Faults", "parse"],
    "guard": ["Guard", "Verdict"],
    "ladder": [
        "budgets_from",
        "collect",
        "final_val_loss",
        "LADDER_PRESETS",
        "ladder_preset",
        "LadderPreset",
        "launch_commands",
        "plan_ladder",
        "run_ladder",
        "write_configs",
        "sweep_ladder",
    ],
    "launch": ["train"],
    "metrics": ["ceilings_file", "checked_peak", "device_peak", "DTYPES", "measure_matmul_peak", "Peak"],
    "optim": ["build_optimizer", "lr_at", "param_groups", "step_unless"],
    "preflight": [
        "cheapest_recompute",
        "device_memory",
        "rank_memory_total",
        "resolve_recompute",
        "run_preflight",
        "WillNotFit",
    ],
    "run": ["resume", "resume_state", "Run"],
    "trainer": ["layout_label", "summary_table", "train_step"],
    "watch": ["Watch"],
}
__all__ = [name for names in HOMES.values() for name in names]
__getattr__, __dir__ = public_api(__name__, HOMES)
