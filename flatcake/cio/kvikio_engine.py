"""The kvikio (cuFile / GDS) I/O engine of FC-CIO and the start-up engine probe (paper §3.3).

* :class:`KvikioEngine` — ``kvikio.CuFile.pread`` futures, one handle set per worker; on a GPU
  the destination is the HBM staging buffer (GDS, or kvikio's compatibility mode through a
  bounce buffer). kvikio raises on EOF instead of returning a short count, so requests are
  clamped to the file size first.
* :func:`select_engine` — which engine can actually move bytes here: ``auto`` picks kvikio
  only when a real CUDA driver is present *and* CUDA is available *and* a probe read moves
  bytes; otherwise POSIX. It never calls ``kvikio.cufile_driver.driver_open()`` and never sets
  ``KVIKIO_COMPAT_MODE=OFF`` (both fail or hang without the nvidia-fs driver).

kvikio needs the CUDA driver library for any transfer, even into host memory; CPU machines
read through :class:`~flatcake.cio.engines.PosixEngine`, and the tests exercise this engine
through a test-only driver shim (``tests/shim/``).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import tempfile
import threading
from typing import Callable, Sequence

from flatcake.cio.engines import EngineUnavailableError, IoEngine, IoPiece, PendingIo, PieceResult
from flatcake.cio.staging import StagingBuffer
from flatcake.common.errorlog import ErrorLog, reason_of

log = logging.getLogger(__name__)


class KvikioEngine(IoEngine):
    """``kvikio.CuFile.pread`` futures into host or HBM staging buffers.

    Args:
        path_of: maps a file index to its path.
        workers: handle sets (one ``CuFile`` per file per worker); also kvikio's thread count.
        errors: shared :class:`ErrorLog`.
        direct_io: the SSD pool's O_DIRECT probe result (reported as :attr:`direct_io`; kvikio
            itself chooses GDS or its POSIX compatibility path).

    Raises:
        EngineUnavailableError: ``kvikio`` cannot be imported.
    """

    name = "kvikio"

    def __init__(self, path_of: Callable[[int], str], workers: int, *, errors: ErrorLog, direct_io: bool = True):
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
        self._retired: list[object] = []  # handles forgotten while reads may still use them
        try:
            kvikio.defaults.set("num_threads", max(int(kvikio.defaults.get("num_threads")), workers))
        except Exception as e:  # noqa: BLE001 - older kvikio: keep its default
            log.info("kvikio num_threads not set (%s)", e)
        self.direct_io = bool(direct_io)

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
                pending.results[i] = PieceResult(0, reason_of(e))
                self._errors.report("read", reason_of(e), f"{path} @ {p.offset}: {e}")
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
                    got, err = 0, reason_of(e)
                    self._errors.report("read", err, f"{self._path_of(p.file_index)} @ {p.offset}: {e}")
            if got < p.nbytes and err is None:
                err = "EOF"  # logged by the restore only if a chunk misses bytes
            pending.results[i] = PieceResult(min(got, p.nbytes), err)
        for i in range(len(pieces)):
            pending.run_callback(i)

    def forget_file(self, file_index: int) -> None:
        """Stop using every worker's ``CuFile`` of ``file_index``: the next read opens the path
        again. The old handles are closed at :meth:`close` (a restore may still have reads in
        flight on them; a removed file's handles are few)."""
        with self._lock:
            for hs in self._handles:
                h = hs.pop(file_index, None)
                if h is not None:
                    self._retired.append(h)

    def close(self) -> None:
        """Close all ``CuFile`` handles."""
        with self._lock:
            handles = [h for hs in self._handles for h in hs.values()] + self._retired
            for hs in self._handles:
                hs.clear()
            self._retired = []
        for h in handles:
            try:
                h.close()
            except Exception:  # noqa: BLE001
                pass


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
