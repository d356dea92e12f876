"""Start-up checks and the start-up line of the SGLang backend (``docs/configuration.md``).

Run by :class:`flatcake.adapter.storage.FlatCakeStorage` when SGLang registers the host pool,
i.e. once the page size in bytes is known:

* :func:`check_file_bytes` refuses an ``ssd.file_bytes`` that cannot hold one full round of
  :data:`~flatcake.config.STORAGE_BATCH_PAGES` pages (SGLang's backup batch), naming the field
  and the smallest value that would do;
* :func:`startup_line` is the one line each rank logs (logger ``flatcake``, INFO): resolved
  capacity per medium, the I/O engine and the pool identity (directory, file prefix, and the
  DP rank and slot or ``ssd.pool_id`` it was named by, :mod:`flatcake.adapter.identity`), and
  each C loop's state (:func:`native_summary`, :mod:`flatcake.native.loops`);
* :func:`native_warning` is the WARNING logged when a C loop fell back (named, with its reason);
* :func:`default_path_warning` is the WARNING logged when ``ssd.path`` was left to its default;
* :func:`prefix_keys_warning` is the WARNING logged when SGLang runs with
  ``hicache_storage_pass_prefix_keys`` off (placement then cannot see sessions).

Capacities are per rank: every FlatCake instance (one per TP rank, PP rank and DP replica) has
its own DRAM region and its own SSD pool — per process, not per directory: several processes
sharing one ``ssd.path`` each have ``ssd.max_files × ssd.file_bytes``.
"""

from __future__ import annotations

from typing import Mapping, Optional

from flatcake.config import STORAGE_BATCH_PAGES, ConfigError, FlatCakeConfig, default_ssd_path
from flatcake.common.layout import PageGeometry
from flatcake.store.write_path import round_extent_bytes

_MIB = 1 << 20


def min_file_bytes(geometry: PageGeometry) -> int:
    """The smallest ``ssd.file_bytes`` (bytes, a multiple of 1 MiB) whose file holds one full
    round of :data:`~flatcake.config.STORAGE_BATCH_PAGES` pages of ``geometry`` with its
    headers and record."""
    return _mib_ceil(round_extent_bytes(STORAGE_BATCH_PAGES, geometry))


def _mib_ceil(n: int) -> int:
    """``n`` bytes rounded up to a multiple of 1 MiB."""
    return -(-n // _MIB) * _MIB


def check_file_bytes(cfg: FlatCakeConfig, geometry: PageGeometry) -> None:
    """Refuse pool files too small for one full SGLang backup batch of these pages.

    Args:
        cfg: the validated configuration.
        geometry: the page geometry of the registered host pool.

    Raises:
        ConfigError: ``ssd.file_bytes`` is below :func:`min_file_bytes`; the message names
            ``ssd.file_bytes``, the page bytes and the smallest value that fits.
    """
    need = round_extent_bytes(STORAGE_BATCH_PAGES, geometry)
    if cfg.ssd.file_bytes < need:
        raise ConfigError(
            f"ssd.file_bytes: {cfg.ssd.file_bytes} bytes cannot hold one round of {STORAGE_BATCH_PAGES} pages "
            f"(SGLang's backup batch) of {geometry.page_bytes} bytes each plus headers ({need} bytes); "
            f"set ssd.file_bytes to at least {_mib_ceil(need)}")


def _size(n: int) -> str:
    """``n`` bytes, with a GiB/MiB figure for the eye."""
    if n >= 1 << 30:
        return f"{n} bytes ({n / (1 << 30):.1f} GiB)"
    return f"{n} bytes ({n / _MIB:.1f} MiB)"


def startup_line(stats: Mapping, *, ssd_path: str, pool_prefix: str, file_bytes: int, max_files: int,
                 pinned: bool, direct_io: bool, page_bytes: int, ranks: str, role: str,
                 pool_identity: str = "", native_loops: Optional[Mapping] = None) -> str:
    """The one start-up line of a rank: what it serves and where.

    Args:
        stats: :meth:`flatcake.store.page_store.PageStore.snapshot_stats` (``media`` capacities in bytes,
            ``cio_engine``).
        ssd_path: the resolved ``ssd.path`` directory (the first drive's; with several drives
            the line lists every drive from ``stats["media"]["ssd"]["drives"]``).
        pool_prefix: the pool's file prefix in it (``fc-<16 hex>``: a digest of namespace and
            pool identity).
        pool_identity: the identity in words (:meth:`flatcake.adapter.identity.PoolIdentity.describe`:
            ``dp0 slot 1``, ``dp0-id=a (ssd.pool_id)``); shown after the directory when given.
        file_bytes, max_files: the pool's file size (bytes) and file count.
        pinned: whether the DRAM region is page-locked.
        direct_io: whether pool files are opened with ``O_DIRECT``.
        page_bytes: bytes of one page (all layers).
        ranks: the rank this instance serves, e.g. ``"tp 0/8 pp 0/1 dp 0"``.
        role: ``single``, ``writer`` or ``follower`` (MLA with TP > 1).
        native_loops: :func:`flatcake.native.loops.report` (each C loop's state), listed at the
            end (:func:`native_summary`); ``None``: not listed.

    Returns:
        One line, no newline.
    """
    media = stats.get("media", {})
    dram = media.get("dram", {}).get("capacity_bytes", 0)
    ssd = media.get("ssd", {}).get("capacity_bytes", 0)
    drives = media.get("ssd", {}).get("drives") or []
    where = ssd_path if len(drives) < 2 else (  # several drives: each with its files, journal on the first
        f"{len(drives)} drives " + ", ".join(f"{d['path']} ({d['files']} files, {d['state']})" for d in drives)
        + f", journal on {drives[0]['path']}")
    return (f"flatcake: per-rank capacity ({ranks}, {role}): DRAM {_size(dram)}, "
            f"{'pinned' if pinned else 'not pinned'}; SSD {_size(ssd)} = {max_files} x {file_bytes}-byte files, "
            f"{'direct' if direct_io else 'buffered'} I/O; I/O engine {stats.get('cio_engine', '?')}; "
            f"pool {pool_prefix} in {where}{f' ({pool_identity})' if pool_identity else ''}; page {page_bytes} bytes"
            + (f"; {native_summary(native_loops)}" if native_loops is not None else ""))


def native_summary(loops: Mapping) -> str:
    """Every C loop by state, e.g. ``C loops native (restore, plan, gather, write, xxh3, fcds),
    off (zero_copy)``; ``loops``: :func:`flatcake.native.loops.report`."""
    groups: dict = {}
    for name, r in loops.items():
        groups.setdefault(r["state"], []).append(name)
    return "C loops " + ", ".join(f"{state.upper() if state == 'fallback' else state} ({', '.join(names)})"
                                  for state, names in groups.items())


def native_warning(loops: Mapping) -> Optional[str]:
    """The WARNING to log when a C loop fell back (each named with its reason), else None;
    ``loops``: :func:`flatcake.native.loops.report`."""
    fell = [f"{n} ({r['reason']})" for n, r in loops.items() if r["state"] == "fallback"]
    if not fell:
        return None
    return ("flatcake: C loops fell back to Python: " + "; ".join(fell) + ". The fallbacks give the same bytes, "
            "several times slower (writes at about 0.5 GB/s); python -m flatcake.native shows each loop's state "
            "(rebuild the extension: pip install --no-deps -e . with a C compiler)")


def default_path_warning(ssd_path: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The warning to log when ``ssd.path`` is the per-user default
    (:func:`flatcake.config.default_ssd_path`), else None."""
    try:
        default = default_ssd_path(environ)
    except ValueError:
        return None
    if ssd_path != default:
        return None
    return (f"flatcake: ssd.path not set: the SSD pool is in the per-user cache directory {ssd_path}; "
            "set ssd.path to a directory on the NVMe drive meant for the KV cache")


def sglang_passes_prefix_keys() -> Optional[bool]:
    """Whether this SGLang process runs with ``hicache_storage_pass_prefix_keys: true``: read
    from its server arguments (``sglang.srt.runtime_context.get_memory()``, the record SGLang's
    radix cache reads the flag from; SGLang removes the key from the extra config before the
    backend sees it). None when unknown: not inside an SGLang server, an extra config that
    cannot be read here, or a runtime attach (``PUT /hicache/storage-backend`` on a server started
    without L3, or after a detach): SGLang records the attach's backend and extra config only
    after the backend is built (``managers/scheduler.py`` 5440-5465), so the record still says no
    backend while FlatCake starts."""
    try:
        from sglang.srt.runtime_context import get_memory

        memory = get_memory()
        if memory.hicache_storage_backend is None:  # runtime attach: the record is not updated yet
            return None
        raw = memory.hicache_storage_backend_extra_config
    except Exception:  # noqa: BLE001 - no SGLang server in this process
        return None
    if not raw:
        return False
    from flatcake.adapter.launcher import LaunchError, load_extra_config

    try:
        extra = load_extra_config(str(raw))
    except LaunchError:
        return None
    return extra.get("hicache_storage_pass_prefix_keys") is True


def prefix_keys_warning() -> Optional[str]:
    """The warning to log when SGLang passes no prefix keys (:func:`sglang_passes_prefix_keys`
    is False), else None."""
    if sglang_passes_prefix_keys() is not False:
        return None
    return ("flatcake: SGLang runs with hicache_storage_pass_prefix_keys off (extra config): it passes no "
            "prefix keys and write-time placement cannot see sessions; add \"hicache_storage_pass_prefix_keys\": true")
