"""The layout rules the engine enforces and the planner searches within (degrees, micro-batches,
pipeline schedules, compile): torch-free, read by both plan/ and parallel/."""

from flopwise import public_api

HOMES = {
    "linears": [
        "block_linears",
        "float8_all_gather",
        "float8_eligible",
        "float8_shapes",
        "float8_weight_elements",
        "LINEAR_KEYS",
        "RECIPES",
        "tp_local_shape",
        "unconverted_linears",
    ],
    "rules": [
        "balanced_stages",
        "check_layout",
        "COMPILE_MIN_STEPS",
        "compiles",
        "config_layout",
        "FIXED_VIRTUAL_STAGES",
        "head_split",
        "Layout",
        "layout_of",
        "LOSS_CHUNK_BYTES",
        "loss_chunk_tokens",
        "SCHEDULES",
        "stage_ids",
        "stage_sizes",
    ],
}
__all__ = [name for names in HOMES.values() for name in names]
__getattr__, __dir__ = public_api(__name__, HOMES)
