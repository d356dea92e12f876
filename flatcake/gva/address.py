"""64-bit global virtual addresses (paper §3.1, FC-GVA).

::

    63      60 59            48 47                                   0
    +---------+----------------+--------------------------------------+
    | medium  |    node id     |            byte offset               |
    +---------+----------------+--------------------------------------+

* medium: 0 = DRAM, 1 = SSD (others reserved for future media).
* node: 0..4095.
* offset: bytes, 0..2**48-1 (256 TiB per medium per node). For DRAM it is the byte offset in
  the node's DRAM region; for SSD it is ``file_index * file_bytes + offset_in_file`` in the
  node's file pool (see :mod:`flatcake.media.ssd`).

Routing is a mask, and because the medium sits in the top bits DRAM and SSD addresses are
disjoint integer ranges: "does this request need the SSD" is ``max(gvas) >= 1 << 60``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

MEDIUM_SHIFT = 60
NODE_SHIFT = 48
MEDIUM_MASK = 0xF << MEDIUM_SHIFT
NODE_MASK = 0xFFF << NODE_SHIFT
OFFSET_MASK = (1 << NODE_SHIFT) - 1

MEDIUM_DRAM = 0
MEDIUM_SSD = 1
MEDIUM_NAMES = {MEDIUM_DRAM: "dram", MEDIUM_SSD: "ssd"}

#: Smallest SSD address: every GVA >= this lives on SSD (or a slower medium).
SSD_BOUNDARY = MEDIUM_SSD << MEDIUM_SHIFT


def encode_gva(medium: int, node: int, offset: int) -> int:
    """Pack a GVA.

    Args:
        medium: 0..15 (``MEDIUM_DRAM`` / ``MEDIUM_SSD``).
        node: 0..4095.
        offset: byte offset, 0..2**48-1.

    Returns:
        The 64-bit address as a Python int.

    Raises:
        ValueError: a field is out of range (named in the message).
    """
    if not 0 <= medium <= 0xF:
        raise ValueError(f"GVA medium {medium} out of range 0..15")
    if not 0 <= node <= 0xFFF:
        raise ValueError(f"GVA node {node} out of range 0..4095")
    if not 0 <= offset <= OFFSET_MASK:
        raise ValueError(f"GVA offset {offset} out of range 0..2**48-1")
    return (medium << MEDIUM_SHIFT) | (node << NODE_SHIFT) | offset


@dataclass(frozen=True, slots=True)
class GvaFields:
    """Decoded GVA: ``medium``, ``node``, ``offset`` (bytes)."""

    medium: int
    node: int
    offset: int


def decode_gva(gva: int) -> GvaFields:
    """Unpack a GVA into its three fields (mask and shift; never raises for a 64-bit int)."""
    return GvaFields((gva & MEDIUM_MASK) >> MEDIUM_SHIFT, (gva & NODE_MASK) >> NODE_SHIFT, gva & OFFSET_MASK)


def medium_of(gva: int) -> int:
    """The medium field [63:60]."""
    return gva >> MEDIUM_SHIFT


def node_of(gva: int) -> int:
    """The node field [59:48]."""
    return (gva & NODE_MASK) >> NODE_SHIFT


def offset_of(gva: int) -> int:
    """The byte offset field [47:0]."""
    return gva & OFFSET_MASK


def needs_ssd(gvas: Iterable[int]) -> bool:
    """True if any address is on SSD: ``max(gva) >= 2**60`` (FC-MAS classification, §3.2)."""
    return max(gvas, default=0) >= SSD_BOUNDARY
