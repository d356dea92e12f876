"""FC-CIO restore: SSD chunks → staging window → KV page slots (paper §3.3).

Lifecycle of one :meth:`RestoreEngine.restore` call::

    plan      plan_reads(): sort by (file, offset), merge, bridge gaps < gap_bytes, align to 4 KiB,
              split at max_io_bytes                                   (flatcake.cio.plan)
    batch     cut the merged reads into batches that fit one staging buffer, layer order
    acquire   take a double-buffered staging window; WAIT while all are busy (never fail)
    pipeline  for batch i:  submit reads of batch i+1 into the other buffer
                            wait reads of batch i → keep chunks fully read (and checksum-clean)
                            scatter them into the layout (torch / Triton kernel)
              (POSIX on CPU: all of it in one GIL-free C call, flatcake.cio.native_restore; without
               it the chunks of each I/O piece are verified and scattered on a small
               scatter pool as soon as the piece lands, so the scatter of layer l overlaps the
               reads of layer l and l+1; the buffer is reused only after all its scatters finished)
              (GPU: the scatter runs on a CUDA stream and records an event; a buffer is
               refilled only after its event completed)
    release   window back to the pool; report pages, merged reads, bytes, over-read, failures

Guarantees:

* **No I/O fault raises.** EIO, a missing file, a short read or EOF, or a checksum mismatch
  turn the affected chunks' tags into ``RestoreReport.failed_tags``; each distinct error is
  logged once.
* **No stale bytes.** A chunk is scattered only if every byte of it was read by *this* restore
  (and, with ``cfg.verify_checksums`` and a checksum given, its checksum matches: xxh3-64 on host
  staging; on HBM staging the device checksum, computed by a Triton kernel where the chunk
  landed, only a bool mask copied back — xxh3 on a host copy for record-v2 rounds); a slot whose
  chunk failed keeps its previous contents.
* **Thread-safe, O(1) staging.** Any number of threads may call :meth:`restore`; they share
  ``cfg.windows`` windows of two ``staging_bytes`` buffers, allocated once at start-up.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from flatcake.common.align import ALIGN, align_up
from flatcake.cio.batch import StagingBatch, verify_chunks, verify_chunks_device
from flatcake.cio.engines import IoEngine, PosixEngine
from flatcake.cio.kvikio_engine import EngineUnavailableError, KvikioEngine, select_engine
from flatcake.cio.native_restore import NativeRestore
from flatcake.cio.plan import ChunkBatch, MergedRead, batch_reads, plan_reads
from flatcake.cio.staging import StagingPool, StagingWindow
from flatcake.config import STORAGE_BATCH_PAGES, CioConfig
from flatcake.common.errorlog import ErrorLog
from flatcake.kernels.scatter import resolve_impl, scatter_chunks

log = logging.getLogger(__name__)


#: Floor of the automatic staging buffer size (bytes). With small pages one layer of 128 pages
#: is only a few MiB, and two such buffers keep too few bytes in flight: on the dev machine's
#: disk a 1 GiB restore of 32 KiB chunks ran at a median 1.11 GB/s with 16 MiB buffers and
#: 1.30 GB/s with 32 MiB buffers (4 interleaved runs each; docs/performance.md).
MIN_AUTO_STAGING_BYTES = 32 << 20


def auto_staging_bytes(chunk_bytes: int, max_pages_per_restore: int) -> int:
    """Default bytes per staging buffer: one layer of ``max_pages_per_restore`` chunks plus
    alignment slack (the first and last 4 KiB block of a read), rounded up to 4 KiB, and at
    least :data:`MIN_AUTO_STAGING_BYTES` so enough bytes stay in flight for small pages.

    With layer-major extents one layer of a restore is one contiguous range, so one buffer
    holds (at least) one layer and the two buffers of a window two layers (paper §3.3).
    """
    return max(align_up(max_pages_per_restore * chunk_bytes) + 2 * ALIGN, MIN_AUTO_STAGING_BYTES)


@dataclass(frozen=True)
class RestoreReport:
    """Outcome of one :meth:`RestoreEngine.restore` call.

    Attributes:
        failed_tags: tags of chunks NOT delivered (short read/EOF, EIO, missing file, checksum
            mismatch); their slots were left untouched.
        pages: distinct destination pages requested.
        chunks: chunk descriptors requested.
        merged_reads: aligned reads issued (the SSD read operations of this restore).
        bytes_read: bytes requested from the SSD (Σ merged read lengths).
        bytes_over_read: ``bytes_read`` minus the chunk bytes (bridged gaps, alignment slack).
        read_s: wall seconds from the first read submitted to the last scatter finished.
        engine: ``"posix"`` or ``"kvikio"``.
        wait_s: seconds spent waiting for a free staging window.
        batches: staging batches (pipeline steps) used.
        io_requests: read system calls / cuFile reads issued (a merged read is cut into up to
            ``io_workers`` pieces read in parallel).
    """

    failed_tags: frozenset[int]
    pages: int
    chunks: int
    merged_reads: int
    bytes_read: int
    bytes_over_read: int
    read_s: float
    engine: str
    wait_s: float = 0.0
    batches: int = 0
    io_requests: int = 0


class DeviceVerifyCounter:
    """Bytes a device-staging restore copied device-to-host to verify chunks (the mask's bytes,
    plus the chunks of record-v2 rounds): the GPU check asserts it stays at the mask's size.
    ``d2h_bytes`` is updated with ``+=`` from restore threads (a diagnostic; exact when restores
    do not overlap)."""

    def __init__(self):
        self.d2h_bytes = 0


class RestoreEngine:
    """FC-CIO read path: coalesced reads into a fixed double-buffered window, then scatter.

    Args:
        cfg: the ``cio`` section (engine, gap_bytes, max_io_bytes, io_workers, staging_bytes,
            windows, scatter, verify_checksums).
        path_of: maps an SSD pool file index to its path (files are fixed-size, never renamed).
        direct_io: read with O_DIRECT (POSIX) / GDS-style direct reads: the result of the SSD
            pool's start-up probe (:func:`flatcake.media.ssd.probe_direct_io`, the one place it
            is probed); an ``EINVAL`` at open or read time still falls back to buffered reads
            with one log line.
        chunk_bytes: bytes of one (page, layer) chunk; every chunk descriptor must have it.
        max_pages_per_restore: pages one restore usually carries (SGLang: 128); sizes the
            automatic staging buffer.
        device: staging device: ``"cpu"`` (page-aligned host memory) or ``"cuda[:N]"`` (HBM,
            registered with cuFile; needs the kvikio engine).
        errors: the error-once log to report I/O faults to (the store's); a new one otherwise.

    Attributes:
        engine_name: ``"posix"`` or ``"kvikio"``, chosen by the start-up probe and logged once.
        staging_bytes: bytes per staging buffer (two per window).
        direct_io: whether reads currently bypass the page cache.
        scatter_impl: ``"torch"`` or ``"triton"``.
        staging: the :class:`~flatcake.cio.staging.StagingPool` of ``cfg.windows`` windows.
        worker_scatter: chunks are verified and scattered by a small pool as each I/O piece
            lands (POSIX engine + torch scatter), not after the whole batch.
        device_verify: :class:`DeviceVerifyCounter` of the bytes HBM-staging verification copied
            to the host (:func:`~flatcake.cio.batch.verify_chunks_device`).
        verify_in_place: verify chunks with the device checksum where they landed
            (:func:`~flatcake.cio.batch.verify_chunks_device`), not xxh3 on a host view: True on
            CUDA staging. Tests turn it on for host staging, with ``worker_scatter`` off, to run
            the GPU's verify step through a real restore on CPU.

    Raises:
        EngineUnavailableError: ``cfg.engine='kvikio'`` but kvikio cannot move bytes here, or a
            CUDA staging device without a working kvikio.
        ValueError: ``cfg.staging_bytes`` too small for one chunk (needs
            ``align_up(chunk_bytes) + 4096``), or non-positive ``chunk_bytes``.
    """

    def __init__(
        self,
        cfg: CioConfig,
        path_of: Callable[[int], str],
        *,
        direct_io: bool,
        chunk_bytes: int,
        max_pages_per_restore: int = STORAGE_BATCH_PAGES,
        device: str = "cpu",
        errors: Optional[ErrorLog] = None,
    ):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.cfg = cfg
        self.chunk_bytes = int(chunk_bytes)
        self.device = torch.device(device)
        self._path_of = path_of
        staging = cfg.staging_bytes or auto_staging_bytes(chunk_bytes, max(1, max_pages_per_restore))
        need = align_up(chunk_bytes) + ALIGN
        if staging < need:
            raise ValueError(
                f"cio.staging_bytes={staging} cannot hold one chunk of {chunk_bytes} bytes "
                f"with alignment slack (need >= {need})"
            )
        self.staging_bytes = staging
        self.max_io_bytes = min(cfg.max_io_bytes, staging)
        probe_dir = os.path.dirname(os.path.abspath(path_of(0)))
        self.engine_name, why = select_engine(cfg.engine, probe_dir, str(self.device))
        self.errors = errors if errors is not None else ErrorLog(log)
        self._engine: IoEngine
        if self.engine_name == "kvikio":
            self._engine = KvikioEngine(path_of, cfg.io_workers, errors=self.errors, direct_io=direct_io)
        else:
            self._engine = PosixEngine(path_of, cfg.io_workers, direct_io=direct_io, errors=self.errors)
        try:
            self.staging = StagingPool(cfg.windows, staging, str(self.device))
        except Exception:
            self._engine.close()
            raise
        self.scatter_impl = resolve_impl(cfg.scatter, self.device)
        # POSIX workers verify + scatter the chunks of the piece they just read (else the caller)
        self.worker_scatter = self.engine_name == "posix" and self.scatter_impl == "torch"
        # on a small pool (not the I/O threads): an I/O worker starts its next read at once
        self._scatter_pool = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)),
                                                thread_name_prefix="fc-cio-scatter")
        # one GIL-free C call per restore where it applies (flatcake.cio.native_restore)
        self._native = NativeRestore(self, self._engine) if self.worker_scatter and self.device.type == "cpu" else None
        self._streams = None
        if self.device.type == "cuda":
            self._streams = [torch.cuda.Stream(self.device) for _ in range(cfg.windows)]
        self._closed = False
        self._close_lock = threading.Lock()
        self.device_verify = DeviceVerifyCounter()
        self.verify_in_place = self.device.type == "cuda"
        log.info(
            "FC-CIO: engine=%s (%s), direct_io=%s, io_workers=%d, staging %d windows x 2 x %d bytes on %s, "
            "scatter=%s, gap_bytes=%d, max_io_bytes=%d",
            self.engine_name, why, self.direct_io, cfg.io_workers, cfg.windows, staging, self.device,
            self.scatter_impl, cfg.gap_bytes, self.max_io_bytes,
        )

    # ------------------------------------------------------------------ properties
    @property
    def direct_io(self) -> bool:
        """Whether reads bypass the page cache (may turn False after an O_DIRECT refusal)."""
        return self._engine.direct_io

    @property
    def staging_total_bytes(self) -> int:
        """Staging memory held, in bytes (``2 × windows × staging_bytes``), fixed at start-up."""
        return self.staging.total_bytes

    @property
    def window_waits(self) -> int:
        """Restores that had to wait for a staging window so far."""
        return self.staging.waits

    # ------------------------------------------------------------------ restore
    def _check(self, chunks: ChunkBatch, layout) -> None:
        """Vectorized argument check (one unsigned max over each of ``page`` and ``layer``)."""
        if layout.device.type != self.device.type:
            raise ValueError(f"layout on {layout.device} but staging on {self.device}")
        if layout.geometry.chunk_bytes != self.chunk_bytes:
            raise ValueError(
                f"layout chunk_bytes {layout.geometry.chunk_bytes} != engine chunk_bytes {self.chunk_bytes}"
            )
        if not len(chunks):
            return
        L, N = layout.geometry.layers, layout.num_pages
        nb = chunks.nbytes
        if isinstance(nb, int):
            if nb != self.chunk_bytes:
                raise ValueError(f"chunk tag {int(chunks.tag[0])}: nbytes {nb} != chunk_bytes {self.chunk_bytes}")
        elif (nb != self.chunk_bytes).any():
            i = int(np.argmax(nb != self.chunk_bytes))
            raise ValueError(f"chunk tag {int(chunks.tag[i])}: nbytes {int(nb[i])} != chunk_bytes {self.chunk_bytes}")
        p, l = chunks.page, chunks.layer  # int64: a negative entry viewed as uint64 is >= 2**63
        if int(p.view(np.uint64).max()) >= N or int(l.view(np.uint64).max()) >= L:
            i = int(np.argmax((p < 0) | (p >= N) | (l < 0) | (l >= L)))
            raise ValueError(f"chunk tag {int(chunks.tag[i])}: page {int(p[i])}/layer {int(l[i])} outside layout "
                             f"({N} pages, {L} layers)")

    @contextmanager
    def window(self) -> Iterator[StagingWindow]:
        """Hold one staging window for the duration of a ``with`` block (waits while all are
        busy), as a restore does; a restore started meanwhile waits for it. For tools and tests
        that need a staging buffer of the engine's size, device and alignment."""
        win = self.staging.acquire()
        try:
            yield win
        finally:
            self.staging.release(win)

    def restore(self, chunks: ChunkBatch, layout, *, scatter: bool = True) -> RestoreReport:
        """Read ``chunks`` from SSD and scatter them into ``layout``.

        Args:
            chunks: the restore's :class:`~flatcake.cio.plan.ChunkBatch` (numpy arrays, any
                order; its ``nbytes`` must equal ``chunk_bytes``).
            layout: destination :class:`~flatcake.common.layout.KvPageLayout` (host pool on CPU staging,
                device paged KV on CUDA staging).
            scatter: ``False`` is the *reads-only* mode (the GPU check's baseline): the same plan,
                batches and double-buffered window, but the bytes stay in staging — no checksum
                check, no scatter, ``layout`` untouched; ``failed_tags`` lists the chunks not
                fully read.

        Returns:
            A :class:`RestoreReport`; the tags in ``failed_tags`` were not delivered.

        Raises:
            ValueError: a descriptor outside the layout, a wrong chunk size or a device mismatch
                (programming errors; I/O faults never raise).
            RuntimeError: the engine was closed.
        """
        if self._closed:
            raise RuntimeError("RestoreEngine is closed")
        self._check(chunks, layout)
        if not len(chunks):
            return RestoreReport(frozenset(), 0, 0, 0, 0, 0, 0.0, self.engine_name)
        if scatter and self._native is not None and self.worker_scatter and not self.verify_in_place:
            rep = self._native.restore(chunks, layout)
            if rep is not None:
                return rep
        plan = plan_reads(chunks, gap_bytes=self.cfg.gap_bytes, max_io_bytes=self.max_io_bytes)
        batches = batch_reads(plan.reads, self.staging_bytes)
        t_wait = time.perf_counter()
        win = self.staging.acquire()
        t0 = time.perf_counter()
        failed: set[int] = set()
        pending = cur = None
        io_requests = 0
        try:
            pending = self._submit(batches[0], win, 0, layout, scatter)
            io_requests += len(pending.pieces)
            for i in range(len(batches)):
                nxt = None
                if i + 1 < len(batches):
                    nxt = self._submit(batches[i + 1], win, (i + 1) % 2, layout, scatter)
                    io_requests += len(nxt.pieces)
                cur, pending = pending, nxt
                self._finish_batch(cur, win, i % 2, layout, failed, scatter)
                cur = None
            if self._streams is not None:
                self._streams[win.index].synchronize()
        finally:
            for st in (cur, pending):  # an exception left work in flight: let it end first
                if st is not None:
                    st.pending.wait()
                    for f in st.futures:
                        f.exception()  # waits; that error, if any, is not the one being raised
            if self._streams is not None:
                self._streams[win.index].synchronize()
            self.staging.release(win)
        t1 = time.perf_counter()
        return RestoreReport(
            failed_tags=frozenset(failed),
            pages=plan.pages,
            chunks=plan.chunks,
            merged_reads=len(plan.reads),
            bytes_read=plan.bytes_read,
            bytes_over_read=plan.bytes_over_read,
            read_s=t1 - t0,
            engine=self.engine_name,
            wait_s=t0 - t_wait,
            batches=len(batches),
            io_requests=io_requests,
        )

    def _submit(self, batch: list[MergedRead], win: StagingWindow, b: int, layout, scatter: bool) -> StagingBatch:
        """Start the reads of ``batch`` into buffer ``b`` of ``win``; returns the batch state.

        With the POSIX engine on host staging the chunks each I/O piece owns are verified and
        scattered on the scatter pool as soon as that piece is read (overlapping the other
        reads, on every core), while the I/O worker goes on to its next read; the rest are
        handled by :meth:`_finish_batch` (see :mod:`flatcake.cio.batch`).
        """
        buf = win.buffers[b]
        if win.events is not None:
            win.events[b].synchronize()  # the previous scatter out of this buffer has finished
        st = StagingBatch.build(batch, buf, layout, self.chunk_bytes, self.cfg.io_workers,
                                owned=self.worker_scatter and scatter)
        on_piece = None
        if st.has_owned:
            on_piece = lambda k, res: st.futures.append(self._scatter_pool.submit(self._piece_done, st, k, res))  # noqa: E731
        st.pending = self._engine.submit(st.pieces, buf, on_piece)
        return st

    def _verify(self, host, b0: np.ndarray, idx: np.ndarray, chunks: ChunkBatch) -> np.ndarray:
        """:func:`~flatcake.cio.batch.verify_chunks` when ``cio.verify_checksums`` is on, else all True."""
        if not self.cfg.verify_checksums or b0.shape[0] == 0:
            return np.ones(b0.shape[0], dtype=bool)
        return verify_chunks(host, b0, idx, chunks, self.chunk_bytes, self.errors)

    def _short(self, chunks: ChunkBatch, i: int, res) -> None:
        if res.error == "EOF":
            self.errors.report(
                "read", "short read",
                f"file {int(chunks.file_index[i])} ends before byte {int(chunks.offset[i]) + self.chunk_bytes} "
                f"(chunk tag {int(chunks.tag[i])})",
            )

    def _scatter(self, st: StagingBatch, b0: np.ndarray, idx: np.ndarray) -> None:
        """Scatter chunks ``idx`` (positions in the batch) from buffer offsets ``b0`` (int64)."""
        ch = st.chunks
        scatter_chunks(
            st.buf.tensor, torch.from_numpy(b0), st.layout, torch.from_numpy(ch.page[idx]),
            torch.from_numpy(ch.layer[idx]), impl=self.scatter_impl,
        )

    def _piece_done(self, st: StagingBatch, k: int, res) -> None:
        """Worker-side: verify and scatter the chunks piece ``k`` owns, now that it was read."""
        lo, hi = int(st.own_lo[k]), int(st.own_lo[k + 1])
        if lo == hi:
            return
        b0 = st.own_b0[lo:hi]
        idx = st.own_idx[lo:hi]
        ch = st.chunks
        end = int(st.piece_start[k]) + res.got
        if res.got < st.pieces[k].nbytes:
            full = b0 + self.chunk_bytes <= end
            for i in idx[~full].tolist():
                st.failed.append(int(ch.tag[i]))
                self._short(ch, i, res)
            b0, idx = b0[full], idx[full]
        ok = self._verify(st.buf.array, b0, idx, ch)
        if not ok.all():
            st.failed.extend(ch.tag[idx[~ok]].tolist())
            b0, idx = b0[ok], idx[ok]
        if b0.shape[0]:
            self._scatter(st, b0, idx)

    def _finish_batch(self, st: StagingBatch, win, b: int, layout, failed: set[int], scatter: bool = True) -> None:
        """Wait for a batch's reads (and worker-side scatters); then, for the chunks no worker
        owned, drop those not fully read or failing their checksum and scatter the rest
        (with ``scatter=False``, only the not-fully-read check).

        A chunk spanning pieces ``k0..k1`` is fully read when pieces ``k0..k1-1`` are complete
        and piece ``k1`` got at least up to the chunk's end (vectorized over the chunks)."""
        results = st.pending.wait()
        if st.pending.callback_errors:
            raise st.pending.callback_errors[0]
        for f in st.futures:  # worker-side verify + scatter of this buffer
            f.result()
        failed.update(st.failed)
        if st.rest_idx is None or st.rest_idx.shape[0] == 0:
            return
        buf = st.buf
        ch = st.chunks
        b0, idx, k0, k1 = st.rest_b0, st.rest_idx, st.rest_k0, st.rest_k1
        got = np.fromiter((r.got for r in results), dtype=np.int64, count=len(results))
        valid_end = st.piece_start + got
        incomplete = valid_end < st.piece_end
        if incomplete.any():
            inc_cum = np.concatenate(([0], np.cumsum(incomplete)))
            # incomplete pieces among k0..k1-1, or the last piece short of the chunk's end
            short = (inc_cum[k1] - inc_cum[k0] > 0) | (valid_end[k1] < b0 + self.chunk_bytes)
            if short.any():
                for j in np.flatnonzero(short).tolist():
                    i = int(idx[j])
                    failed.add(int(ch.tag[i]))
                    ks = [k for k in range(int(k0[j]), int(k1[j]) + 1)
                          if valid_end[k] < min(int(b0[j]) + self.chunk_bytes, int(st.piece_end[k]))]
                    self._short(ch, i, results[ks[0]])
                keep = ~short
                b0, idx = b0[keep], idx[keep]
        if not scatter:  # reads-only mode: the bytes stay in staging
            return
        if self.cfg.verify_checksums and b0.shape[0] and ch.has_checksum[idx].any():
            if not self.verify_in_place:
                ok = self._verify(buf.array, b0, idx, ch)
            else:  # HBM staging: checked in place, only the mask comes back (record v2: xxh3 on a copy)
                ok = verify_chunks_device(buf.tensor, b0, idx, ch, self.chunk_bytes, self.errors,
                                          counter=self.device_verify)
            if not ok.all():
                failed.update(ch.tag[idx[~ok]].tolist())
                b0, idx = b0[ok], idx[ok]
        if not b0.shape[0]:
            return
        args = (
            buf.tensor,
            torch.from_numpy(b0),
            layout,
            torch.from_numpy(ch.page[idx]),
            torch.from_numpy(ch.layer[idx]),
        )
        if self._streams is None:
            scatter_chunks(*args, impl=self.scatter_impl)
            return
        stream = self._streams[win.index]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            scatter_chunks(*args, impl=self.scatter_impl)
            win.events[b].record(stream)

    # ------------------------------------------------------------------ lifecycle
    def forget_file(self, file_index: int) -> None:
        """Close cached handles of ``file_index`` (call after deleting or replacing that file)."""
        self._engine.forget_file(file_index)

    def close(self) -> None:
        """Stop the I/O workers, close file handles and free the staging windows. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._engine.close()
        self._scatter_pool.shutdown(wait=True)
        self.staging.close()

    def __enter__(self) -> "RestoreEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["RestoreEngine", "RestoreReport", "MIN_AUTO_STAGING_BYTES", "auto_staging_bytes"]
