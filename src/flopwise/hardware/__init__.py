"""What a device can do: the catalogue (dense peak FLOP/s by dtype, memory, links), the calibrations
measured on a machine, and checkpoint write and restart costs. Torch-free."""

from flopwise import public_api

HOMES = {
    "calibration": ["Calibration", "COLLECTIVES"],
    "catalogue": [
        "auto_dtype",
        "busy_note",
        "CATALOGUE",
        "cluster_catalogue",
        "cluster_hardware",
        "cpu_multiplies_bf16",
        "get_hardware",
        "GiB",
        "Hardware",
        "hardware_toml",
        "hopper_calibration",
        "identify_gpu",
        "load_catalogue",
    ],
    "restart_costs": ["Recovery"],
}
__all__ = [name for names in HOMES.values() for name in names]
__getattr__, __dir__ = public_api(__name__, HOMES)
