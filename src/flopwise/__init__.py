"""flopwise: plan, train and audit compute-optimal dense LLMs."""

import logging
import os

__version__ = "0.1.0"

# CPU tensors of 2 MB and more on transparent huge pages (PyTorch's CPU allocator reads this once, at
# its first allocation, so it is set before flopwise imports torch; the ranks and runs flopwise
# starts inherit it): a small model's logits, tens of MB a step, were otherwise mapped and faulted
# in 4 KB pages on every step. Measured here (2 cores, THP "madvise"): a 100-step 13K-parameter
# run on the demo's data 29.0 -> 17.1 s, page faults 8.6M -> 0.43M. THP_MEM_ALLOC_ENABLE=0 opts out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# a library prints nothing of its own accord: flopwise.log.setup (the CLI) adds the printers
logging.getLogger(__name__).addHandler(logging.NullHandler())
