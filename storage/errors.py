"""Errors of the storage layer that a user can act on."""


class LineageError(RuntimeError):
    """A lineage store problem a user can act on (missing file, refused statement)."""


class StageBusy(RuntimeError):
    """Another run of the same stage holds the workspace (`storage.locks.stage_lock`)."""
