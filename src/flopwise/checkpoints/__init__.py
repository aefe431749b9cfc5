"""The checkpoint format and the run folder: written by train, read by eval and interop."""
