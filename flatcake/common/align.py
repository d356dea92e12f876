"""Alignment of SSD offsets, lengths and buffers (paper §3.3: O_DIRECT and GDS need 4 KiB).

Every SSD byte FlatCake reads or writes is 4 KiB aligned: file offsets, lengths and the
addresses of the host/HBM buffers the bytes land in. This module is the one place the
alignment and its rounding helpers are defined.
"""

from __future__ import annotations

#: bytes: O_DIRECT / GDS alignment of every SSD offset, length and buffer
ALIGN = 4096


def align_up(n: int, a: int = ALIGN) -> int:
    """Round ``n`` (bytes; an int or an int64 numpy array) up to a multiple of ``a``."""
    return -(-n // a) * a


def align_down(n: int, a: int = ALIGN) -> int:
    """Round ``n`` (bytes; an int or an int64 numpy array) down to a multiple of ``a``."""
    return n - n % a
