"""A whole FC-CIO restore in one GIL-free call (paper §3.3; issue 11, docs/performance.md).

The Python pipeline of :class:`~flatcake.cio.restore.RestoreEngine` gives the GIL up and takes
it back a few times per 8 MiB I/O piece: the I/O worker wakes from its queue, returns from
``preadv``, hands the piece to the scatter pool, whose thread wakes, returns from the xxh3 call
and from each plane copy, and the caller wakes to collect each batch. Next to a thread burning
Python CPU (SGLang's scheduler loop) each take-back can wait a whole switch interval
(``sys.getswitchinterval()``, 5 ms), so a 256 MiB restore that made ~270 such steps ran at a
fifth of its speed. Here the plan is one C call that keeps the GIL (~0.1 ms for 2,048 chunks;
:mod:`flatcake.cio.native_plan_c`, no numpy pass over the chunks), and then one :mod:`ctypes`
call (which releases the GIL) reads every piece from ``io_workers`` POSIX threads into the
window's two staging buffers, verifies each chunk's xxh3-64 and copies its planes into the
page slots (:mod:`flatcake.cio.native_restore_c`): one GIL hand-off per call. The C is
``csrc/plan.c`` and ``csrc/restore.c``, built into FlatCake's extension at install
(:mod:`flatcake.native.loops`).

Same guarantees as the Python pipeline: a chunk is copied only if every byte of it was read by
this call and, when it carries a checksum and ``cio.verify_checksums`` is on, its xxh3-64 (the
python-xxhash library's own ``XXH3_64bits``) matches; a failed chunk's slots are untouched and
its tag reported; I/O errors are logged once with their errno. Used for the POSIX engine on
host staging with host layouts whose token rows are contiguous; anything else (kvikio, CUDA
staging, reads-only mode, an O_DIRECT refusal at read time, an extension not built,
``FLATCAKE_NATIVE_RESTORE=0``) takes the Python pipeline; the loop's state is reported
(:func:`flatcake.native.loops.report`). Where every
chunk's planes are contiguous and aligned in the slots (``layer_first``, ``page_first_direct``), the call reads
straight into them instead (:mod:`flatcake.cio.native_zero_copy`; ``FLATCAKE_ZERO_COPY=0``:
this staging path), where a failed chunk's slots hold undefined bytes.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import os
import time
import weakref
from typing import Optional

import numpy as np

from flatcake.cio.batch import StagingBatch
from flatcake.common.align import ALIGN
from flatcake.cio import engines
from flatcake.cio.native_plan_c import ARGTYPES as PLAN_ARGTYPES
from flatcake.cio.native_restore_c import ARGTYPES as RUN_ARGTYPES
from flatcake.cio.native_zero_copy import ARGTYPES as ZC_ARGTYPES, ZeroCopy
from flatcake.cio.plan import ChunkBatch, batch_reads, plan_reads
from flatcake.cio.xxh3_bulk import xxh3_address
from flatcake.native.loops import NativeLoop, entry, warm_up_all

_I64 = ctypes.c_int64

#: threads of one restore that verify and copy at once: all cores but one, so SGLang's
#: scheduler thread finds a free core (the other threads keep reading meanwhile)
CPU_THREADS = max(1, (os.cpu_count() or 2) - 1)
#: copies into the host pool by streaming (non-temporal) stores on x86-64 (the C source's
#: ``copy_rows``); ``FLATCAKE_STREAMING_STORES=0``: ``memcpy`` (for A/B measurements)
STREAMING_STORES = os.environ.get("FLATCAKE_STREAMING_STORES", "1") != "0"
_P = ctypes.c_void_p


def _build():
    """``(fn, "")`` with ``fn(*args)`` the bound ``fc_restore_run`` (xxh3 address first),
    ``fn.plan(*args)`` the bound ``fc_restore_plan`` and ``fn.zc`` the bound ``fc_zc_run``
    (``csrc/restore.c``, ``plan.c``, ``zero_copy.c``), or ``(None, why)``."""
    addr, why = xxh3_address()
    if addr is None:
        return None, why
    fn, why = entry("fc_restore_run", RUN_ARGTYPES, _I64)
    plan_c, why_plan = entry("fc_restore_plan", PLAN_ARGTYPES, _I64)
    zc, why_zc = entry("fc_zc_run", ZC_ARGTYPES, _I64)  # the zero-copy restore (flatcake.cio.native_zero_copy)
    if fn is None or plan_c is None or zc is None:
        return None, why or why_plan or why_zc
    # the plan (~0.1 ms for 2,048 chunks) keeps the GIL: giving it up next to a thread burning
    # Python CPU could cost a 5 ms switch interval to get back
    plan = ctypes.PYFUNCTYPE(_I64, *PLAN_ARGTYPES)(ctypes.cast(plan_c, _P).value)

    def run(*a):
        return fn(addr, *a)

    run.plan, run.zc = plan, zc
    return run, ""


#: the C restore (``FLATCAKE_NATIVE_RESTORE=0`` turns it off)
LOOP = NativeLoop(_build, "FLATCAKE_NATIVE_RESTORE", "FC-CIO restore: Python pipeline (per-piece threads)",
                  name="restore")


def _build_plan():
    """The restore's plan (``fc_restore_plan``, bound with the restore), or ``(None, why)``."""
    run = LOOP.wait_built()
    if run is None:
        return None, "bound with the C restore, which is not in use"
    return run.plan, ""


#: the plan's state in :func:`flatcake.native.loops.report` (bound with :data:`LOOP`;
#: :meth:`NativeRestore.plan_arrays` calls it through ``LOOP.fn().plan``)
PLAN = NativeLoop(_build_plan, "FLATCAKE_NATIVE_RESTORE", "FC-CIO restore plan: Python (with the Python pipeline)",
                  name="plan")


def _a(x: np.ndarray) -> int:
    return x.ctypes.data


#: :func:`dst_table` of each live layout (a layout's plane views never change:
#: ``KvPageLayout.layer_planes`` keeps them), so a restore does not recompute it (issue 11)
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def dst_table(layout) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per (layer, plane) destination of a CPU layout: base address, page stride and token-row
    stride in bytes (int64 ``[layers, planes]`` each, read-only), or ``None`` when a plane's rows
    are not contiguous bytes (then the Python pipeline copies). Computed once per layout object."""
    return _per_layout(_TABLES, layout, _dst_table)


def _per_layout(cache: weakref.WeakKeyDictionary, layout, build):
    """``build(layout)`` once per live layout object (``cache`` holds it, ``None`` included);
    a layout that takes no weak reference gets it built on each call."""
    got = cache.get(layout, cache)
    if got is not cache:
        return got
    value = build(layout)
    try:
        cache[layout] = value
    except TypeError:
        pass
    return value


def _dst_table(layout) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    table = _dst_rows(layout)
    for t in table or ():
        t.flags.writeable = False  # shared by every restore into this layout
    return table


def _dst_rows(layout) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    g = layout.geometry
    L, J = g.layers, len(g.plane_row_bytes)
    base, s0, s1 = (np.empty((L, J), dtype=np.int64) for _ in range(3))
    for layer in range(L):
        for q, (t, rb) in enumerate(zip(layout.layer_planes(layer), g.plane_row_bytes)):
            if t.device.type != "cpu" or t.dim() != 3 or t.stride(2) != 1 or t.shape[2] != rb:
                return None
            base[layer, q], s0[layer, q], s1[layer, q] = t.data_ptr(), t.stride(0), t.stride(1)
    return base, s0, s1


#: :class:`DestArgs` of each live layout (built with its :func:`dst_table`; issue 11)
_DESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class DestArgs:
    """A CPU layout's destination as the C restores take it, built once per layout object.

    Attributes:
        table: :func:`dst_table` (int64 ``[layers, planes]`` base address, page stride, row stride, bytes).
        plane_off: int64 ``[planes]`` byte offset of each plane in a chunk (``plane_offsets()``).
        plane_rb: int64 ``[planes]`` bytes per token row of each plane (``plane_row_bytes``).
        addrs: addresses of ``plane_off``, ``plane_rb`` and the three table arrays (ints, in that order).
        planes, page_size: planes per layer, tokens per page.
    """

    __slots__ = ("table", "plane_off", "plane_rb", "addrs", "planes", "page_size", "__weakref__")

    def __init__(self, layout, table):
        g = layout.geometry
        self.table = tuple(np.ascontiguousarray(t) for t in table)
        self.plane_off = np.array(g.plane_offsets(), dtype=np.int64)
        self.plane_rb = np.array(g.plane_row_bytes, dtype=np.int64)
        for x in (self.plane_off, self.plane_rb):
            x.flags.writeable = False
        self.addrs = tuple(_a(x) for x in (self.plane_off, self.plane_rb) + self.table)
        self.planes, self.page_size = int(self.table[0].shape[1]), int(g.page_size)


def dest_args(layout) -> Optional[DestArgs]:
    """The layout's :class:`DestArgs` (``None`` where :func:`dst_table` is ``None``: the Python
    pipeline copies), computed once per layout object (paper §3.3, FC-CIO; issue 11)."""
    def build(lay):
        table = dst_table(lay)
        return None if table is None else DestArgs(lay, table)

    return _per_layout(_DESTS, layout, build)


def distinct_pages(page: np.ndarray, layers: int) -> int:
    """Number of distinct entries of ``page`` (int64 ``[n]`` page numbers): the
    ``RestoreReport.pages`` of a restore. Exact; where ``page`` is its first ``n / layers``
    entries repeated ``layers`` times (the layer-major batch ``ReadPath.chunk_batch`` builds),
    only those are counted, after one byte comparison of the whole array (GIL held throughout)."""
    n = page.shape[0]
    if layers > 1 and n % layers == 0:
        k = n // layers  # page[i] == page[i - k] for every i >= k: the first k entries repeated
        if page[k:].tobytes() == page[:-k].tobytes():
            return len(set(page[:k].tolist()))
    return len(set(page.tolist()))


_PIECE_KEYS = ("pfile", "poff", "plen", "paddr", "pbatch", "pgot", "perr")
_BATCH_KEYS = ("rest_lo", "rest_hi", "bbase", "left")
_CHUNK_KEYS = ("cb0", "ck0", "ck1", "cidx")
_LAYOUTS: dict = {}


def _word_layout(n: int, mp: int) -> tuple[dict, int]:
    """Start (in int64 words) of each array of :meth:`NativeRestore.plan_arrays` in its one
    allocation, and the total words, for ``n`` chunks and at most ``mp`` pieces (memoized)."""
    got = _LAYOUTS.get((n, mp))
    if got is None:
        sizes = [(k, mp) for k in _PIECE_KEYS] + [("own_lo", mp + 1)] + \
            [(k, n) for k in _BATCH_KEYS + _CHUNK_KEYS] + [("out", 8)]
        starts, at = {}, 0
        for k, size in sizes:
            starts[k], at = at, at + size
        got = _LAYOUTS[(n, mp)] = (starts, at)
        if len(_LAYOUTS) > 64:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
    return got


class NativeRestore:
    """Runs :meth:`RestoreEngine.restore` calls as one C call each (see the module docstring).

    Args:
        engine: the :class:`~flatcake.cio.restore.RestoreEngine` (config, staging, errors).
        posix: its :class:`~flatcake.cio.engines.PosixEngine` (shared read descriptors).
    """

    def __init__(self, engine, posix):
        self.engine = engine
        self.posix = posix
        # every C loop bound from the extension here (start-up), so each one's state is logged now
        warm_up_all()
        LOOP.fn()
        #: threads of the last call that ran in Linux's SCHED_IDLE class (``cio.thread_policy``)
        self.idle_threads = 0
        #: restores read straight into the slots (``zero_copy.calls``; :mod:`flatcake.cio.native_zero_copy`)
        self.zero_copy = ZeroCopy(self)

    def restore(self, chunks: ChunkBatch, layout):
        """One restore call (arguments already checked); returns a
        :class:`~flatcake.cio.restore.RestoreReport`, or ``None`` when this call must take the
        Python pipeline (nothing was delivered that it would not deliver again, bit for bit)."""
        from flatcake.cio.restore import RestoreReport

        eng, fn = self.engine, LOOP.fn()
        dest = dest_args(layout) if fn is not None else None
        if dest is None or chunks.nbytes != eng.chunk_bytes or eng.cfg.gap_bytes < 0 or eng.max_io_bytes < ALIGN:
            return None  # (the Python plan raises where these are errors)
        rep = self.zero_copy.restore(chunks, layout, dest)
        if rep is not None:
            return rep
        t_wait = time.perf_counter()
        win = eng.staging.acquire()
        t0 = time.perf_counter()
        refused = False
        try:
            run = self.plan_arrays(chunks, [b.tensor.data_ptr() for b in win.buffers[:2]])
            if run is None:
                return None
            pfile, a = run["pfile"].tolist(), run["addr"]
            fds = self.posix.shared_fds(sorted(set(pfile)))
            try:
                pfd = np.array([fds[fi][0] for fi in pfile], dtype=np.int64)
                nthreads = max(1, min(eng.cfg.io_workers, len(pfd)))
                self.idle_threads = fn(int(self.posix.direct_io), nthreads, CPU_THREADS, len(pfd), _a(pfd),
                   *(a[k] for k in ("poff", "plen", "paddr", "pbatch", "pgot", "perr")), run["nb"],
                   *(a[k] for k in ("own_lo", "rest_lo", "rest_hi", "cb0", "bbase", "ck0", "ck1", "cidx")),
                   *(_a(np.ascontiguousarray(x)) for x in (chunks.page, chunks.layer, chunks.checksum,
                                                           chunks.has_checksum)),
                   int(bool(eng.cfg.verify_checksums)), eng.chunk_bytes, dest.planes, dest.page_size, *dest.addrs,
                   *(a[k] for k in ("cstatus", "left", "done")), int(eng.cfg.thread_policy == "idle"),
                   int(STREAMING_STORES))
                refused = self.posix.direct_io and _holds(run["perr"], errno_mod.EINVAL)
            finally:
                self.posix.release_shared(refuse_direct=refused)
        finally:
            eng.staging.release(win)
        t1 = time.perf_counter()
        if refused:  # O_DIRECT refused at read time: buffered from now on; this call again in Python
            return None
        for k, fi in enumerate(pfile):  # a file that did not open: its own errno
            if fds[fi][0] < 0:
                run["perr"][k] = fds[fi][1]
        failed = self.failures(run, chunks)
        n, nread = len(chunks), run["bytes_read"]
        return RestoreReport(failed_tags=frozenset(failed), pages=distinct_pages(chunks.page, dest.table[0].shape[0]),
                             chunks=n, merged_reads=run["reads"], bytes_read=nread,
                             bytes_over_read=max(0, nread - n * eng.chunk_bytes), read_s=t1 - t0,
                             engine=eng.engine_name, wait_s=t0 - t_wait, batches=run["nb"], io_requests=len(pfd))

    def plan_arrays(self, chunks: ChunkBatch, bufs: list) -> Optional[dict]:
        """The C call's arrays, planned in one GIL-free C call (:mod:`flatcake.cio.native_plan_c`):
        pieces in order (``pfile``, ``poff``, ``plen`` bytes, ``paddr`` addresses, ``pbatch``),
        then chunks (every batch's owned chunks grouped by piece, then every batch's straddling
        chunks) as buffer offsets ``cb0`` and positions ``cidx`` in ``chunks``, plus ``nb``
        batches, ``reads`` merged reads, ``bytes_read`` and ``addr`` (each array's address, ints,
        by name). The same arrays, in the same order,
        as :meth:`reference_arrays` builds from the Python plan. ``bufs``: the window's two
        staging buffer addresses. ``None`` when the plan refuses (a bad descriptor, a read
        longer than the staging buffer: the Python pipeline raises)."""
        eng, n = self.engine, len(chunks)
        mp = n * max(1, eng.cfg.io_workers)  # pieces at most (batches: n at most)
        # two np.empty: np.zeros of more than 1 KiB gives the GIL up (calloc); the C plan fills
        # every entry that is read, the rest is zeroed below over the actual sizes; each array is
        # sliced once, to its final size
        starts, total = _word_layout(n, mp)
        words, u8 = np.empty(total, dtype=np.int64), np.empty(2 * n, dtype=np.uint8)
        wa, ua = _a(words), _a(u8)  # addresses by arithmetic: one _a per allocation
        addr = {k: wa + 8 * at for k, at in starts.items()}
        addr["cstatus"], addr["done"] = ua, ua + n
        rc = LOOP.fn().plan(n, *(_a(x) for x in (chunks.file_index, chunks.offset, chunks.tag, chunks.layer)),
                            eng.chunk_bytes, eng.cfg.gap_bytes, eng.max_io_bytes, ALIGN, eng.staging_bytes,
                            eng.cfg.io_workers, engines.MIN_PIECE_BYTES, bufs[0], bufs[1],
                            *(addr[k] for k in ("pfile", "poff", "plen", "paddr", "pbatch", "own_lo", "rest_lo",
                                                "rest_hi", "cb0", "bbase", "ck0", "ck1", "cidx", "left", "cstatus")),
                            addr["out"])
        if rc != 0:
            return None
        npc, nb, reads, nread = words[starts["out"]: starts["out"] + 4].tolist()
        r = {k: words[starts[k]: starts[k] + size] for k, size in
             [(k, npc) for k in _PIECE_KEYS] + [("own_lo", npc + 1)] + [(k, nb) for k in _BATCH_KEYS] +
             [(k, n) for k in _CHUNK_KEYS]}
        r["cstatus"], r["done"] = u8[:n], u8[n: n + nb]
        r["pgot"][:], r["perr"][:], r["done"][:] = 0, 0, 0
        r.update(nb=nb, reads=reads, bytes_read=nread, addr=addr)
        return r

    def reference_arrays(self, chunks: ChunkBatch, bufs: list, layout) -> dict:
        """The arrays of :meth:`plan_arrays` from the Python plan (:func:`plan_reads`,
        :func:`batch_reads`, :meth:`StagingBatch.build`): the meaning of the C plan, for tests.
        ``bufs``: staging buffers (``.tensor``) of the window."""
        eng = self.engine
        plan = plan_reads(chunks, gap_bytes=eng.cfg.gap_bytes, max_io_bytes=eng.max_io_bytes)
        batches = batch_reads(plan.reads, eng.staging_bytes)
        sts = [StagingBatch.build(b, bufs[i % 2], layout, eng.chunk_bytes, eng.cfg.io_workers, owned=True)
               for i, b in enumerate(batches)]
        r = _reference(sts)
        r.update(nb=len(sts), reads=len(plan.reads), bytes_read=plan.bytes_read)
        return r

    def failures(self, run: dict, chunks: ChunkBatch) -> list[int]:
        """Tags of the chunks not delivered; each I/O error, short chunk and checksum mismatch
        reported to the error-once log (loops only over failures). ``run``: piece arrays
        ``perr``, ``pfile``, ``poff``, ``pgot``; chunk arrays ``cstatus``, ``cidx`` (position in
        ``chunks``), ``ck0``/``ck1`` (first and last piece holding it)."""
        eng = self.engine
        perr = run["perr"]
        for k in _positive(perr):
            e = int(perr[k])
            path = self.posix.path_of(int(run["pfile"][k]))
            eng.errors.report("read", errno_mod.errorcode.get(e, str(e)),
                              f"{path} @ {int(run['poff'][k]) + int(run['pgot'][k])}: {e}")
        st, idx = run["cstatus"], run["cidx"]
        if st.tobytes().count(0) == st.shape[0]:  # (np.flatnonzero over every chunk gives the GIL up)
            return []
        bad = np.flatnonzero(st != 0)
        if not bad.shape[0]:
            return []
        for c in bad.tolist():
            i = int(idx[c])
            if st[c] == 2:
                eng.errors.report("verify", "checksum", f"chunk tag {int(chunks.tag[i])} (file "
                                  f"{int(chunks.file_index[i])} @ {int(chunks.offset[i])})")
            elif (run["perr"][int(run["ck0"][c]): int(run["ck1"][c]) + 1] == -1).any():
                eng.errors.report("read", "short read", f"file {int(chunks.file_index[i])} ends before byte "
                                  f"{int(chunks.offset[i]) + eng.chunk_bytes} (chunk tag {int(chunks.tag[i])})")
        return chunks.tag[idx[bad]].tolist()


def _holds(a: np.ndarray, v: int) -> bool:
    """Whether ``a`` (int64 ``[n]``, one entry per piece) holds ``v``: through a list where
    short (a few pieces: one call instead of two numpy ones)."""
    if a.shape[0] <= 64:
        return v in a.tolist()
    return bool((a == v).any())


def _positive(a: np.ndarray) -> list[int]:
    """Positions of the entries > 0 of ``a`` (int64 ``[n]``), through a list where short."""
    if a.shape[0] <= 64:
        return [k for k, e in enumerate(a.tolist()) if e > 0]
    return np.flatnonzero(a > 0).tolist()


def _reference(sts: list) -> dict:
    """Arrays of :meth:`NativeRestore.plan_arrays` from built :class:`StagingBatch` es."""
    pieces = [p for st in sts for p in st.pieces]
    npc = [len(st.pieces) for st in sts]
    r = {"pfile": np.fromiter((p.file_index for p in pieces), np.int64, len(pieces)),
         "poff": np.fromiter((p.offset for p in pieces), np.int64, len(pieces)),
         "plen": np.fromiter((p.nbytes for p in pieces), np.int64, len(pieces)),
         "pbatch": np.repeat(np.arange(len(sts), dtype=np.int64), npc),
         "bbase": np.array([st.buf.tensor.data_ptr() for st in sts], dtype=np.int64),
         "left": np.array(npc, dtype=np.int64)}
    r["paddr"] = np.repeat(r["bbase"], npc) + np.concatenate([st.piece_start for st in sts])
    kb = np.cumsum([0] + npc)
    own_lo, n_own, n_rest, rest = [], 0, [], []
    for b, st in enumerate(sts):
        own_lo.append(st.own_lo[:-1] + n_own)
        n_own += st.own_idx.shape[0]
        n_rest.append(0 if st.rest_idx is None else st.rest_idx.shape[0])
        if n_rest[-1]:
            rest.append((st.rest_b0, st.rest_idx, st.rest_k0 + kb[b], st.rest_k1 + kb[b]))
    r["own_lo"] = np.concatenate(own_lo + [np.array([n_own], dtype=np.int64)]).astype(np.int64)
    own_k = np.repeat(np.arange(len(pieces), dtype=np.int64), np.diff(r["own_lo"]))
    r["rest_lo"] = n_own + np.cumsum([0] + n_rest[:-1]).astype(np.int64)
    r["rest_hi"] = r["rest_lo"] + np.array(n_rest, dtype=np.int64)
    r["cb0"] = np.concatenate([st.own_b0 for st in sts] + [x[0] for x in rest]).astype(np.int64, copy=False)
    r["cidx"] = np.concatenate([st.own_idx for st in sts] + [x[1] for x in rest]).astype(np.int64, copy=False)
    r["ck0"] = np.concatenate([own_k] + [x[2] for x in rest])
    r["ck1"] = np.concatenate([own_k] + [x[3] for x in rest])
    return r


__all__ = ["LOOP", "PLAN", "DestArgs", "NativeRestore", "dest_args", "distinct_pages", "dst_table"]
