"""flopwise: plan, train and audit compute-optimal dense LLMs."""

__version__ = "0.1.0"
