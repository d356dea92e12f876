"""Host buffers for O_DIRECT (flatcake.media.directio): page alignment, zero fill, and the
staging windows' transparent huge pages (docs/performance.md, "Huge pages for staging")."""

import pytest

from flatcake.common.align import ALIGN
from flatcake.cio.staging import StagingPool
from flatcake.media.directio import aligned_host_buffer


def vm_flags(addr: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding ``addr`` (/proc/self/smaps)."""
    lines = open("/proc/self/smaps").read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize("huge,env,marked", [(True, None, True), (True, "0", False), (False, None, False)])
def test_huge_buffers_are_marked_for_thp_zero_filled_and_aligned(monkeypatch, huge, env, marked):
    if env is not None:
        monkeypatch.setenv("FLATCAKE_HUGEPAGES", env)
    t, arr, m = aligned_host_buffer(8 << 20, huge=huge)
    assert t.data_ptr() % ALIGN == 0 and arr.nbytes == 8 << 20 and int(arr.max()) == 0
    assert ("hg" in vm_flags(t.data_ptr())) is marked  # MADV_HUGEPAGE on the mapping
    arr[-1] = 7
    assert int(t[-1]) == 7  # the tensor and the array share the mapping


def test_staging_windows_ask_for_huge_pages():
    pool = StagingPool(1, 4 << 20, "cpu")
    try:
        bufs = pool.windows[0].buffers
        assert len(bufs) == 2
        for b in bufs:
            assert b.tensor.data_ptr() % ALIGN == 0 and "hg" in vm_flags(b.tensor.data_ptr())
    finally:
        pool.close()
