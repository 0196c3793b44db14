"""Shared infrastructure for sinkstudy: errors, atomic outputs, provenance, tiny builders."""

__version__ = "0.1.0"


class SinkstudyError(Exception):
    """A user-facing error: the CLI prints its message as one line and exits 2."""
