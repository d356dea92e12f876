"""I/O back-ends of FC-CIO (paper §3.3): POSIX ``preadv`` workers and kvikio (cuFile/GDS).

Both take *pieces* (aligned sub-ranges of merged reads, each bound for an offset in a staging
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
* :class:`KvikioEngine` — ``kvikio.CuFile.pread`` futures, one handle set per worker; on a GPU
  the destination is the HBM staging buffer (GDS, or kvikio's compatibility mode through a
  bounce buffer). kvikio raises on EOF instead of returning a short count, so requests are
  clamped to the file size first.

:func:`select_engine` is the start-up probe: ``auto`` picks kvikio only when a real CUDA driver
is present *and* CUDA is available *and* a probe read moves bytes; otherwise POSIX. It never
calls ``kvikio.cufile_driver.driver_open()`` and never sets ``KVIKIO_COMPAT_MODE=OFF`` (both
fail or hang without the nvidia-fs driver).
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import itertools
import logging
import os
import queue
import tempfile
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from flatcake.config import ALIGN
from flatcake.cio.staging import StagingBuffer, aligned_host_buffer

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


class ErrorLog:
    """Logs each distinct I/O error once (by operation and errno/reason); thread-safe."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self.count = 0

    def report(self, op: str, reason: str, detail: str) -> None:
        """Count an error; log it at WARNING the first time ``(op, reason)`` is seen."""
        with self._lock:
            self.count += 1
            key = (op, reason)
            if key in self._seen:
                return
            self._seen.add(key)
        log.warning("FC-CIO %s failed (%s): %s; later errors of this kind are not logged", op, reason, detail)


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        return errno_mod.errorcode.get(e.errno, str(e.errno))
    text = str(e)
    return "EOF" if "EOF" in text else type(e).__name__


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

    def _run_callback(self, i: int) -> None:
        """Run ``on_piece(i, result)``; an exception is kept for :meth:`wait`'s caller."""
        if self.on_piece is None:
            return
        try:
            self.on_piece(i, self.results[i])
        except BaseException as e:  # noqa: BLE001 - surfaced by the restore, never lost
            self.callback_errors.append(e)

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
    step = -(-nbytes // n)
    step = -(-step // ALIGN) * ALIGN
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
    """

    name = "posix"

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
        self.syscalls = 0  # preadv calls issued (diagnostic; updated without a lock, approximate)
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
                    _reason(e),
                )

    def _open(self, w: int, file_index: int) -> int:
        fds = self._fds[w]
        fd = fds.get(file_index)
        if fd is not None:
            return fd
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
        fds[file_index] = fd
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
                self.syscalls += 1
            except OSError as e:
                if e.errno == errno_mod.EINVAL and res.got == 0 and not retried:
                    # O_DIRECT accepted at open but the read is refused: reopen buffered, once
                    retried = True
                    if self.direct_io:
                        self._disable_direct(self._path_of(p.file_index), e)
                    self._drop(w, p.file_index)
                    continue
                res.error = _reason(e)
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
                pending.results[i] = PieceResult(0, _reason(e))
                self._errors.report("read", _reason(e), repr(e))
            finally:
                pending._run_callback(i)  # verify + scatter what this piece carries, here
                pending._latch.count_down()
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
        """Close every worker's cached fd of ``file_index`` before its next read."""
        with self._forget_lock:
            for s in self._forget:
                s.add(file_index)

    def close(self) -> None:
        """Stop the worker threads (after queued reads) and close all fds."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=30)


class KvikioEngine(IoEngine):
    """``kvikio.CuFile.pread`` futures into host or HBM staging buffers.

    Args:
        path_of: maps a file index to its path.
        workers: handle sets (one ``CuFile`` per file per worker); also kvikio's thread count.
        errors: shared :class:`ErrorLog`.

    Raises:
        EngineUnavailableError: ``kvikio`` cannot be imported.
    """

    name = "kvikio"

    def __init__(self, path_of: Callable[[int], str], workers: int, *, errors: ErrorLog):
        try:
            import kvikio  # noqa: F401
            import kvikio.defaults
        except Exception as e:  # noqa: BLE001
            raise EngineUnavailableError(f"kvikio is not importable: {e}") from e
        self._kvikio = kvikio
        self._path_of = path_of
        self._errors = errors
        self._workers = workers
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._handles: list[dict[int, object]] = [{} for _ in range(workers)]
        try:
            kvikio.defaults.set("num_threads", max(int(kvikio.defaults.get("num_threads")), workers))
        except Exception as e:  # noqa: BLE001 - older kvikio: keep its default
            log.info("kvikio num_threads not set (%s)", e)
        try:
            self.compat_mode = str(kvikio.defaults.get("compat_mode"))
        except Exception:  # noqa: BLE001
            self.compat_mode = "unknown"
        self.direct_io = True

    def _handle(self, w: int, file_index: int):
        with self._lock:
            h = self._handles[w].get(file_index)
            if h is None:
                h = self._kvikio.CuFile(self._path_of(file_index), "r")
                self._handles[w][file_index] = h
            return h

    def submit(self, pieces: Sequence[IoPiece], buf: StagingBuffer, on_piece=None) -> PendingIo:
        """Issue one ``pread`` future per piece; :meth:`PendingIo.wait` collects them (and runs
        ``on_piece`` for each, in the waiting thread)."""
        futures: list[tuple[int, object, int]] = []  # (piece index, future or None, requested)
        pending = PendingIo(len(pieces), waiter=lambda p: self._collect(p, futures, pieces), on_piece=on_piece)
        for i, p in enumerate(pieces):
            w = next(self._rr) % self._workers
            path = self._path_of(p.file_index)
            try:
                size = os.stat(path).st_size
                n = max(0, min(p.nbytes, size - p.offset))
                if n == 0:
                    futures.append((i, None, 0))
                    continue
                dst = buf.array[p.buf_offset : p.buf_offset + n] if buf.array is not None else \
                    buf.tensor[p.buf_offset : p.buf_offset + n]
                fut = self._handle(w, p.file_index).pread(dst, n, p.offset)
                futures.append((i, fut, n))
            except Exception as e:  # noqa: BLE001
                pending.results[i] = PieceResult(0, _reason(e))
                self._errors.report("read", _reason(e), f"{path} @ {p.offset}: {e}")
                futures.append((i, None, -1))
        return pending

    def _collect(self, pending: PendingIo, futures, pieces) -> None:
        for i, fut, n in futures:
            p = pieces[i]
            if n < 0:
                continue  # submission already failed
            got = 0
            err = None
            if fut is not None:
                try:
                    got = int(fut.get())
                except Exception as e:  # noqa: BLE001
                    got, err = 0, _reason(e)
                    self._errors.report("read", err, f"{self._path_of(p.file_index)} @ {p.offset}: {e}")
            if got < p.nbytes and err is None:
                err = "EOF"  # logged by the restore only if a chunk misses bytes
            pending.results[i] = PieceResult(min(got, p.nbytes), err)
        for i in range(len(pieces)):
            pending._run_callback(i)

    def forget_file(self, file_index: int) -> None:
        """Close every worker's ``CuFile`` of ``file_index``."""
        with self._lock:
            for hs in self._handles:
                h = hs.pop(file_index, None)
                if h is not None:
                    h.close()

    def close(self) -> None:
        """Close all ``CuFile`` handles."""
        with self._lock:
            for hs in self._handles:
                for h in hs.values():
                    try:
                        h.close()
                    except Exception:  # noqa: BLE001
                        pass
                hs.clear()


# ------------------------------------------------------------------------------- probes
def real_cuda_driver() -> bool:
    """True when ``libcuda.so.1`` loads and ``cuInit(0)`` succeeds (a real NVIDIA driver).

    A test shim (which answers ``CUDA_ERROR_NOT_INITIALIZED``) or no driver gives False.
    """
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        return int(lib.cuInit(0)) == 0
    except (OSError, AttributeError):
        return False


def _kvikio_probe_read(directory: str, device: str) -> None:
    """Write 8 KiB and read it back with kvikio into the staging device; raises on failure."""
    import numpy as np
    import kvikio
    import torch

    d = directory if os.path.isdir(directory) else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix=".fc-kvikio-probe-", dir=d)
    try:
        payload = bytes(range(256)) * 32
        os.write(fd, payload)
        os.close(fd)
        f = kvikio.CuFile(path, "r")
        try:
            if torch.device(device).type == "cuda":
                dst = torch.zeros(len(payload), dtype=torch.uint8, device=device)
                n = f.pread(dst, len(payload), 0).get()
                ok = bytes(dst.cpu().numpy()) == payload
            else:
                dst = np.zeros(len(payload), dtype=np.uint8)
                n = f.pread(dst, len(payload), 0).get()
                ok = dst.tobytes() == payload
        finally:
            f.close()
        if n != len(payload) or not ok:
            raise EngineUnavailableError(f"kvikio probe read returned {n} bytes, content ok={ok}")
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def select_engine(requested: str, probe_dir: str, device: str) -> tuple[str, str]:
    """Start-up probe: which engine can actually move bytes here.

    Args:
        requested: ``cfg.engine``: ``"auto"``, ``"posix"`` or ``"kvikio"``.
        probe_dir: directory for the probe file (the SSD pool directory).
        device: staging device (``"cpu"`` or ``"cuda[:N]"``).

    Returns:
        ``(engine_name, reason)``.

    Raises:
        EngineUnavailableError: ``"kvikio"`` requested but kvikio cannot move bytes (not importable,
            no ``libcuda.so.1``, or the probe read failed); or ``"posix"`` with a CUDA staging device.
        ValueError: unknown ``requested``.
    """
    import torch

    dev = torch.device(device)
    if requested == "posix":
        if dev.type != "cpu":
            raise EngineUnavailableError("the POSIX engine reads into host memory; use device='cpu'")
        return "posix", "requested"
    if requested == "kvikio":
        try:
            _kvikio_probe_read(probe_dir, device)
        except Exception as e:  # noqa: BLE001
            raise EngineUnavailableError(
                f"cio.engine=kvikio requested but kvikio cannot move bytes here ({type(e).__name__}: {e}); "
                "kvikio needs the CUDA driver library libcuda.so.1 even for host buffers; use engine 'posix' or 'auto'"
            ) from e
        return "kvikio", "requested; probe read ok"
    if requested != "auto":
        raise ValueError(f"unknown cio.engine {requested!r}")
    if not real_cuda_driver():
        if dev.type != "cpu":
            raise EngineUnavailableError(f"staging device {device} needs a CUDA driver, none found")
        return "posix", "no CUDA driver (libcuda.so.1 missing or cuInit failed)"
    if not torch.cuda.is_available():
        if dev.type != "cpu":
            raise EngineUnavailableError(f"staging device {device} requested but torch has no CUDA")
        return "posix", "CUDA driver present but torch.cuda is unavailable"
    try:
        _kvikio_probe_read(probe_dir, device)
    except Exception as e:  # noqa: BLE001
        if dev.type != "cpu":
            raise EngineUnavailableError(f"kvikio probe read into {device} failed: {e}") from e
        return "posix", f"kvikio probe read failed ({type(e).__name__}: {e})"
    return "kvikio", "CUDA driver present and kvikio probe read ok"
