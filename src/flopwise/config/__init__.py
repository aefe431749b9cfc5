"""The config tree and where its values come from: the pydantic schema, the published architectures
(presets), the Hugging Face config mapping and the generated reference. Torch-free."""

from flopwise import public_api

HOMES = {
    "hf_mapping": [
        "check_inside",
        "hf_config_from_model",
        "LLAMA_LIKE",
        "read_hf_config",
        "refuse",
        "tensor_shapes",
        "weight_map",
    ],
    "presets": ["PRESETS"],
    "reference": ["render"],
    "schema": [
        "apply_override",
        "Config",
        "config_hash",
        "DataConfig",
        "GuardConfig",
        "hf_model_fields",
        "load_config",
        "load_tree",
        "ModelConfig",
        "OptimConfig",
        "parse_value",
        "RopeScaling",
        "RunConfig",
        "Section",
        "ServeConfig",
        "split_cli_args",
        "to_toml",
        "validate",
        "WatchdogConfig",
    ],
}
__all__ = [name for names in HOMES.values() for name in names]
__getattr__, __dir__ = public_api(__name__, HOMES)
