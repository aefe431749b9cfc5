"""Parallelism applied from outside the model with torch.distributed's own pieces: the mesh,
FSDP2/DDP, tensor and sequence, pipeline, context parallel, float8 conversion."""

from flopwise import public_api

HOMES = {
    "apply": ["apply_compile", "apply_recompute", "config_compiles", "parallelize"],
    "context": ["ContextParallel"],
    "data": ["local_optimizer", "zero1_group"],
    "float8": ["check_float8"],
    "mesh": [
        "across_nodes",
        "all_mean",
        "barrier",
        "DIMS",
        "init",
        "is_rank0",
        "make_mesh",
        "missing_ranks",
        "Parallel",
        "torchrun",
        "world_size",
    ],
    "pipeline": ["build_schedule", "releasing_sends", "SCHEDULE_CLASSES", "split_stages", "V_SHAPED"],
}
__all__ = [name for names in HOMES.values() for name in names]
__getattr__, __dir__ = public_api(__name__, HOMES)
