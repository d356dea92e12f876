"""Disk budget of a replay: what each system can put on the output's file system, checked
against its free space before anything is written.

Every replayed page is written for real, by each system, so an unbounded run can fill the disk
(a 300-request Mooncake replay once had to be killed for it). Before writing, the replay
estimates each system's on-disk footprint — at most every unique page of the replayed requests
(``unique_pages * page_bytes``), and at most the system's capacity:

* ``flatcake`` (and ``flatcake-fcfs``): its SSD pool, ``ssd.max_files * ssd.file_bytes`` (files are preallocated whole,
  so the unique bytes are rounded up to whole files);
* ``tiered``: the pages demoted to SSD, at most the same SSD capacity; ``mooncake`` likewise (its
  offload buckets are capped at that capacity);
* ``file``: HiCacheFile's ``max_size``: FlatCake's SSD capacity unless ``file_extra`` gives one
  (:func:`file_extra_at_equal_capacity`; ``0`` = unbounded);
* ``dram-only`` and ``recompute``: nothing.

Systems that are alive together (the one-request-at-a-time replay) add up; the ``--qps`` sweep
runs one system at a time, so its largest counts. The run is refused when the total exceeds the
free space minus :func:`margin_bytes`.

The capacities the systems are compared at come from FlatCake's configuration too
(:func:`equal_capacity`): every system gets ``dram.capacity_bytes`` of DRAM and FlatCake's SSD
capacity; FlatCake's write backlog is counted in its DRAM budget, so its DRAM medium gets
``dram.capacity_bytes − ssd.write_backlog_bytes`` (:func:`flatcake_keys_at_equal_capacity`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from flatcake.common.align import align_up


class DiskBudgetError(ValueError):
    """The replay would not fit; the message names the estimate, the free space and the flag."""


OVERRIDE_FLAG = "--ignore-disk-budget"


def margin_bytes(free: int) -> int:
    """Space always left free: 5% of what is free, at least 1 GiB."""
    return max(1 << 30, free // 20)


def _ssd(fc_keys: Mapping[str, Any], field: str) -> int:
    """``ssd.<field>`` from FlatCake's (flattened, dotted) configuration keys, or its default."""
    from flatcake.config import SsdConfig

    return int(fc_keys.get(f"ssd.{field}", getattr(SsdConfig(), field)))


def ssd_capacity(fc_keys: Mapping[str, Any]) -> int:
    """FlatCake's SSD pool bytes, ``ssd.max_files × ssd.file_bytes`` (defaults where not given)."""
    return _ssd(fc_keys, "max_files") * _ssd(fc_keys, "file_bytes")


def dram_capacity(fc_keys: Mapping[str, Any]) -> int:
    """FlatCake's DRAM region bytes from its (flattened) configuration keys (default if absent)."""
    from flatcake.config import DramConfig

    return int(fc_keys.get("dram.capacity_bytes", DramConfig().capacity_bytes))


def write_backlog(fc_keys: Mapping[str, Any]) -> int:
    """FlatCake's SSD write backlog bytes, ``ssd.write_backlog_bytes`` (default if absent)."""
    return _ssd(fc_keys, "write_backlog_bytes")


@dataclass(frozen=True)
class EqualCapacity:
    """What every system of an equal-capacity replay gets (bytes), and FlatCake's split of it.

    The DRAM budget is ``dram.capacity_bytes``: ``dram-only``'s LRU, ``tiered``'s DRAM and
    ``mooncake``'s segment get all of it. FlatCake's write backlog (``ssd.write_backlog_bytes``:
    SSD rounds held in memory until the disk is free, whose pages are served from memory) is
    memory too, so it is counted in the same budget: FlatCake's DRAM medium gets the rest.

    Attributes:
        dram_bytes: the DRAM budget of every system (``dram.capacity_bytes``).
        ssd_bytes: the SSD capacity (``ssd.max_files × ssd.file_bytes``).
        flatcake_dram_bytes: FlatCake's DRAM medium, ``dram_bytes − flatcake_write_backlog_bytes``.
        flatcake_write_backlog_bytes: FlatCake's write backlog (``ssd.write_backlog_bytes``).
    """

    dram_bytes: int
    ssd_bytes: int
    flatcake_dram_bytes: int
    flatcake_write_backlog_bytes: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def note(self) -> str:
        """One line for ``summary.md``."""
        return (f"equal capacity: DRAM {_size(self.dram_bytes)} per system (FlatCake: "
                f"{_size(self.flatcake_dram_bytes)} DRAM medium + {_size(self.flatcake_write_backlog_bytes)} "
                "write backlog), SSD "
                f"{_size(self.ssd_bytes)}; HiCacheFile has no DRAM tier")


def _size(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps the number at least 1."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n} B"


def equal_capacity(fc_keys: Mapping[str, Any]) -> EqualCapacity:
    """The capacities of an equal-capacity run from FlatCake's (flattened) configuration keys.

    Raises:
        ValueError: the write backlog exceeds the DRAM budget (names both keys).
    """
    dram, backlog = dram_capacity(fc_keys), write_backlog(fc_keys)
    if backlog > dram:
        raise ValueError(
            f"ssd.write_backlog_bytes={backlog} exceeds dram.capacity_bytes={dram}: in the replay every system gets "
            "dram.capacity_bytes of DRAM and FlatCake's write backlog is counted in it (docs/baselines.md); lower "
            "ssd.write_backlog_bytes or raise dram.capacity_bytes")
    return EqualCapacity(dram, ssd_capacity(fc_keys), dram - backlog, backlog)


def flatcake_keys_at_equal_capacity(fc_keys: Mapping[str, Any]) -> dict[str, Any]:
    """FlatCake's keys in an equal-capacity run: ``dram.capacity_bytes`` reduced by the write
    backlog (:func:`equal_capacity`; raises ``ValueError`` as it does)."""
    return {**dict(fc_keys), "dram.capacity_bytes": equal_capacity(fc_keys).flatcake_dram_bytes}


def file_max_size(file_extra: Mapping[str, Any]) -> Optional[int]:
    """HiCacheFile's ``max_size`` in bytes (an int, or a size string such as ``"2G"``), or None."""
    value = file_extra.get("max_size")
    if value in (None, "", 0, "0"):
        return None
    if isinstance(value, (int, float)):
        return int(value)
    from sglang.srt.utils.common import human_readable_int

    return int(human_readable_int(str(value)))


def file_extra_at_equal_capacity(fc_keys: Mapping[str, Any], file_extra: Mapping[str, Any]) -> dict[str, Any]:
    """HiCacheFile's extra config with ``max_size`` = FlatCake's SSD capacity unless
    ``file_extra`` sets one (``0`` = unbounded, HiCacheFile's own meaning)."""
    return {"max_size": ssd_capacity(fc_keys), **dict(file_extra or {})}


def footprint(name: str, unique_bytes: int, fc_keys: Mapping[str, Any], file_extra: Mapping[str, Any]) -> int:
    """Upper bound of the bytes system ``name`` keeps on disk (see the module docstring)."""
    if name in ("tiered", "mooncake"):
        return min(align_up(unique_bytes), ssd_capacity(fc_keys))
    if name in ("flatcake", "flatcake-fcfs"):
        fb = _ssd(fc_keys, "file_bytes")
        return min(-(-unique_bytes // fb) * fb, ssd_capacity(fc_keys))
    if name == "file":
        cap = file_max_size(file_extra_at_equal_capacity(fc_keys, file_extra))
        return unique_bytes if cap is None else min(unique_bytes, cap)
    return 0


def check_disk_budget(names: Sequence[str], unique_bytes: int, fc_keys: Mapping[str, Any],
                      file_extra: Mapping[str, Any], out: Path, together: bool) -> dict[str, int]:
    """Refuse a run that would not fit on ``out``'s file system.

    Args:
        names: the systems to run.
        unique_bytes: unique pages of the replayed requests × page bytes.
        together: True when the systems hold their data at the same time (sum), False when they
            run one after another (the largest counts).

    Returns:
        Each system's footprint estimate (bytes).

    Raises:
        DiskBudgetError: the estimate exceeds the free space minus the margin.
    """
    est = {n: footprint(n, unique_bytes, fc_keys, file_extra) for n in names}
    need = sum(est.values()) if together else max(est.values(), default=0)
    probe = Path(out)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    margin = margin_bytes(free)
    if need > free - margin:
        parts = ", ".join(f"{n} up to {b / 1e9:.1f} GB" for n, b in est.items() if b)
        raise DiskBudgetError(
            f"disk budget: this run would keep up to {need / 1e9:.1f} GB on the file system of {probe} "
            f"({parts}{'' if together else '; one system at a time'}), but only {free / 1e9:.1f} GB are free "
            f"and {margin / 1e9:.1f} GB are kept as margin. Replay fewer requests (--max-requests), lower "
            f"ssd.max_files or file_extra.max_size, write elsewhere (--out), or pass {OVERRIDE_FLAG}.")
    return est


__all__ = ["DiskBudgetError", "EqualCapacity", "OVERRIDE_FLAG", "check_disk_budget", "dram_capacity", "equal_capacity",
           "file_extra_at_equal_capacity", "file_max_size", "flatcake_keys_at_equal_capacity", "footprint",
           "margin_bytes", "ssd_capacity", "write_backlog"]
