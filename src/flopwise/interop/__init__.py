"""Hugging Face both ways: a checkpoint imported from and exported to safetensors + config.json."""

from flopwise import public_api

HOMES = {
    "convert": ["export_hf", "import_hf"],
    "hf": ["from_hf", "load_hf_weights", "to_hf"],
}
__all__ = [name for names in HOMES.values() for name in names]
__getattr__, __dir__ = public_api(__name__, HOMES)
