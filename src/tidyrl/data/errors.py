"""The error of every data module: a data file or its configuration is unusable."""


class DataError(ValueError):
    """The prompt data or its configuration is unusable; the message says how to fix it."""
