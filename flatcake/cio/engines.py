"""I/O back-ends of FC-CIO (paper §3.3): the engine interface and the POSIX ``preadv`` workers
(the kvikio/cuFile engine and the start-up engine probe are in :mod:`flatcake.cio.kvikio_engine`).

Engines take *pieces* (aligned sub-ranges of merged reads, each bound for an offset in a staging
buffer), spread them round-robin over ``io_workers`` workers, and return a
:class:`PendingIo` whose :meth:`PendingIo.wait` yields one :class:`PieceResult` per piece:
how many bytes landed (``got``) and, if the read stopped early, why (``error``). They never
raise for I/O faults: EIO, a missing file or EOF before the end become a short ``got``. Errors
are logged once per kind; EOF is not logged here (the 4 KiB-aligned tail of the last read of a
file may pass its end harmlessly), the restore logs it when a chunk actually misses bytes.

* :class:`PosixEngine` — one thread per worker, each with its own file descriptors (cached per
  file index; FlatCake's SSD files are fixed-size and reused, never renamed), ``os.preadv``
  into the page-aligned host staging buffer, O_DIRECT when asked. A filesystem that refuses
  O_DIRECT (``EINVAL`` at open or read) switches the engine to buffered reads with one log line.
  ``os.preadv`` releases the GIL, so the threads overlap on the device.
"""

from __future__ import annotations

import errno as errno_mod
import itertools
import logging
import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from flatcake.common.align import ALIGN, align_up
from flatcake.cio.staging import StagingBuffer
from flatcake.common.errorlog import ErrorLog, reason_of

log = logging.getLogger(__name__)

#: Smallest piece a merged read is cut into for worker parallelism (bytes). Large pieces mean
#: fewer worker wake-ups between requests: restoring 1 GiB of layer-major extents with reads
#: only (no scatter) ran at a median 1.43 GB/s with 1 MiB pieces and 1.67 GB/s with 8 MiB
#: pieces on the dev machine (3 interleaved runs each).
MIN_PIECE_BYTES = 8 << 20


class EngineUnavailableError(RuntimeError):
    """The requested I/O engine cannot move bytes on this machine (raised at start-up)."""


@dataclass(frozen=True, slots=True)
class IoPiece:
    """One read request handed to a worker.

    Attributes:
        file_index: SSD pool file number.
        offset: byte offset in the file (4 KiB aligned when planned with the default alignment).
        nbytes: bytes to read.
        buf_offset: byte offset in the staging buffer where the bytes land.
    """

    file_index: int
    offset: int
    nbytes: int
    buf_offset: int


@dataclass(slots=True)
class PieceResult:
    """Outcome of one :class:`IoPiece`.

    Attributes:
        got: bytes that landed, counted from the piece's start (``< nbytes`` means short).
        error: ``None`` when complete, else a short reason (``"EOF"``, ``"EIO"``, ``"ENOENT"`` …).
    """

    got: int = 0
    error: Optional[str] = None


class _Latch:
    """Countdown latch: :meth:`wait` returns once :meth:`count_down` ran ``n`` times."""

    def __init__(self, n: int):
        self._n = n
        self._cv = threading.Condition()

    def count_down(self) -> None:
        with self._cv:
            self._n -= 1
            if self._n <= 0:
                self._cv.notify_all()

    def wait(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._n <= 0)


class PendingIo:
    """Reads in flight for one staging buffer; :meth:`wait` blocks until all pieces ended."""

    def __init__(
        self,
        n: int,
        waiter: Optional[Callable[["PendingIo"], None]] = None,
        on_piece: Optional[Callable[[int, PieceResult], None]] = None,
    ):
        self.results: list[PieceResult] = [PieceResult() for _ in range(n)]
        self._latch = _Latch(n)
        self._waiter = waiter
        self.on_piece = on_piece
        self.callback_errors: list[BaseException] = []

    def run_callback(self, i: int) -> None:
        """Run ``on_piece(i, result)``; an exception is kept for :meth:`wait`'s caller."""
        if self.on_piece is None:
            return
        try:
            self.on_piece(i, self.results[i])
        except BaseException as e:  # noqa: BLE001 - surfaced by the restore, never lost
            self.callback_errors.append(e)

    def piece_done(self, i: int) -> None:
        """Engine side: piece ``i`` ended (its result is set): run its callback, count it down."""
        self.run_callback(i)
        self._latch.count_down()

    def wait(self) -> list[PieceResult]:
        """Block until every piece finished (and its ``on_piece`` callback ran); returns the
        results in submission order."""
        if self._waiter is not None:
            waiter, self._waiter = self._waiter, None
            try:
                waiter(self)
            finally:
                self._latch = _Latch(0)  # collected: later waits return at once
        else:
            self._latch.wait()
        return self.results


def split_pieces(file_index: int, offset: int, nbytes: int, buf_offset: int, workers: int) -> list[IoPiece]:
    """Cut one merged read into at most ``workers`` aligned pieces of at least
    :data:`MIN_PIECE_BYTES` (read at call time).

    A single merged read (e.g. several layers' extents) would otherwise keep one worker busy
    while the others idle; a few large pieces in flight keep the SSD's queue full, as kvikio's
    ``task_size`` does. Returns one piece when the read is small.
    """
    n = max(1, min(workers, nbytes // MIN_PIECE_BYTES))
    step = align_up(-(-nbytes // n))
    out, done = [], 0
    while done < nbytes:
        k = min(step, nbytes - done)
        out.append(IoPiece(file_index, offset + done, k, buf_offset + done))
        done += k
    return out


class IoEngine:
    """Interface of an FC-CIO back-end.

    Attributes:
        name: ``"posix"`` or ``"kvikio"``.
        direct_io: whether reads bypass the page cache (O_DIRECT / GDS).
    """

    name = "base"
    direct_io = False

    def submit(
        self, pieces: Sequence[IoPiece], buf: StagingBuffer,
        on_piece: Optional[Callable[[int, PieceResult], None]] = None,
    ) -> PendingIo:  # pragma: no cover
        """Start reading ``pieces`` into ``buf``; returns at once. ``on_piece(i, result)`` runs
        once piece ``i`` ended (in a worker thread where the engine has them), before
        :meth:`PendingIo.wait` returns."""
        raise NotImplementedError

    def forget_file(self, file_index: int) -> None:  # pragma: no cover
        """Drop cached handles of ``file_index`` (after the file is deleted or replaced)."""
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover
        """Stop workers and close every handle."""
        raise NotImplementedError


class PosixEngine(IoEngine):
    """``os.preadv`` from ``workers`` threads into host staging memory (O_DIRECT when asked).

    Args:
        path_of: maps a file index to its path.
        workers: worker threads, each with its own fd cache.
        direct_io: open with ``O_DIRECT`` (buffers, offsets, lengths must be 4 KiB aligned).
        errors: shared :class:`ErrorLog`.

    Attributes:
        dio_align: bytes: the alignment zero-copy restores need of the host pool's memory and
            of file offsets (:mod:`flatcake.cio.native_zero_copy`): :data:`ALIGN`. A device
            without a virtual boundary takes 512 (:func:`~flatcake.media.directio.dio_alignment`
            says so), but there 1 KiB iovecs read 0.31 GB/s against the staging path's 1.01 and
            18 KiB ones gained no throughput (docs/performance.md, "Zero copy at the device's
            alignment"), so the probe's answer is not used. Tests set it per class.
    """

    name = "posix"
    dio_align: int = ALIGN

    def __init__(self, path_of: Callable[[int], str], workers: int, *, direct_io: bool, errors: ErrorLog):
        self._path_of = path_of
        self.direct_io = bool(direct_io) and hasattr(os, "O_DIRECT")
        self._errors = errors
        self._fallback_lock = threading.Lock()
        self._rr = itertools.count()
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(workers)]
        self._fds: list[dict[int, int]] = [{} for _ in range(workers)]
        self._forget: list[set[int]] = [set() for _ in range(workers)]
        self._forget_lock = threading.Lock()
        self._shared: dict[int, int] = {}  # fds of the one-call restore (flatcake.cio.native_restore)
        self._shared_stale: list[int] = []
        self._shared_users = 0
        self._threads = [
            threading.Thread(target=self._run, args=(w,), name=f"fc-cio-io{w}", daemon=True)
            for w in range(workers)
        ]
        for t in self._threads:
            t.start()

    # -- worker side -------------------------------------------------------------------------
    def _disable_direct(self, path: str, e: OSError) -> None:
        with self._fallback_lock:
            if self.direct_io:
                self.direct_io = False
                log.warning(
                    "FC-CIO: O_DIRECT refused on %s (%s); falling back to buffered reads",
                    os.path.dirname(path) or path,
                    reason_of(e),
                )

    def _open_fd(self, file_index: int) -> int:
        """Open ``file_index`` for reading (O_DIRECT while it is on; EINVAL there turns it off)."""
        fd = None
        path = self._path_of(file_index)
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        if self.direct_io:
            try:
                fd = os.open(path, flags | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno_mod.EINVAL:
                    raise
                self._disable_direct(path, e)
        if fd is None:
            fd = os.open(path, flags)
        return fd

    def _open(self, w: int, file_index: int) -> int:
        fds = self._fds[w]
        fd = fds.get(file_index)
        if fd is None:
            fd = fds[file_index] = self._open_fd(file_index)
        return fd

    def _drop(self, w: int, file_index: int) -> None:
        fd = self._fds[w].pop(file_index, None)
        if fd is not None:
            os.close(fd)

    def _read_piece(self, w: int, p: IoPiece, view) -> PieceResult:
        """Read ``p`` into ``view``, looping over short reads until complete, EOF or an error."""
        res = PieceResult()
        retried = False
        while res.got < p.nbytes:
            want = p.nbytes - res.got
            try:
                fd = self._open(w, p.file_index)
                k = os.preadv(fd, [view[res.got :]], p.offset + res.got)
            except OSError as e:
                if e.errno == errno_mod.EINVAL and res.got == 0 and not retried:
                    # O_DIRECT accepted at open but the read is refused: reopen buffered, once
                    retried = True
                    if self.direct_io:
                        self._disable_direct(self._path_of(p.file_index), e)
                    self._drop(w, p.file_index)
                    continue
                res.error = reason_of(e)
                self._errors.report("read", res.error, f"{self._path_of(p.file_index)} @ {p.offset + res.got}: {e}")
                return res
            if k == 0:
                break
            res.got += k
            if k < want and k % ALIGN and self.direct_io:
                break  # an unaligned short count only happens at EOF (and O_DIRECT cannot go on)
        if res.got < p.nbytes:
            res.error = "EOF"  # not logged here: the aligned tail of a read may pass EOF harmlessly
        return res

    def _run(self, w: int) -> None:
        q = self._queues[w]
        while True:
            job = q.get()
            if job is None:
                break
            piece, buf, pending, i = job
            if self._forget[w]:
                with self._forget_lock:
                    stale, self._forget[w] = self._forget[w], set()
                for fi in stale:
                    self._drop(w, fi)
            try:
                pending.results[i] = self._read_piece(w, piece, buf.host_view(piece.buf_offset, piece.nbytes))
            except Exception as e:  # noqa: BLE001 - a worker never dies; the piece fails
                pending.results[i] = PieceResult(0, reason_of(e))
                self._errors.report("read", reason_of(e), repr(e))
            finally:
                pending.piece_done(i)  # verify + scatter what this piece carries, here
        for fi in list(self._fds[w]):
            self._drop(w, fi)

    # -- caller side -------------------------------------------------------------------------
    def submit(self, pieces: Sequence[IoPiece], buf: StagingBuffer, on_piece=None) -> PendingIo:
        """Queue ``pieces`` round-robin on the workers; returns a :class:`PendingIo` at once.
        ``on_piece`` runs in the worker that read the piece, right after the read.

        Raises:
            RuntimeError: ``buf`` is a device buffer (POSIX reads need host memory).
        """
        if buf.array is None:
            raise RuntimeError("the POSIX engine reads into host staging buffers only")
        pending = PendingIo(len(pieces), on_piece=on_piece)
        if not pieces:
            return pending
        nw = len(self._queues)
        for i, p in enumerate(pieces):
            self._queues[next(self._rr) % nw].put((p, buf, pending, i))
        return pending

    def forget_file(self, file_index: int) -> None:
        """Close every worker's cached fd of ``file_index`` before its next read (the shared
        one once no one-call restore uses it)."""
        with self._forget_lock:
            for s in self._forget:
                s.add(file_index)
            fd = self._shared.pop(file_index, None)
            if fd is not None:
                self._shared_stale.append(fd)
            self._close_stale_locked()

    # -- one-call restores (flatcake.cio.native_restore) ----------------------------------
    def path_of(self, file_index: int) -> str:
        """Path of pool file ``file_index``."""
        return self._path_of(file_index)

    def shared_fds(self, file_indices) -> dict[int, tuple[int, int]]:
        """Read descriptors for a one-call restore, shared by its threads (``pread`` is
        positional): ``{file_index: (fd, 0)}``, or ``(-1, errno)`` for a file that did not open.
        Pair with :meth:`release_shared`; a forgotten file's fd is closed only after every
        restore holding it released it."""
        out = {}
        with self._forget_lock:
            self._shared_users += 1
            for fi in file_indices:
                fd = self._shared.get(fi)
                if fd is None:
                    try:
                        fd = self._shared[fi] = self._open_fd(fi)
                    except OSError as e:
                        out[fi] = (-1, e.errno or errno_mod.EIO)
                        continue
                out[fi] = (fd, 0)
        return out

    def release_shared(self, refuse_direct: bool = False) -> None:
        """End of a one-call restore's use of :meth:`shared_fds`. ``refuse_direct``: a read
        was refused with EINVAL under O_DIRECT: switch to buffered reads (logged once) and drop
        the shared fds so the next opens are buffered."""
        if refuse_direct and self.direct_io:
            self._disable_direct(self._path_of(0), OSError(errno_mod.EINVAL, "O_DIRECT read refused"))
            with self._forget_lock:
                for s in self._forget:
                    s.update(self._shared)
        with self._forget_lock:
            self._shared_users -= 1
            if refuse_direct:
                self._shared_stale.extend(self._shared.values())
                self._shared.clear()
            self._close_stale_locked()

    def _close_stale_locked(self) -> None:
        if self._shared_users == 0:
            for fd in self._shared_stale:
                os.close(fd)
            self._shared_stale.clear()

    def close(self) -> None:
        """Stop the worker threads (after queued reads) and close all fds."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=30)
        with self._forget_lock:
            self._shared_stale.extend(self._shared.values())
            self._shared.clear()
            self._close_stale_locked()
