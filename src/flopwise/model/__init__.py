"""A plain nn.Module dense decoder: its layers, the transformer, and an initialisation whose values
depend on the seed, the parameter's name and the element's position only."""

from flopwise import public_api

HOMES = {
    "init": ["canonical_name", "global_box", "normal_box"],
    "layers": ["alibi_slopes", "CoreAttention", "KVCache", "rope_frequencies", "Span"],
    "transformer": ["build_model", "document_ids", "document_positions", "materialise", "Transformer"],
}
__all__ = [name for names in HOMES.values() for name in names]
__getattr__, __dir__ = public_api(__name__, HOMES)
