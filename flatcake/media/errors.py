"""Errors of the media layer (paper §3.1 SSD medium): what start-up raises, and how a write
into a pool file can fail in ways the store handles differently."""

from __future__ import annotations


class PoolFileGone(OSError):
    """A pool file was unlinked or truncated behind the backend (e.g. by a tmp cleaner): writes
    to the open fd would land in an orphan inode, or next to a hole that reads back as zeros."""


class StaleGeneration(OSError):
    """A write was placed under an older generation of its pool file (the file was reset since):
    the range may belong to another scope now, so nothing is written."""


class ShortWrite(OSError):
    """A write stopped short (the kernel took fewer bytes and then none): a transient fault,
    the put fails and the file stays in service."""


class SsdStartupError(RuntimeError):
    """The SSD pool cannot be created or opened (bad ``ssd.path``, no space, permissions)."""
