"""Errors of the storage layer that a user can act on."""


class LineageError(RuntimeError):
    """A lineage store problem a user can act on (missing file, refused statement)."""
