"""PageStore: FlatCake's core, independent of SGLang (paper §3.1 FC-GVA + §3.3 FC-CIO).

Lifecycle of a write (``put``)::

    skip keys already stored -> find the session scope from the key chain -> place the round
    (Table 2) -> allocate GVA space (writer lock) -> gather pages from the KV buffer and write
    (no lock; SSD: one aligned pwrite of header | layer-major data | record) -> publish (lock)
    -> reclaim whole scopes above the high watermark

Lifecycle of a read (``get``)::

    look up the leading run of keys (no lock) -> pin scopes -> DRAM pages: copy;
    SSD pages: FC-CIO restore (sort, merge, read into the staging window, verify, scatter)
    -> unpin -> per-page results, leading run only

Session scope and turn from the key chain (SGLang passes ``extra_info.prefix_keys`` when
``hicache_storage_pass_prefix_keys`` is true; every key already hashes its whole prefix):

* the *parent* of a round is the key just before its first page (the previous key in the
  call, else ``prefix_keys[-1]``);
* a round whose parent is a scope's tail joins that scope (same medium; later turns of a
  session stay together); any other round opens a new scope, inheriting the parent scope's
  turn if the parent is stored;
* a hit query whose stored run ends on a scope's tail and continues with new keys is a new
  request of that session: the scope's turn is incremented;
* "reply tokens" is measured as tokens appended to the scope in the current turn (SGLang's
  backend cannot tell prompt from reply pages);
* prefix reference count = hit queries that asked for a page before it was written, the
  writer included (:class:`~flatcake.gva.index.InterestCounter`).

A DRAM scope whose next round is placed on SSD (context grew past ``L_agent``, or DRAM full)
continues in a new SSD scope; pages already written never move.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import xxhash

from flatcake.config import ConfigError, FlatCakeConfig
from flatcake.gva.journal import RETIRE, ROUND, JournalEntry, JournalReader, JournalWriter
from flatcake.gva.address import MEDIUM_DRAM, MEDIUM_SSD, decode_gva, encode_gva
from flatcake.gva.index import GvaIndex, InterestCounter, PageEntry, SessionScope
from flatcake.gva.placement import PlacementPolicy, PlacementSignals, ReuseScope
from flatcake.layout import KvPageLayout, PageGeometry
from flatcake.media import extent as fmt
from flatcake.media.dram import DramRegion
from flatcake.media.ssd import AlignedBuffer, Extent, PoolFileGone, SsdFilePool

log = logging.getLogger("flatcake.store")


MAX_KEY_BYTES = 4096  # bytes of UTF-8 per page key (SGLang's are 64 hex characters)


def _valid_key(k) -> bool:
    if not isinstance(k, str) or not k:
        return False
    try:
        return len(k.encode()) <= MAX_KEY_BYTES
    except UnicodeEncodeError:
        return False


class _Gate:
    """Counts operations in flight so :meth:`PageStore.close` can wait for them; after close
    every new operation is refused (a miss / failed put), never an exception."""

    def __init__(self):
        self._cv = threading.Condition()
        self._n = 0
        self.closed = False

    def enter(self) -> bool:
        with self._cv:
            if self.closed:
                return False
            self._n += 1
            return True

    def exit(self) -> None:
        with self._cv:
            self._n -= 1
            if self._n == 0:
                self._cv.notify_all()

    def close(self, timeout_s: float) -> bool:
        """Refuse new operations; wait up to ``timeout_s`` seconds for running ones."""
        with self._cv:
            self.closed = True
            return self._cv.wait_for(lambda: self._n == 0, timeout_s)


class _ErrorLog:
    """Log each distinct (operation, errno) once; count all."""

    def __init__(self):
        self._seen: set = set()
        self._lock = threading.Lock()
        self.count = 0

    def __call__(self, op: str, err: BaseException) -> None:
        code = getattr(err, "errno", None)
        with self._lock:
            self.count += 1
            key = (op, code, type(err).__name__)
            if key in self._seen:
                return
            self._seen.add(key)
        name = errno_mod.errorcode.get(code, "") if code else ""
        log.error("flatcake %s failed: errno=%s %s %s (further identical errors are counted, not logged)", op, code, name, err)


@dataclass
class StoreStats:
    """Cumulative counters (bytes, pages, operations, seconds)."""

    hit_pages_dram: int = 0
    hit_pages_ssd: int = 0
    logical_read_bytes_ssd: int = 0
    ssd_read_bytes: int = 0
    ssd_read_ops: int = 0
    ssd_over_read_bytes: int = 0
    merged_reads: int = 0
    ssd_read_s: float = 0.0
    ssd_write_bytes: int = 0
    ssd_write_ops: int = 0
    dram_write_bytes: int = 0
    logical_write_bytes: int = 0
    pages_written_dram: int = 0
    pages_written_ssd: int = 0
    put_failures: int = 0
    get_failures: int = 0
    reclaimed_scopes_ssd: int = 0
    reclaimed_scopes_dram: int = 0
    reclaimed_bytes: int = 0


@dataclass(frozen=True, slots=True)
class _Placement:
    scope: SessionScope
    keys: list
    src_pages: list  # page ids in the source layout
    slots: Optional[list] = None  # DRAM
    extent_file: int = -1  # SSD
    round_offset: int = 0  # SSD: file offset of the round header
    layout: Optional[fmt.RoundLayout] = None
    seq: int = 0


class PageStore:
    """FlatCake's page store for one namespace.

    Args:
        cfg: validated configuration.
        geometry: page geometry of every page in this namespace.
        namespace: string naming model, ranks, page size, dtype, layout (see the adapter).
        restore_engine: FC-CIO engine for SSD reads; built from ``cfg.cio`` when ``None``.

    Raises:
        flatcake.media.ssd.SsdStartupError: ``ssd.path`` unusable.
        ValueError: ``ssd.file_bytes`` too small to hold one page.
    """

    def __init__(self, cfg: FlatCakeConfig, geometry: PageGeometry, namespace: str, restore_engine=None,
                 *, instance: str = "", role: str = "single"):
        if role not in ("single", "writer", "follower"):
            raise ValueError(f"role must be single, writer or follower, got {role!r}")
        if role == "follower":  # another process writes these files: always check what we read
            cfg = cfg.model_copy(update={"cio": cfg.cio.model_copy(update={"verify_checksums": True})})
        self.cfg = cfg
        self.role = role
        self.geometry = geometry
        self.namespace = namespace
        self.node = cfg.node_id
        self.policy = PlacementPolicy(cfg.placement)
        self.index = GvaIndex()
        self.interest = InterestCounter()
        self.stats = StoreStats()
        self._stats_lock = threading.Lock()
        self.errors = _ErrorLog()
        dram_cfg = cfg.dram
        if role != "single" and dram_cfg.capacity_bytes:
            # DRAM pages live in this process only; ranks that share pages need them on SSD
            log.warning("flatcake: DRAM medium off: pages are shared with other TP ranks through SSD")
            dram_cfg = dram_cfg.model_copy(update={"capacity_bytes": 0})
        try:
            self.dram = DramRegion(dram_cfg, geometry.page_bytes)
        except RuntimeError as e:
            raise ConfigError(f"dram.capacity_bytes: cannot allocate {dram_cfg.capacity_bytes} bytes: {e}") from None
        self.ssd = SsdFilePool(cfg.ssd, namespace, instance, follower=role == "follower")
        cb = geometry.chunk_bytes
        room = cfg.ssd.file_bytes - 2 * fmt.BLOCK
        n = 128
        while n > 0 and fmt.align_up(n * geometry.page_bytes) + fmt.align_up(fmt.record_size(["k" * 80] * n, geometry.layers)) > room - fmt.BLOCK:
            n //= 2
        if n == 0:
            self.ssd.close()
            raise ConfigError(
                f"ssd.file_bytes: {cfg.ssd.file_bytes} bytes cannot hold one page of {geometry.page_bytes} bytes plus headers"
            )
        self.max_round_pages = n
        self.journal = JournalWriter(self.ssd.journal_path) if role == "writer" else None
        self._journal_reader = JournalReader(self.ssd.journal_path) if role == "follower" else None
        self._mirror: dict[int, SessionScope] = {}
        if restore_engine is None:
            from flatcake.cio.restore import RestoreEngine

            restore_engine = RestoreEngine(cfg.cio, self.ssd.path_of, direct_io=self.ssd.direct_io, chunk_bytes=cb)
        self.cio = restore_engine
        self._tls = threading.local()
        self._gate = _Gate()

    # ================================================================ queries
    def exists(self, key: str) -> bool:
        """True if ``key`` is published (lock-free)."""
        return self.index.contains(key)

    def leading_run(self, keys: Sequence[str], prefix_keys: Optional[Sequence[str]] = None) -> int:
        """Length of the leading run of stored keys (SGLang's hit query). Lock-free; also feeds
        the placement signals (turns, prefix reference counts). 0 once closed. Never raises."""
        if self._gate.closed:
            return 0
        self._sync()
        get = self.index.get
        n = 0
        for k in keys:
            if get(k) is None:
                break
            n += 1
        if n < len(keys):
            try:
                last = keys[n - 1] if n else (prefix_keys[-1] if prefix_keys else None)
                scope = self.index.tails.get(last) if last is not None else None
                if scope is not None and not scope.retired:
                    scope.new_turn()
                self.interest.note_missing(list(keys[n:]))
            except Exception as e:  # signals are best-effort
                self.errors("hit-query bookkeeping", e)
        return n

    # ================================================================ reads
    def get(self, keys: Sequence[str], layout: KvPageLayout, page_ids: Sequence[int]) -> list[bool]:
        """Read pages ``keys[i]`` into page ``page_ids[i]`` of ``layout`` (see :meth:`_get`);
        all misses once the store is closed."""
        if not self._gate.enter():
            return [False] * len(keys)
        try:
            self._sync()
            return self._get(keys, layout, page_ids)
        finally:
            self._gate.exit()

    def _get(self, keys: Sequence[str], layout: KvPageLayout, page_ids: Sequence[int]) -> list[bool]:
        """Read pages ``keys[i]`` into page ``page_ids[i]`` of ``layout``.

        Returns:
            ``[True] * n + [False] * (len(keys) - n)``: ``n`` is the leading run of pages that
            were stored, pinned and read intact. A page after the first miss is never reported.
        Never raises; I/O faults are misses, logged once per errno.
        """
        out = [False] * len(keys)
        pinned: list[SessionScope] = []
        unreadable: Optional[PageEntry] = None
        try:
            entries = []
            for k in keys:
                e = self.index.get(k)
                if e is None or not e.scope.try_acquire():
                    break
                pinned.append(e.scope)
                entries.append(e)
            if not entries:
                return out
            n = len(entries)
            bad = n
            g = self.geometry
            dram_pos = [i for i, e in enumerate(entries) if e.scope.medium == MEDIUM_DRAM]
            ssd_pos = [i for i, e in enumerate(entries) if e.scope.medium != MEDIUM_DRAM]
            if ssd_pos:
                bad = min(bad, self._read_ssd(entries, ssd_pos, layout, page_ids))
            if dram_pos:
                pos = [i for i in dram_pos if i < bad]
                if pos:
                    slots = torch.tensor([decode_gva(entries[i].gva).offset // g.page_bytes for i in pos], dtype=torch.long)
                    dst = torch.tensor([int(page_ids[i]) for i in pos], dtype=torch.long)
                    rows = self.dram.slots[slots].view(len(pos), g.layers, g.chunk_bytes)
                    if rows.device != layout.device:
                        rows = rows.to(layout.device, non_blocking=True)
                    for layer in range(g.layers):
                        layout.scatter_chunks(rows[:, layer], dst, layer)
            for i in range(bad):
                out[i] = True
            with self._stats_lock:
                self.stats.hit_pages_dram += sum(1 for i in dram_pos if i < bad)
                s = sum(1 for i in ssd_pos if i < bad)
                self.stats.hit_pages_ssd += s
                self.stats.logical_read_bytes_ssd += s * g.page_bytes
                if bad < n:
                    self.stats.get_failures += 1
            if bad < n:
                unreadable = entries[bad]
            return out
        except Exception as e:
            self.errors("get", e)
            return [False] * len(keys)
        finally:
            for s in pinned:
                s.release()
            if unreadable is not None:
                self._drop_unreadable(unreadable)

    # ================================================================ sharing with follower ranks
    def _journal(self, e: JournalEntry) -> None:
        try:
            self.journal.append(e)
        except OSError as err:
            self.errors("journal append", err)

    def _sync(self) -> None:
        """Follower: mirror the rounds the writer published since the last call and drop the
        scopes it retired (see :mod:`flatcake.gva.journal`). One ``stat`` when nothing is new."""
        r = self._journal_reader
        if r is None:
            return
        try:
            with self.index.lock:
                restarted, entries = r.poll()
                if restarted:
                    for scope in list(self._mirror.values()):
                        self._forget_mirror_locked(scope)
                    self._mirror.clear()
                for e in entries:
                    if e.kind == ROUND:
                        self._mirror_round_locked(e)
                    elif e.kind == RETIRE and e.scope_id in self._mirror:
                        self._forget_mirror_locked(self._mirror.pop(e.scope_id))
        except Exception as err:  # never into SGLang: the follower just sees fewer pages
            self.errors("journal sync", err)

    def _forget_mirror_locked(self, scope: SessionScope) -> None:
        scope.force_retire()
        self.index.unpublish_scope_locked(scope)

    def _mirror_round_locked(self, e: JournalEntry) -> None:
        g = self.geometry
        try:
            parsed = fmt.unpack_round_header(self.ssd.read_at(e.file_index, e.round_offset, fmt.BLOCK))
            if parsed is None:
                return
            lay, _, _ = parsed
            if (lay.layers, lay.chunk_bytes) != (g.layers, g.chunk_bytes):
                return
            rec = fmt.unpack_record(self.ssd.read_at(e.file_index, e.round_offset + lay.record_offset, lay.record_bytes))
        except OSError as err:
            self.errors("journal round read", err)
            return
        if rec is None or rec.ns_digest != fmt.namespace_digest(self.namespace) or len(rec.keys) != lay.n_pages:
            return
        scope = self._mirror.get(e.scope_id)
        if scope is None:
            scope = self._mirror[e.scope_id] = self.index.open_scope_locked(MEDIUM_SSD, ReuseScope.ONE_SHOT)
        n, cb = lay.n_pages, g.chunk_bytes
        base = e.file_index * self.cfg.ssd.file_bytes + e.round_offset + fmt.BLOCK
        self.index.publish_locked(
            rec.keys,
            [PageEntry(encode_gva(MEDIUM_SSD, self.node, base + p * cb), scope, n * cb, rec.checksums[:, p].copy()) for p in range(n)],
        )
        self.index.set_tail_locked(scope, rec.keys[-1])

    def _drop_pool_file(self, file_index: int) -> None:
        """Pool file ``file_index`` was removed behind the backend: drop every scope with an
        extent in it (their pages are gone) and start the file afresh."""
        with self.index.lock:
            for scope in [s for s in self.index.scopes.values() if any(x.file_index == file_index for x in s.extents)]:
                if not self._free_scope_locked(scope):
                    # a reader pins it: hide its keys now; reclaim frees its other extents later
                    self.index.hide_scope_locked(scope)
                    gone = [x for x in scope.extents if x.file_index == file_index]
                    scope.extents = [x for x in scope.extents if x.file_index != file_index]
                    scope.nbytes -= sum(x.nbytes for x in gone)
            try:
                self.cio.forget_file(file_index)  # the readers' cached fds point at the old inode
                self.ssd.reset_file_locked(file_index)
            except OSError as e:
                self.errors("pool file reset", e)
        log.warning("flatcake: pool file %s was removed or truncated behind the backend; its scopes were dropped", self.ssd.path_of(file_index))

    def _drop_unreadable(self, entry: PageEntry) -> None:
        """``entry``'s page could not be read intact (file truncated or removed behind the
        backend, EIO, checksum mismatch): stop advertising its whole scope, so hit queries stop
        promising pages that every read would miss (skipped while another reader pins it), and
        let the readers reopen its file by path (it may have been replaced)."""
        scope = entry.scope
        if scope.medium == MEDIUM_SSD:
            try:
                self.cio.forget_file(decode_gva(entry.gva).offset // self.cfg.ssd.file_bytes)
            except Exception as e:
                self.errors("forget file", e)
        with self.index.lock:
            if self._free_scope_locked(scope):
                log.warning("flatcake: dropped scope %d (%d pages) after a failed read", scope.scope_id, len(scope.keys))

    def _read_ssd(self, entries, ssd_pos, layout, page_ids) -> int:
        """Restore SSD pages; returns the first position (in ``entries``) that failed, or len.

        Builds the restore's :class:`~flatcake.cio.plan.ChunkBatch` with numpy, layer-major
        (all pages of layer 0, then layer 1, ...): chunk (page ``i``, layer ``l``) is at byte
        ``offset_i + l * layer_stride_i`` of file ``file_i``, tag ``i`` (position in ``entries``),
        checksum ``entries[i].checksums[l]`` when verification is on. No per-chunk objects.
        """
        from flatcake.cio.plan import ChunkBatch
        from flatcake.gva.address import OFFSET_MASK

        g = self.geometry
        fb = self.cfg.ssd.file_bytes
        verify = self.cfg.cio.verify_checksums
        m, L = len(ssd_pos), g.layers
        pos = np.asarray(ssd_pos, dtype=np.int64)
        es = [entries[i] for i in ssd_pos]
        off = np.fromiter((e.gva & OFFSET_MASK for e in es), dtype=np.int64, count=m)
        stride = np.fromiter((e.layer_stride for e in es), dtype=np.int64, count=m)
        if isinstance(page_ids, torch.Tensor):
            dst = page_ids.detach().to("cpu", torch.int64).numpy()[pos]
        else:
            dst = np.fromiter((int(page_ids[i]) for i in ssd_pos), dtype=np.int64, count=m)
        f, o = np.divmod(off, fb)
        lay = np.arange(L, dtype=np.int64)
        # [L, m] grids flattened layer-major
        offsets = (o[None, :] + lay[:, None] * stride[None, :]).reshape(-1)
        sums = has = None
        if verify:
            has_page = np.fromiter((e.checksums is not None for e in es), dtype=bool, count=m)
            sums = np.zeros((L, m), dtype=np.uint64)
            for j in np.flatnonzero(has_page).tolist():
                sums[:, j] = np.asarray(es[j].checksums, dtype=np.uint64)[:L]
            sums = sums.reshape(-1)
            has = np.broadcast_to(has_page[None, :], (L, m)).reshape(-1)
        chunks = ChunkBatch(
            np.broadcast_to(f, (L, m)).reshape(-1), offsets, np.broadcast_to(dst, (L, m)).reshape(-1),
            np.repeat(lay, m), np.broadcast_to(pos, (L, m)).reshape(-1), g.chunk_bytes,
            checksum=sums, has_checksum=has if verify else np.zeros(L * m, dtype=bool),
        )
        rep = self.cio.restore(chunks, layout)
        with self._stats_lock:
            st = self.stats
            st.ssd_read_bytes += rep.bytes_read
            st.ssd_over_read_bytes += rep.bytes_over_read
            st.ssd_read_ops += rep.io_requests
            st.merged_reads += rep.merged_reads
            st.ssd_read_s += rep.read_s
        return min(rep.failed_tags) if rep.failed_tags else len(entries)

    # ================================================================ writes
    def put(self, keys: Sequence[str], layout: KvPageLayout, page_ids: Sequence[int], prefix_keys: Optional[Sequence[str]] = None) -> list[bool]:
        """Store pages (see :meth:`_put`); all ``False`` once the store is closed."""
        if not self._gate.enter():
            return [False] * len(keys)
        try:
            return self._put(keys, layout, page_ids, prefix_keys)
        finally:
            self._gate.exit()

    def _put(self, keys: Sequence[str], layout: KvPageLayout, page_ids: Sequence[int], prefix_keys: Optional[Sequence[str]] = None) -> list[bool]:
        """Store pages ``keys[i]`` taken from page ``page_ids[i]`` of ``layout``.

        Keys already stored are skipped (reported True). Returns per-page success; a failed
        page (no space, I/O error) is False and nothing stored before is touched. Never raises.
        """
        out = [False] * len(keys)
        try:
            todo, parent, seen = [], None, set()
            for i, k in enumerate(keys):
                if not _valid_key(k):
                    self.errors("put", ValueError(f"invalid page key {str(k)[:80]!r} (need a str of 1..{MAX_KEY_BYTES} UTF-8 bytes)"))
                    break  # the pages after an unusable key cannot be chained to it
                if k in seen or self.index.contains(k):  # same key = same page bytes (chained hash)
                    out[i] = True
                    continue
                seen.add(k)
                if not todo:
                    parent = keys[i - 1] if i > 0 else (prefix_keys[-1] if prefix_keys else None)
                todo.append(i)
            if not todo:
                return out
            ctx0 = (len(prefix_keys) if prefix_keys else 0) * self.geometry.page_size
            # rounds of at most max_round_pages pages, each written as one unit
            for a in range(0, len(todo), self.max_round_pages):
                part = todo[a : a + self.max_round_pages]
                ok = self._put_round([keys[i] for i in part], [int(page_ids[i]) for i in part], layout, parent, ctx0 + (part[-1] + 1) * self.geometry.page_size)
                for i in part:
                    out[i] = ok
                if not ok:
                    break
                parent = keys[part[-1]]
            return out
        except Exception as e:
            self.errors("put", e)
            return out

    def _put_round(self, keys, src_pages, layout, parent, context_tokens) -> bool:
        g = self.geometry
        n = len(keys)
        with self.index.lock:
            plc = self._place_locked(keys, src_pages, parent, context_tokens)  # pins plc.scope
        if plc is None:
            with self._stats_lock:
                self.stats.put_failures += 1
            return False
        scope = plc.scope
        try:
            if plc.slots is not None:
                entries = self._write_dram(plc, layout)
            else:
                entries = self._write_ssd(plc, layout)
        except Exception as e:
            self.errors("write", e)
            with self.index.lock:
                if plc.slots is not None:
                    self.dram.free_locked(plc.slots)
                    scope.nbytes -= len(plc.slots) * g.page_bytes
            scope.release()
            if isinstance(e, PoolFileGone):
                self._drop_pool_file(plc.extent_file)
            with self._stats_lock:
                self.stats.put_failures += 1
            return False
        with self.index.lock:
            self.index.publish_locked(keys, entries)
            if scope.tail_key is None or scope.tail_key == parent:  # appended at the tail
                self.index.set_tail_locked(scope, keys[-1])
            scope.cur_turn_tokens += n * g.page_size
        if self.journal is not None and plc.slots is None:
            self._journal(JournalEntry(ROUND, scope.scope_id, plc.extent_file, plc.round_offset))
        scope.release()
        with self._stats_lock:
            self.stats.logical_write_bytes += n * g.page_bytes
        self._reclaim_if_needed()
        return True

    def _decide_locked(self, n_pages: int, turn: int, prev: Optional[int], cur: int, keys, context_tokens: int):
        """Table 2 decision for a round of ``n_pages``. DRAM counts as full when the round does
        not fit in the free slots (the watermark reclaim after each write keeps headroom)."""
        return self.policy.decide(
            PlacementSignals(
                prefix_refcount=self.interest.take(list(keys)),
                turn=turn,
                prev_reply_tokens=prev,
                context_tokens=context_tokens,
                reply_tokens=cur + n_pages * self.geometry.page_size,
                dram_full=self.dram.free_slots < n_pages,
            )
        )

    def _place_locked(self, keys, src_pages, parent, context_tokens) -> Optional[_Placement]:
        """Choose scope and medium and allocate space. Writer lock held. Returns a pinned scope."""
        g = self.geometry
        n = len(keys)
        scope = self.index.tails.get(parent) if parent is not None else None
        if scope is not None and scope.retired:
            scope = None
        if scope is None:
            pe = self.index.get(parent) if parent is not None else None
            turn = pe.scope.turn if pe is not None else 1
            prev = pe.scope.prev_turn_tokens if pe is not None else None
            dec = self._decide_locked(n, turn, prev, 0, keys, context_tokens)
            scope = self.index.open_scope_locked(dec.medium, dec.scope, turn, prev)
        elif scope.medium == MEDIUM_DRAM:
            dec = self._decide_locked(n, scope.turn, scope.prev_turn_tokens, scope.cur_turn_tokens, keys, context_tokens)
            if dec.medium != MEDIUM_DRAM:  # the session continues on SSD; written pages stay
                old = scope
                scope = self.index.open_scope_locked(MEDIUM_SSD, dec.scope, old.turn, old.prev_turn_tokens)
                scope.cur_turn_tokens = old.cur_turn_tokens
        else:
            self.interest.take(list(keys))
        scope.try_acquire()
        scope.last_used_s = time.monotonic()
        if scope.medium == MEDIUM_DRAM:
            slots = self.dram.allocate_locked(n)
            if slots is None:  # raced with the signal; fall back to SSD for this round
                scope.release()
                old = scope
                scope = self.index.open_scope_locked(MEDIUM_SSD, ReuseScope.OVERFLOW, old.turn, old.prev_turn_tokens)
                scope.try_acquire()
            else:
                scope.slots.extend(slots)
                scope.nbytes += n * g.page_bytes
                return _Placement(scope, list(keys), src_pages, slots=slots)
        lay = fmt.round_layout(keys, g.layers, g.chunk_bytes)
        where = None
        if lay.total_bytes + fmt.BLOCK <= self.ssd.file_bytes:  # else no extent could ever hold it
            try:
                where = self._ssd_space_locked(scope, lay.total_bytes)
            except BaseException:
                scope.release()
                raise
        if where is None:
            scope.release()
            if not scope.keys and not scope.extents:
                self.index.scopes.pop(scope.scope_id, None)
            log.warning("flatcake: SSD pool full (%d bytes used); put of %d pages fails", self.ssd.used_bytes, n)
            return None
        f, off = where
        seq = scope.round_seq
        scope.round_seq += 1
        return _Placement(scope, list(keys), src_pages, extent_file=f, round_offset=off, layout=lay, seq=seq)

    def _ssd_space_locked(self, scope: SessionScope, nbytes: int) -> Optional[tuple[int, int]]:
        """Reserve ``nbytes`` at the scope's tail: in its last extent, by growing it in place,
        or in a new extent (whose header is written first). Reclaims when the pool is full."""
        if scope.extents:
            ext: Extent = scope.extents[-1]
            room = ext.end - scope.tail_offset
            if room >= nbytes:
                off = scope.tail_offset
                scope.tail_offset += nbytes
                return ext.file_index, off
            grown = self.ssd.try_extend_locked(ext, nbytes - room)
            if grown is not None:
                scope.extents[-1] = grown
                scope.nbytes += grown.nbytes - ext.nbytes
                off = scope.tail_offset
                scope.tail_offset += nbytes
                return ext.file_index, off
        need = nbytes + fmt.BLOCK
        ext = self.ssd.allocate_locked(need)
        while ext is None:  # no free range fits (full or fragmented): free oldest scopes one by one
            if not self._reclaim_one_locked(MEDIUM_SSD, exclude=scope):
                return None
            ext = self.ssd.allocate_locked(need)
        try:
            view = self._scratch(fmt.BLOCK)  # this thread's write buffer; the round reuses it after
            view[:] = fmt.pack_extent_header(self.namespace, self.node, scope.scope_id, len(scope.extents), ext.nbytes)
            self.ssd.write(ext.file_index, ext.offset, view)
            self._count_ssd_write(fmt.BLOCK)
        except OSError as e:
            self.errors("extent header write", e)
            self.ssd.free_locked(ext)
            if isinstance(e, PoolFileGone):
                self._drop_pool_file(ext.file_index)
            return None
        scope.extents.append(ext)
        scope.nbytes += ext.nbytes
        scope.tail_offset = ext.offset + fmt.BLOCK + nbytes
        return ext.file_index, ext.offset + fmt.BLOCK

    def _count_ssd_write(self, nbytes: int) -> None:
        with self._stats_lock:
            self.stats.ssd_write_bytes += nbytes
            self.stats.ssd_write_ops += 1

    def _write_dram(self, plc: _Placement, layout: KvPageLayout) -> list[PageEntry]:
        g = self.geometry
        n = len(plc.keys)
        src = torch.tensor(plc.src_pages, dtype=torch.long)
        tmp = torch.empty((n, g.layers, g.chunk_bytes), dtype=torch.uint8, device=layout.device)
        for layer in range(g.layers):
            layout.gather_chunks(src, layer, tmp[:, layer])
        self.dram.slots[torch.tensor(plc.slots, dtype=torch.long)] = tmp.view(n, -1).to("cpu")
        with self._stats_lock:
            self.stats.dram_write_bytes += n * g.page_bytes
            self.stats.pages_written_dram += n
        return [PageEntry(encode_gva(MEDIUM_DRAM, self.node, s * g.page_bytes), plc.scope, g.chunk_bytes) for s in plc.slots]

    def _scratch(self, nbytes: int) -> memoryview:
        buf = getattr(self._tls, "buf", None)
        if buf is None:
            buf = self._tls.buf = AlignedBuffer()
        return buf.reserve(nbytes)

    def _write_ssd(self, plc: _Placement, layout: KvPageLayout) -> list[PageEntry]:
        g = self.geometry
        lay = plc.layout
        n = lay.n_pages
        view = self._scratch(lay.total_bytes)
        arr = np.frombuffer(view, dtype=np.uint8, count=lay.total_bytes)
        view[: fmt.BLOCK] = fmt.pack_round_header(lay, plc.seq, plc.scope.scope_id)
        data = torch.from_numpy(arr[fmt.BLOCK : fmt.BLOCK + n * g.layers * g.chunk_bytes]).view(g.layers, n, g.chunk_bytes)
        src = torch.tensor(plc.src_pages, dtype=torch.long)
        for layer in range(g.layers):
            if layout.device.type == "cpu":
                layout.gather_chunks(src, layer, data[layer])
            else:
                tmp = torch.empty((n, g.chunk_bytes), dtype=torch.uint8, device=layout.device)
                layout.gather_chunks(src, layer, tmp)
                data[layer].copy_(tmp)
        sums = np.empty((g.layers, n), dtype=np.uint64)
        cb = g.chunk_bytes
        h = xxhash.xxh3_64_intdigest
        base = fmt.BLOCK
        for layer in range(g.layers):
            for p in range(n):
                o = base + (layer * n + p) * cb
                sums[layer, p] = h(view[o : o + cb])
        pad_from = fmt.BLOCK + n * g.layers * cb
        arr[pad_from : lay.record_offset] = 0
        rec = fmt.pack_record(self.namespace, plc.keys, g.layers, cb, sums)
        arr[lay.record_offset : lay.record_offset + len(rec)] = np.frombuffer(rec, dtype=np.uint8)
        arr[lay.record_offset + len(rec) : lay.total_bytes] = 0
        self.ssd.write(plc.extent_file, plc.round_offset, view[: lay.total_bytes])
        self._count_ssd_write(lay.total_bytes)
        with self._stats_lock:
            self.stats.pages_written_ssd += n
        fb = self.cfg.ssd.file_bytes
        stride = n * cb
        base_off = plc.extent_file * fb + plc.round_offset + fmt.BLOCK
        return [
            PageEntry(encode_gva(MEDIUM_SSD, self.node, base_off + p * cb), plc.scope, stride, sums[:, p].copy())
            for p in range(n)
        ]

    # ================================================================ reclaim
    def _reclaim_if_needed(self) -> None:
        if self.ssd.used_fraction() > self.cfg.ssd.high_watermark or (
            self.dram.n_slots and self.dram.used_fraction() > self.cfg.dram.high_watermark
        ):
            with self.index.lock:
                if self.ssd.used_fraction() > self.cfg.ssd.high_watermark:
                    self._reclaim_locked(MEDIUM_SSD)
                if self.dram.n_slots and self.dram.used_fraction() > self.cfg.dram.high_watermark:
                    self._reclaim_locked(MEDIUM_DRAM)

    def _reclaim_locked(self, medium: int) -> None:
        """Free the oldest unpinned scopes of ``medium`` whole until usage is at or below the
        low watermark. Writer lock held."""
        if medium == MEDIUM_SSD:
            target = self.cfg.ssd.low_watermark * self.ssd.capacity_bytes
            above = lambda: self.ssd.used_bytes > target  # noqa: E731
        else:
            target = self.cfg.dram.low_watermark * self.dram.n_slots
            above = lambda: self.dram.n_slots - self.dram.free_slots > target  # noqa: E731
        while above() and self._reclaim_one_locked(medium):
            pass

    def _reclaim_one_locked(self, medium: int, exclude: Optional[SessionScope] = None) -> bool:
        """Retire, unpublish and free the least recently used scope of ``medium`` that nobody
        pins (a reader or writer inside it is never freed under it). False if none can go."""
        for scope in self.index.oldest_scopes_locked(medium):
            if scope is not exclude and self._free_scope_locked(scope):
                return True
        return False

    def _free_scope_locked(self, scope: SessionScope) -> bool:
        """Retire ``scope`` if unpinned, then unpublish its keys and free its space (whole)."""
        if not scope.try_retire():
            return False
        self.index.unpublish_scope_locked(scope)
        if self.journal is not None and scope.medium == MEDIUM_SSD:
            self._journal(JournalEntry(RETIRE, scope.scope_id))
        if scope.medium == MEDIUM_SSD:
            for ext in scope.extents:
                self.ssd.free_locked(ext)
        else:
            self.dram.free_locked(scope.slots)
        with self._stats_lock:
            if scope.medium == MEDIUM_SSD:
                self.stats.reclaimed_scopes_ssd += 1
            else:
                self.stats.reclaimed_scopes_dram += 1
            self.stats.reclaimed_bytes += scope.nbytes
        return True

    # ================================================================ admin
    def clear(self) -> None:
        """Forget every page not pinned by a reader (SGLang's ``/hicache/storage-backend/clear``):
        each unpinned scope is retired, unpublished and its space freed; a scope a reader holds
        stays until a later clear or reclaim. Counted as reclaimed scopes."""
        with self.index.lock:
            for scope in list(self.index.scopes.values()):
                self._free_scope_locked(scope)

    def snapshot_stats(self) -> dict:
        """Counters as a plain dict (bytes, pages, ops, seconds) plus current usage."""
        with self._stats_lock:
            d = dict(self.stats.__dict__)
        d.update(
            pages_indexed=len(self.index),
            scopes=len(self.index.scopes),
            ssd_used_bytes=self.ssd.used_bytes,
            dram_used_slots=self.dram.n_slots - self.dram.free_slots,
            io_errors=self.errors.count,
            cio_engine=getattr(self.cio, "engine_name", "?"),
        )
        return d

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._gate.closed

    def close(self, timeout_s: float = 10.0) -> None:
        """Refuse new operations, wait up to ``timeout_s`` seconds for running ones, then
        release staging, files and pinned memory. Idempotent; never raises."""
        if self._gate.closed:
            return
        if not self._gate.close(timeout_s):
            # Tearing the I/O engine down under a running read could strand it; leave the
            # engine's daemon threads and the files to process exit instead.
            log.warning("flatcake close: operations still running after %.0f s; leaving I/O resources to exit", timeout_s)
            return
        for part in (self.cio, self.ssd, self.dram, self.journal, self._journal_reader):
            if part is None:
                continue
            try:
                part.close()
            except Exception as e:  # best effort at shutdown
                log.warning("flatcake close: %s: %s", type(part).__name__, e)
