"""flopwise: plan, train and audit compute-optimal dense LLMs."""

import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

__version__ = "0.1.0"

# CPU tensors of 2 MB and more on transparent huge pages (PyTorch's CPU allocator reads this once, at
# its first allocation, so it is set before flopwise imports torch; the ranks and runs flopwise
# starts inherit it): a small model's logits, tens of MB a step, were otherwise mapped and faulted
# in 4 KB pages on every step. Measured here (2 cores, THP "madvise"): a 100-step 13K-parameter
# run on the demo's data 29.0 -> 17.1 s, page faults 8.6M -> 0.43M. THP_MEM_ALLOC_ENABLE=0 opts out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# a library prints nothing of its own accord: flopwise.log.setup (the CLI) adds the printers
logging.getLogger(__name__).addHandler(logging.NullHandler())


def public_api(package: str, homes: dict[str, list[str]]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's face (PEP 562 `__getattr__` and `__dir__`): each public name is imported from its
    home module (`homes`: module -> names) on first use, so importing a package imports none of its
    modules; `flopwise plan` never loads torch through a face, and faces add no import cycles."""
    home = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home[name]}"), name)
        setattr(sys.modules[package], name, value)  # the next look-up is a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *home})

    return __getattr__, __dir__
