"""flopwise: plan, train and audit compute-optimal dense LLMs."""

import logging

__version__ = "0.1.0"

# a library prints nothing of its own accord: flopwise.log.setup (the CLI) adds the printers
logging.getLogger(__name__).addHandler(logging.NullHandler())
