"""Fixtures for the replay tests (imported by name; not a conftest.py, so no clash with other
test directories' ``conftest`` modules): the tiny traces in ``fixtures/`` and a tiny model
profile (16 KiB pages) so an end-to-end replay runs in about a second."""

import contextlib
from pathlib import Path

import pytest

from flatcake.replay.engine import ModelProfile

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture
def mooncake_path() -> Path:
    return FIXTURES / "mooncake_5.jsonl"


@pytest.fixture
def weka_path() -> Path:
    return FIXTURES / "weka_2sessions.tar.xz"


@pytest.fixture
def tiny_profile() -> ModelProfile:
    # 2 (K,V) x 2 layers x 1 head x 32 dims x 2 bytes = 256 B/token; 64-token page = 16 KiB
    return ModelProfile(name="tiny/mha", attention="mha", layers=2, kv_heads=1, head_dim=32,
                        dtype="bfloat16", page_size=64, layout="page_first", params=1e6,
                        q_heads=2, q_head_dim=32, gpu_tflops=100.0, mfu=0.5, pcie_gbps=10.0)


# ------------------------------------------------------------------ the `tiered` baseline's tests
#: one page of :func:`tiny_profile` (one 4 KiB-aligned record)
TIERED_PAGE_BYTES = 16384


@contextlib.contextmanager
def tiered_systems(tmp_path, profile, dram_pages: int, ssd_pages: int, bucket_pages: int):
    """A factory ``make(dram_pages=, ssd_pages=, bucket_pages=, **tiered_extra) -> (TieredSystem,
    host pool)`` (capacities in pages of :data:`TIERED_PAGE_BYTES`; the defaults given here),
    each in its own directory under ``tmp_path``; every system made is closed on exit."""
    from flatcake.replay.tiered import TieredSystem

    made = []

    def make(dram_pages=dram_pages, ssd_pages=ssd_pages, bucket_pages=bucket_pages, **extra):
        pool = profile.make_host_pool(256)
        t = TieredSystem(profile, pool, tmp_path / f"t{len(made)}", dram_pages * TIERED_PAGE_BYTES,
                         ssd_pages * TIERED_PAGE_BYTES, {"bucket_bytes": bucket_pages * TIERED_PAGE_BYTES, **extra})
        made.append(t)
        return t, pool

    try:
        yield make
    finally:
        for t in made:
            t.close()


def tiered_write(t, pool, keys, first_page=0):
    """Fill host pages ``first_page...`` with ``keys``' bytes and ``t.set`` them (asserted True)."""
    from flatcake_testkit import fill_page, slots_of

    pages = range(first_page, first_page + len(keys))
    for k, p in zip(keys, pages):
        fill_page(pool, p * pool.page_size, k)
    assert t.set(list(keys), slots_of(pool, pages), [])


def tiered_read(t, pool, keys, first_page=128):
    """``t.get`` ``keys`` into junk-filled host pages ``first_page...``: ``(get's answer, [page
    bit-exact per key])``."""
    from flatcake_testkit import fill_page, page_matches, slots_of

    pages = range(first_page, first_page + len(keys))
    for p in pages:
        fill_page(pool, p * pool.page_size, "junk")
    got = t.get(list(keys), slots_of(pool, pages), [])
    return got, [page_matches(pool, p * pool.page_size, k) for k, p in zip(keys, pages)]
