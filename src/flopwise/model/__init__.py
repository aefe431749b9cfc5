"""Model package. `presets` is pure Python; `transformer`/`layers` import torch (import them directly)."""
