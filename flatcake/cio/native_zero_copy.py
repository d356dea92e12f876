"""Zero-copy FC-CIO restores: pieces read straight into the host pool's page slots (paper §3.3).

The one-call restore (:mod:`flatcake.cio.native_restore`) reads every piece into a staging
buffer, hashes each chunk there and copies its planes into the page slots: the copy is ~0.1 s
of CPU per GB (issue 11, docs/performance.md). When every chunk's planes are contiguous bytes
in the destination (host layouts ``layer_first`` and ``page_first_direct``; ``page_first`` has
token-strided rows and keeps the staging path) and every plane's destination address and
length, the chunk size and (checked in C) every chunk's file offset are multiples of the
engine's zero-copy alignment (:attr:`~flatcake.cio.engines.PosixEngine.dio_align`: 4096; 512
works on a device without a virtual boundary but did not pay, docs/performance.md), one GIL-free
C call (:mod:`flatcake.cio.native_zero_copy_c`, ``csrc/zero_copy.c``) plans the reads with
pieces of whole chunks, reads each piece with ``preadv`` whose iovecs are the chunks' plane
slots (bridged holes go to a scratch buffer) and verifies each chunk's xxh3-64 in place with
XXH3's streaming API over its planes (python-xxhash's own ``XXH3_64bits_reset/_update/_digest``).

**A failed chunk's slots hold undefined bytes** in this mode (a short read, an I/O error or a
checksum mismatch is found after the bytes landed): its tag is reported failed exactly as on
the staging path, so its page is a miss, and SGLang never uses the slots of a page reported
missing. The staging path keeps its guarantee (a failed chunk's slots untouched). Slots of
pages not requested are never written. Anything not eligible (another layout, an unaligned
pool, chunk offset or size, overlapping chunks, an O_DIRECT refusal of the pool's memory)
takes the staging path for the whole call. Off by default (``FLATCAKE_ZERO_COPY=1`` turns it
on): since the staging windows are in huge pages the staging path is faster at the same CPU
per GB on the development machine (docs/performance.md, "The full sweep").
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import logging
import time
import weakref
from typing import Optional

import numpy as np

from flatcake.common.align import ALIGN
from flatcake.cio import engines
from flatcake.cio.plan import ChunkBatch
from flatcake.cio.native_zero_copy_c import ARGTYPES  # fc_zc_run's argument types (bound by native_restore)
from flatcake.native.loops import NativeLoop

log = logging.getLogger(__name__)
_P = ctypes.c_void_p
#: python-xxhash exports, in the order ``fc_zc_run`` reads them from its ``hfn`` array
_HASH_SYMBOLS = ("XXH3_createState", "XXH3_freeState", "XXH3_64bits_reset", "XXH3_64bits_update",
                 "XXH3_64bits_digest", "XXH3_64bits")


def hash_addresses() -> tuple[Optional[np.ndarray], str]:
    """``(int64 [6] addresses, "")`` of python-xxhash's streaming XXH3 functions and
    ``XXH3_64bits`` (:data:`_HASH_SYMBOLS` order), or ``(None, why)`` when one is not exported."""
    try:
        import xxhash._xxhash as ext

        lib = ctypes.CDLL(ext.__file__)
        return np.array([ctypes.cast(getattr(lib, s), _P).value for s in _HASH_SYMBOLS], dtype=np.int64), ""
    except (ImportError, OSError, AttributeError) as e:
        return None, f"xxhash extension does not export XXH3's streaming API ({e})"


def _build():
    """``(fn, "")``: ``fn(*args)`` calls ``fc_zc_run`` with the hash addresses first; or
    ``(None, why)`` (no C restore, no streaming XXH3)."""
    from flatcake.cio.native_restore import LOOP

    base = LOOP.wait_built()
    if base is None:
        return None, "needs the C restore, which is not in use"
    addrs, why = hash_addresses()
    if addrs is None:
        return None, why
    zc = base.zc

    def run(*a):
        return zc(addrs.ctypes.data, *a)  # the closure keeps the addresses and the library

    return run, ""


#: the zero-copy C restore: off unless ``FLATCAKE_ZERO_COPY=1`` — with huge-page staging windows
#: the staging path restores faster at the same CPU per GB (docs/performance.md, "The full sweep")
LOOP = NativeLoop(_build, "FLATCAKE_ZERO_COPY", "FC-CIO restore: staging copy for every restore (no zero copy)",
                  default_on=False, name="zero_copy")


def eligible(table, geometry, chunk_bytes: int, align: int = ALIGN) -> bool:
    """Whether a restore into this destination can read straight into the slots.

    Args:
        table: :func:`~flatcake.cio.native_restore.dst_table`'s ``(base, page stride, row
            stride)`` (int64 ``[layers, planes]`` each, bytes).
        geometry: the layout's :class:`~flatcake.common.layout.PageGeometry`.
        chunk_bytes: bytes per (page, layer) chunk.
        align: bytes: the pool device's zero-copy alignment (the engine's
            :attr:`~flatcake.cio.engines.PosixEngine.dio_align`, 4096; at 512, e.g. MLA's
            18,432-byte planes at 16-token pages would qualify).

    Returns:
        True when every plane is contiguous in its slot (row stride = row bytes) and the plane
        bases, page strides, plane lengths and ``chunk_bytes`` are multiples of ``align``.
    """
    base, s0, s1 = table
    rb = np.array(geometry.plane_row_bytes, dtype=np.int64)
    return bool((s1 == rb[None, :]).all() and not (base % align).any() and not (s0 % align).any()
                and not ((rb * geometry.page_size) % align).any() and chunk_bytes % align == 0)


class ZeroCopy:
    """Zero-copy restores of one :class:`~flatcake.cio.native_restore.NativeRestore`.

    Attributes:
        calls: restores this mode served (a real count, for tests and benchmarks).
        refused: the kernel refused a read into the pool's memory (EINVAL): off from then on.
    """

    def __init__(self, native):
        self.native = native
        self.calls = 0
        self.refused = False
        #: :func:`eligible` results by layout object (weak) and alignment value (issue 11)
        self._eligible: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        LOOP.fn()

    def eligible_cached(self, layout, align: int, check) -> bool:
        """``check()`` (a call of :func:`eligible` for ``layout``, bool) once per layout object and
        alignment value ``align`` (bytes); the chunk size is this engine's, fixed. A layout that
        takes no weak reference is checked every call."""
        got = self._eligible.get(layout)
        if got is not None and align in got:
            return got[align]
        ok = bool(check())
        try:
            self._eligible.setdefault(layout, {})[align] = ok
        except TypeError:
            pass
        return ok

    def restore(self, chunks: ChunkBatch, layout, dest) -> Optional[object]:
        """One restore read straight into the slots; returns a
        :class:`~flatcake.cio.restore.RestoreReport`, or ``None`` when the staging path must
        run the call instead (off, not eligible; nothing delivered it would not deliver again).
        ``dest``: the layout's :class:`~flatcake.cio.native_restore.DestArgs`."""
        nat, fn = self.native, LOOP.fn()
        eng, posix = nat.engine, nat.posix
        align = posix.dio_align
        if fn is None or self.refused or not len(chunks) or not self.eligible_cached(
                layout, align, lambda: eligible(dest.table, layout.geometry, eng.chunk_bytes, align)):
            return None
        from flatcake.cio.native_restore import distinct_pages
        from flatcake.cio.restore import RestoreReport

        t_wait = time.perf_counter()
        win = eng.staging.acquire()  # (not used: it bounds the restores in flight, cio.windows)
        t0 = time.perf_counter()
        try:
            files = sorted(set(chunks.file_index.tolist()))
            fds = posix.shared_fds(files)
            try:
                r, rc = self._run(fn, chunks, dest, fds)
            finally:
                posix.release_shared()
        finally:
            eng.staging.release(win)
        t1 = time.perf_counter()
        if rc != 0:
            return None
        if (r["perr"] == errno_mod.EINVAL).any() and posix.direct_io:
            self.refused = True  # the pool's memory, not the file: the staging path from now on
            log.info("FC-CIO zero copy off: O_DIRECT refused a read into the host pool (EINVAL); staging copy")
            return None
        for k, fi in enumerate(r["pfile"].tolist()):  # a file that did not open: its own errno
            if fds[fi][0] < 0:
                r["perr"][k] = fds[fi][1]
        failed = nat.failures(self._failure_view(r), chunks)
        self.calls += 1
        n, nread = len(chunks), r["bytes_read"]
        pages = distinct_pages(chunks.page, dest.table[0].shape[0])
        return RestoreReport(failed_tags=frozenset(failed), pages=pages, chunks=n,
                             merged_reads=r["reads"], bytes_read=nread,
                             bytes_over_read=max(0, nread - n * eng.chunk_bytes), read_s=t1 - t0,
                             engine=eng.engine_name, wait_s=t0 - t_wait, batches=0, io_requests=r["np"])

    def _run(self, fn, chunks: ChunkBatch, dest, fds: dict) -> tuple[dict, int]:
        """The C call: arrays in, ``(arrays out, return code)``; ``dest``: the layout's
        :class:`~flatcake.cio.native_restore.DestArgs`."""
        from flatcake.cio.native_restore import CPU_THREADS

        eng, n = self.native.engine, len(chunks)
        fdmap = np.full(max(fds) + 1, -1, dtype=np.int64)
        for fi, (fd, _) in fds.items():
            fdmap[fi] = fd
        w = np.empty(8 * n + 5, dtype=np.int64)
        r = {k: w[i * n: (i + 1) * n] for i, k in enumerate(("ord", "pfd", "pfile", "poff", "plen", "pgot", "perr"))}
        r["plo"], out, r["cstatus"] = w[7 * n: 8 * n + 1], w[8 * n + 1:], np.empty(n, dtype=np.uint8)
        wa = w.ctypes.data  # the word arrays' addresses by arithmetic: one lookup
        cols = [np.ascontiguousarray(x) for x in (chunks.file_index, chunks.offset, chunks.tag, chunks.page,
                                                   chunks.layer, chunks.checksum, chunks.has_checksum)]
        cfg = eng.cfg
        rc = fn(int(self.native.posix.direct_io), max(1, cfg.io_workers), CPU_THREADS,
                int(cfg.thread_policy == "idle"), n, *(c.ctypes.data for c in cols), int(bool(cfg.verify_checksums)),
                fdmap.ctypes.data, fdmap.shape[0], eng.chunk_bytes, cfg.gap_bytes, eng.max_io_bytes,
                self.native.posix.dio_align,
                cfg.io_workers, engines.MIN_PIECE_BYTES, dest.planes, dest.page_size, *dest.addrs[:4],
                *(wa + 8 * i * n for i in range(5)), wa + 56 * n, wa + 40 * n, wa + 48 * n,  # ord..plen plo pgot perr
                r["cstatus"].ctypes.data, wa + 8 * (8 * n + 1))
        if rc != 0:
            return r, int(rc)
        npc = int(out[0])
        for k in ("pfd", "pfile", "poff", "plen", "pgot", "perr"):
            r[k] = r[k][:npc]
        r["plo"] = r["plo"][:npc + 1]
        r.update(np=npc, reads=int(out[1]), bytes_read=int(out[2]))
        self.native.idle_threads = int(out[3])
        return r, 0

    @staticmethod
    def _failure_view(r: dict) -> dict:
        """``r`` as :meth:`NativeRestore.failures` reads it: chunk ``c`` is chunk ``c`` of the
        call (``cidx``), read by piece ``ck0[c] == ck1[c]`` (computed only when one failed)."""
        n = r["cstatus"].shape[0]
        v = {"perr": r["perr"], "pfile": r["pfile"], "poff": r["poff"], "pgot": r["pgot"], "cstatus": r["cstatus"],
             "cidx": None}
        if r["cstatus"].tobytes().count(0) == n:
            return v
        pos = np.empty(n, dtype=np.int64)
        pos[r["ord"]] = np.arange(n, dtype=np.int64)
        ck = np.searchsorted(r["plo"], pos, side="right") - 1
        v.update(cidx=np.arange(n, dtype=np.int64), ck0=ck, ck1=ck)
        return v


__all__ = ["LOOP", "ZeroCopy", "eligible", "hash_addresses"]
