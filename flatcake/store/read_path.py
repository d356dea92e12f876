"""The read path: moves pinned pages from their medium into KV page slots (paper §3.1, §3.3).

The caller (the store) has looked up the leading run of keys and pinned their scopes, so no
byte read here can be freed or reused underneath; this path only moves bytes.

Lifecycle of one read (no lock held)::

    split the entries by medium (the GVA's medium field)
    SSD pages:  one ChunkBatch of (page, layer) chunks, layer-major -> FC-CIO restore
                (sort, merge, O_DIRECT reads into the staging window, verify, scatter)
    DRAM pages: check each slot still holds its key's page (its identity), then copy its
                layers into the layout (only pages before the first failure)
    -> the leading number of pages delivered intact
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Optional, Sequence

import numpy as np
import torch

from flatcake.cio.pagecopy import scatter_pages
from flatcake.cio.plan import ChunkBatch
from flatcake.common.errorlog import ErrorLog
from flatcake.gva.address import MEDIUM_DRAM, MEDIUM_SHIFT, MEDIUM_SSD, OFFSET_MASK, SSD_BOUNDARY, medium_of
from flatcake.gva.index import PageEntry
from flatcake.common.layout import KvPageLayout, PageGeometry
from flatcake.media.dram import DramRegion
from flatcake.media.ssd import SsdFilePool
from flatcake.store.stats import StoreStats
from flatcake.store.write_queue import MEDIUM_QUEUED


class ReadPath:
    """Reads pinned pages into a layout: DRAM by copy, SSD through FC-CIO.

    Args:
        geometry: page geometry of the namespace.
        dram: the DRAM region.
        ssd: the SSD pool (file size, and each file's generation: a page written under an older
            generation of its file is a miss).
        cio: the FC-CIO :class:`~flatcake.cio.restore.RestoreEngine`.
        verify: pass each chunk's checksum to the restore (``cio.verify_checksums``); pages
            rebuilt at start-up (``PageEntry.verify``) are checked whatever it says. The
            restore engine must verify every chunk that carries a checksum.
        stats: the store's stats object.
        errors: the store's error-once log (DRAM identity mismatches).
    """

    def __init__(self, geometry: PageGeometry, dram: DramRegion, ssd: SsdFilePool, cio, verify: bool,
                 stats: StoreStats, errors: ErrorLog):
        self.errors = errors
        self.geometry = geometry
        self.dram = dram
        self.ssd = ssd
        self.cio = cio
        self.file_bytes = ssd.file_bytes
        self.verify = verify
        self.stats = stats
        #: the SSD write queue (:class:`~flatcake.store.write_queue.WriteQueue`) or None: SSD restores
        #: are marked in flight on it (writes wait for the gap) and its pages are read from memory
        self.queue = None
        #: the FC-CIO engine for layouts on a GPU (HBM staging; :meth:`flatcake.store.page_store.PageStore.attach_device_restore`)
        #: or None: every restore goes through ``cio``
        self.device_cio = None

    def read(self, keys: Sequence[str], entries: Sequence[PageEntry], layout: KvPageLayout,
             page_ids: Sequence[int], layers: Optional[Sequence[int]] = None) -> int:
        """Deliver page ``entries[i]`` (the page of ``keys[i]``) into page ``page_ids[i]`` of ``layout``.

        Args:
            keys: the pages' keys (DRAM pages are checked against their slot's identity).
            entries: index entries whose scopes the caller pinned.
            layout: destination (host pool, flat pages or device KV).
            page_ids: int page ids in ``layout`` (a list or an int64 tensor), at least as many as entries.
            layers: ascending layer indices to deliver (default: every layer). The direct linker
                (:mod:`flatcake.linker`) reads a pinned run layer group by layer group so the
                forward can start on layer 0 while later layers load; hit pages and logical bytes
                are counted once per page (with the group holding layer 0), the SSD bytes per read.

        Returns:
            ``n``: pages ``0..n-1`` were delivered intact; page ``n`` (if any) failed (short
            read, I/O error, checksum mismatch, a DRAM slot holding another page) and no later
            page is reported.

        Raises:
            ValueError: descriptors outside the layout (a caller bug).
            RuntimeError: the restore engine was closed.
            I/O faults never raise.
        """
        g = self.geometry
        n = len(entries)
        layers = range(g.layers) if layers is None else layers
        dram_pos, ssd_pos, queued_pos = split_media([e.gva for e in entries])
        good = n
        if ssd_pos:
            if self.queue is not None:  # writes not yet issued wait for the gap after it
                self.queue.reads_begin()  # (queue.reading() without the context-manager frames)
                try:
                    good = min(good, self._read_ssd(entries, ssd_pos, layout, page_ids, layers))
                finally:
                    self.queue.reads_end()
            else:
                good = min(good, self._read_ssd(entries, ssd_pos, layout, page_ids, layers))
        if queued_pos:
            self._copy_queued(entries, [i for i in queued_pos if i < good], layout, page_ids, layers)
        pos = [i for i in dram_pos if i < good]
        if pos:
            good = min(good, self._check_dram(keys, entries, pos))
            pos = [i for i in pos if i < good]
        if pos:
            self._copy_dram(entries, pos, layout, page_ids, layers)
        if len(layers) and layers[0] == 0:  # once per page when read layer group by layer group
            ssd_hits = bisect_left(ssd_pos, good)  # positions ascend
            self.stats.add(hit_pages_dram=len(pos), hit_pages_ssd=ssd_hits,
                           logical_read_bytes_ssd=ssd_hits * g.page_bytes,
                           queued_hit_pages=bisect_left(queued_pos, good))
        return good

    def _copy_queued(self, entries, pos: list[int], layout: KvPageLayout, page_ids, layers: Sequence[int]) -> None:
        """Copy pages still in the write queue (:class:`~flatcake.store.write_queue.QueuedPage`) from
        their round's in-memory copy into the layout, round by round, layer by layer."""
        by_job: dict = {}
        for i in pos:
            by_job.setdefault(id(entries[i].job), []).append(i)
        for idx in by_job.values():
            job = entries[idx[0]].job
            dst = torch.tensor([int(page_ids[i]) for i in idx], dtype=torch.long)
            for layer in layers:
                rows = job.chunks(layer, [entries[i].pos for i in idx])
                if rows.device != layout.device:
                    rows = rows.to(layout.device)
                scatter_pages(layout, rows, dst, layer)

    def _slot(self, e: PageEntry) -> int:
        return (e.gva & OFFSET_MASK) // self.geometry.page_bytes

    def _check_dram(self, keys, entries, pos: list[int]) -> int:
        """The first position in ``pos`` whose slot does not hold its key's page, else len(entries)."""
        ok = self.dram.holds([self._slot(entries[i]) for i in pos], [keys[i] for i in pos])
        if ok.all():
            return len(entries)
        bad = pos[int(np.argmin(ok))]
        self.errors.report("verify", "dram identity", f"DRAM slot {self._slot(entries[bad])} does not hold page "
                           f"{keys[bad][:32]}")
        return bad

    def _copy_dram(self, entries, pos: list[int], layout: KvPageLayout, page_ids, layers: Sequence[int]) -> None:
        """Copy DRAM pages ``entries[pos]`` (slot rows ``[layers, chunk_bytes]``) into the layout."""
        g = self.geometry
        slots = torch.tensor([self._slot(entries[i]) for i in pos], dtype=torch.long)
        dst = torch.tensor([int(page_ids[i]) for i in pos], dtype=torch.long)
        rows = self.dram.slots[slots].view(len(pos), g.layers, g.chunk_bytes)
        if rows.device != layout.device:
            rows = rows.to(layout.device, non_blocking=True)
        for layer in layers:
            scatter_pages(layout, rows[:, layer], dst, layer)

    def chunk_batch(self, entries: Sequence[PageEntry], ssd_pos: Sequence[int], page_ids,
                    layers: Optional[Sequence[int]] = None) -> ChunkBatch:
        """The restore's :class:`ChunkBatch` for SSD pages ``entries[ssd_pos]``, built with numpy,
        layer-major (all pages of layer 0, then layer 1, ...): chunk (page ``i``, layer ``l``) is
        at byte ``offset_i + l * layer_stride_i`` of file ``file_i``, tag ``i`` (position in
        ``entries``), checksum ``entries[i].checksums[l]`` (and device checksum
        ``entries[i].checksums[layers + l]`` for record-v3 rounds) when verification is on or the
        page was rebuilt at start-up. No per-chunk objects; per page only attribute reads (one
        list per field), the rest whole-array numpy (issue 11: ~128 pages a call at 1-token
        pages). ``ssd_pos``: ascending positions, ``range(len(entries))`` when all are SSD;
        ``page_ids``, ``layers``: as :meth:`read` (only those layers' chunks, in that order)."""
        g = self.geometry
        m, L = len(ssd_pos), g.layers
        some = layers is not None and list(layers) != list(range(L))
        lay_ids = np.asarray(list(layers), dtype=np.int64) if some else np.arange(L, dtype=np.int64)
        nl = int(lay_ids.shape[0])
        whole = isinstance(ssd_pos, range) and ssd_pos == range(len(entries))
        es = entries if whole else [entries[i] for i in ssd_pos]
        if isinstance(page_ids, torch.Tensor):
            dst = page_ids.detach().to("cpu", torch.int64).numpy()[np.asarray(ssd_pos, dtype=np.int64)].tolist()
        else:
            dst = list(map(int, map(page_ids.__getitem__, ssd_pos)))
        # per page: byte offset in the pool, layer stride, destination page, tag; [4, m]
        cols = np.array([[e.gva & OFFSET_MASK for e in es], [e.layer_stride for e in es], dst, list(ssd_pos)],
                        dtype=np.int64).reshape(4, m)
        x = np.empty((5, nl, m), dtype=np.int64)  # file, offset, page, layer, tag: [nl, m] each, layer-major
        x[0], x[1] = np.divmod(cols[0], self.file_bytes)
        lay = lay_ids[:, None]
        x[1] += lay * cols[1]
        x[2], x[3], x[4] = cols[2], lay, cols[3]
        sums, has = self._checksums(es, L)
        if some:
            sums, has = sums[:, lay_ids], has[:, lay_ids]
        x = x.reshape(5, nl * m)
        return ChunkBatch(x[0], x[1], x[2], x[3], x[4], g.chunk_bytes, checksum=sums[0].reshape(-1),
                          has_checksum=has[0].reshape(-1), devsum=sums[1].reshape(-1), has_devsum=has[1].reshape(-1))

    def _checksums(self, es: Sequence[PageEntry], L: int) -> tuple[np.ndarray, np.ndarray]:
        """Expected checksums of pages ``es``: uint64 ``[2, L, m]`` (xxh3 ``[0]``, device
        checksum ``[1]``; 0 where absent, layer-major) and bool ``[2, L, m]``: page ``j`` is
        verified (it has checksums and verification is on or it was rebuilt at start-up), and
        it has device checksums (``[2 * L]`` of them, record v3). Pages whose checksums are all
        numpy arrays of one length are gathered in one ``np.concatenate``; else page by page."""
        m = len(es)
        cks = [e.checksums for e in es]
        has_page = [c is not None for c in cks] if self.verify else \
            [c is not None and e.verify for c, e in zip(cks, es)]
        sums, has = np.zeros((2, L, m), dtype=np.uint64), np.zeros((2, L, m), dtype=bool)
        if not any(has_page):
            return sums, has
        lens = set(map(len, cks)) if all(has_page) and set(map(type, cks)) == {np.ndarray} else ()
        k = next(iter(lens)) if len(lens) == 1 else 0
        if k >= L:  # every page: one ndarray of k checksums
            flat = np.concatenate(cks, dtype=np.uint64, casting="unsafe")  # as np.asarray(c, dtype=np.uint64) each
            if flat.ndim == 1:
                both = flat.reshape(m, k)
                sums[0] = both[:, :L].T
                has[0] = True
                if k >= 2 * L:
                    sums[1] = both[:, L: 2 * L].T
                    has[1] = True
                return sums, has
        for j in np.flatnonzero(has_page).tolist():
            c = np.asarray(cks[j], dtype=np.uint64)  # [layers] or [2 * layers] (record v3)
            sums[0, :, j] = c[:L]
            has[0, :, j] = True
            if c.shape[0] >= 2 * L:
                sums[1, :, j] = c[L: 2 * L]
                has[1, :, j] = True
        return sums, has

    def _read_ssd(self, entries, ssd_pos: Sequence[int], layout: KvPageLayout, page_ids,
                  layers: Optional[Sequence[int]] = None) -> int:
        """Restore SSD pages; returns the first position (in ``entries``) that failed, or len.

        A page whose pool file was reset (removed or truncated behind the backend) after it was
        written fails even when its bytes were read: after the check below, nothing read before
        it can come from a file recreated since (the read would have found the new generation)."""
        batch = self.chunk_batch(entries, ssd_pos, page_ids, layers)
        cio = self.device_cio if self.device_cio is not None and layout.device.type != "cpu" else self.cio
        rep = cio.restore(batch, layout)
        self.stats.add(ssd_read_bytes=rep.bytes_read, ssd_over_read_bytes=rep.bytes_over_read,
                       ssd_read_ops=rep.io_requests, ssd_restores=1, merged_reads=rep.merged_reads,
                       ssd_read_s=rep.read_s)
        bad = min(rep.failed_tags) if rep.failed_tags else len(entries)
        # generations read after the restore, once per file; layer 0's chunks are the pages in order
        files = batch.file_index[:len(ssd_pos)].tolist()
        gen = self.ssd.generation_of
        now = {fi: gen(fi) for fi in set(files)}
        written = [entries[i].generation for i in ssd_pos]
        stale = bad
        if list(map(now.__getitem__, files)) != written:  # (compared in C; the loop finds the first)
            stale = next(i for i, fi, w in zip(ssd_pos, files, written) if now[fi] != w)
        if stale < bad:
            self.errors.report("read", "file reset", f"pool file {self.file_of(entries[stale])} was reset after the page was written")
        return min(bad, stale)

    def file_of(self, entry: PageEntry) -> int:
        """SSD pool file holding ``entry``'s page (``-1`` for a DRAM page)."""
        if medium_of(entry.gva) != MEDIUM_SSD:
            return -1
        return (entry.gva & OFFSET_MASK) // self.file_bytes

    def forget_file(self, file_index: int) -> None:
        """Close the restore engine's cached handles of ``file_index`` (it was removed,
        truncated or replaced; the next read reopens it by path)."""
        self.cio.forget_file(file_index)
        if self.device_cio is not None:
            self.device_cio.forget_file(file_index)


def split_media(gvas: Sequence[int]) -> tuple[list[int], Sequence[int], list[int]]:
    """Positions in ``gvas`` of DRAM, SSD and queued (:data:`~flatcake.store.write_queue.MEDIUM_QUEUED`)
    pages, each ascending; other media in none. When every page is on SSD (the common restore:
    ``2**60 <= gva < 2**61``, two C passes instead of one Python call per page) the SSD positions
    are ``range(len(gvas))``."""
    if gvas and SSD_BOUNDARY <= min(gvas) and max(gvas) < (MEDIUM_SSD + 1) << MEDIUM_SHIFT:
        return [], range(len(gvas)), []
    media = [medium_of(g) for g in gvas]
    return ([i for i, m in enumerate(media) if m == MEDIUM_DRAM], [i for i, m in enumerate(media) if m == MEDIUM_SSD],
            [i for i, m in enumerate(media) if m == MEDIUM_QUEUED])

