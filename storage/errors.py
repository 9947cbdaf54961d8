"""Exceptions raised by the storage layer.

Every message is written for a human: the UI may show it as is.
"""


class StorageError(Exception):
    """Base class: the database could not do what was asked, or holds bad data."""


class ValidationError(StorageError, ValueError):
    """The caller's input was rejected (empty title, unknown mode, ...)."""


class NotFoundError(StorageError, LookupError):
    """The project, chapter, run or comparison does not exist (any more)."""
