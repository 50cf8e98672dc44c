"""The export's error type (its own module: the grids, the converters and the read-back raise it)."""


class ExportError(RuntimeError):
    """The export failed: a lint fired, an op does not convert or parity is below threshold."""
