"""Write-time placement by reuse scope (paper §3.1, Table 2).

Each new round of pages is placed once, when it is written, on DRAM or SSD, from signals
visible at write time; pages never migrate afterwards.

=========================== ============================================ ========
reuse scope                 write-time signal                            medium
=========================== ============================================ ========
shared prompt               prefix reference count > 1                   DRAM
short multi-turn chat       turn > 1 and the previous reply was short    DRAM
agent session / long ctx    context >= ``L_agent`` or reply >= ``tau``   SSD
one-shot / overflow         turn = 1, or DRAM full                       SSD
=========================== ============================================ ========

Rows are checked in the order *overflow, shared prompt, agent, short chat, one-shot*: DRAM
that is full can place nothing; a shared prefix is the most valuable DRAM content; a long
context is an agent session even in a later turn. How the store derives the signals from
SGLang's page-key chain is in :mod:`flatcake.gva.signals`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from flatcake.config import PlacementConfig
from flatcake.gva.address import MEDIUM_DRAM, MEDIUM_SSD

if TYPE_CHECKING:
    from flatcake.gva.index import SessionScope
    from flatcake.media.extent import RoundLayout
    from flatcake.media.ssd import Extent


class ReuseScope(str, enum.Enum):
    """The paper's reuse scopes (Table 2)."""

    SHARED_PROMPT = "shared_prompt"
    SHORT_CHAT = "short_chat"
    AGENT_SESSION = "agent_session"
    ONE_SHOT = "one_shot"
    OVERFLOW = "overflow"


#: journal codes of the reuse scopes (their position; append new members at the end)
_REUSE_CODES = tuple(ReuseScope)


def reuse_code(reuse: ReuseScope) -> int:
    """The number a :class:`ReuseScope` is stored as in the pool journal."""
    return _REUSE_CODES.index(reuse)


def reuse_of(code: int) -> ReuseScope:
    """The :class:`ReuseScope` stored as ``code`` (``ONE_SHOT`` for an unknown code)."""
    return _REUSE_CODES[code] if 0 <= code < len(_REUSE_CODES) else ReuseScope.ONE_SHOT


@dataclass(frozen=True, slots=True)
class PlacementSignals:
    """Signals visible when a round of pages is written.

    Attributes:
        prefix_refcount: requests known to reference these pages (the writer counts 1).
        turn: the session's turn, 1 for a new session.
        prev_reply_tokens: tokens the session appended in its previous turn (None in turn 1).
        context_tokens: tokens of context up to the end of this round.
        reply_tokens: tokens the session appended so far in this turn, this round included.
        dram_full: the DRAM region cannot take this round.
    """

    prefix_refcount: int
    turn: int
    prev_reply_tokens: int | None
    context_tokens: int
    reply_tokens: int
    dram_full: bool


@dataclass(frozen=True, slots=True)
class PlacementDecision:
    """Where a round goes: ``medium`` (0 DRAM / 1 SSD), its ``scope`` class and why."""

    medium: int
    scope: ReuseScope
    reason: str


class PlacementPolicy:
    """Table 2 as a pure function of :class:`PlacementSignals` and the configured thresholds."""

    def __init__(self, cfg: PlacementConfig):
        self.cfg = cfg

    def decide(self, s: PlacementSignals) -> PlacementDecision:
        """Place one round. Never raises."""
        c = self.cfg
        if s.dram_full:
            return PlacementDecision(MEDIUM_SSD, ReuseScope.OVERFLOW, "DRAM full")
        if s.prefix_refcount >= c.shared_refcount:
            return PlacementDecision(MEDIUM_DRAM, ReuseScope.SHARED_PROMPT, f"prefix refcount {s.prefix_refcount} > 1")
        if s.context_tokens >= c.l_agent_tokens:
            return PlacementDecision(MEDIUM_SSD, ReuseScope.AGENT_SESSION, f"context {s.context_tokens} >= L_agent {c.l_agent_tokens}")
        if s.reply_tokens >= c.tau_tokens:
            return PlacementDecision(MEDIUM_SSD, ReuseScope.AGENT_SESSION, f"reply {s.reply_tokens} >= tau {c.tau_tokens}")
        if s.turn > 1 and s.prev_reply_tokens is not None and s.prev_reply_tokens < c.short_reply_tokens:
            return PlacementDecision(MEDIUM_DRAM, ReuseScope.SHORT_CHAT, f"turn {s.turn}, previous reply {s.prev_reply_tokens} short")
        if s.turn <= 1:
            return PlacementDecision(MEDIUM_SSD, ReuseScope.ONE_SHOT, "turn 1")
        return PlacementDecision(MEDIUM_SSD, ReuseScope.ONE_SHOT, f"turn {s.turn}, previous reply {s.prev_reply_tokens} long")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one round of pages goes: the scope table's answer to the write path.

    Attributes:
        scope: the session scope the round joins (pinned until :meth:`ScopeTable.release`).
        keys: the round's page keys, in order.
        src_pages: page ids of the round's pages in the source layout (host pool).
        slots: DRAM slot numbers, one per page (DRAM rounds), else ``None``.
        extent_file: SSD pool file of the round (SSD rounds), else -1.
        round_offset: SSD: byte offset of the round header in ``extent_file``.
        layout: SSD: the round's byte layout (header | layer-major data | record).
        seq: SSD: the round's sequence number inside its scope.
        new_extent: SSD: the extent this round opens, whose 4 KiB extent header the write path
            writes first (at ``new_extent.offset``); ``None`` when the round appends to an
            extent that already has one.
        extent_seq: SSD: index of ``new_extent`` among the scope's extents.
        prev_tail: SSD: the scope's tail offset before this reservation (for :meth:`ScopeTable.abort_locked`).
        nonce: SSD: the round's random identity, written in its header, record and journal entry.
        extent_offset: SSD: offset of the extent (its header block) that holds the round.
        generation: SSD: the pool file's generation when the space was reserved (a write or
            commit after the file was reset is refused).
    """

    scope: SessionScope
    keys: list
    src_pages: list
    slots: Optional[list] = None
    extent_file: int = -1
    round_offset: int = 0
    layout: Optional[RoundLayout] = None
    seq: int = 0
    new_extent: Optional[Extent] = None
    extent_seq: int = 0
    prev_tail: int = 0
    nonce: int = 0
    extent_offset: int = 0
    generation: int = 0

    @property
    def medium(self) -> int:
        """``MEDIUM_DRAM`` or ``MEDIUM_SSD``."""
        return MEDIUM_DRAM if self.slots is not None else MEDIUM_SSD
