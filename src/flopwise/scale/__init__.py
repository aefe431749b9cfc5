"""Scaling laws, torch-free: the published laws, fits to a sweep's points (Chinchilla's
Approaches 2 and 3, Kaplan), allocation over a model's life (training and planned serving) and
task-accuracy prediction."""

from flopwise import public_api

HOMES = {
    "optimal": ["Budget", "budget_flops", "optimal_allocations"],
    "lifetime": ["flops_per_device_hour", "Lifetime", "lifetime_allocations"],
    "fit": [
        "fit_approach2",
        "fit_approach3",
        "fit_kaplan",
        "fitted_law",
        "plot_fits",
        "PLOT_NAMES",
        "Points",
        "read_points",
        "save_law",
        "fit_runs",
    ],
    "laws": [
        "allocate",
        "allocation_config",
        "batch_and_lr",
        "CHINCHILLA_TABLE3",
        "choose_shape",
        "ChosenShape",
        "data_constrained",
        "effective_tokens",
        "EPOCH",
        "get_law",
        "HOFFMANN",
        "inference_aware",
        "LAWS",
        "ParametricLaw",
        "Pricing",
        "FLOP_PRICING",
    ],
    "tasks": ["fit_task", "jaggedness", "plot_tasks", "predict_task", "read_task_table", "TaskPoints", "predict_tasks"],
}
__all__ = [name for names in HOMES.values() for name in names]
__getattr__, __dir__ = public_api(__name__, HOMES)
