"""The data package's error: a leaf module that every data module imports, so none of them needs
another to raise it."""


class DataError(ValueError):
    """A prepared directory, manifest or shard that cannot be used; the message names it."""
