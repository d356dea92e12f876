"""Attach, detach and re-attach as SGLang 0.5.23 drives them, and SGLang's own fault wrapper:
a failed attach releases everything (so SGLang's retry works), a re-attach serves the pool again."""

from __future__ import annotations

import errno
import os
import random

import pytest
from flatcake_testkit import make_pool, page_matches, slots_of, slow_read_in_background, storage_config, write_pages

from flatcake.adapter.storage import FlatCakeStorage
from flatcake.cio.engines import EngineUnavailableError
from flatcake.cio.kvikio_engine import real_cuda_driver
from flatcake.media.errors import SsdStartupError


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def attach(ssd_dir: str, pool, **extra) -> FlatCakeStorage:
    be = FlatCakeStorage(storage_config({"ssd.path": ssd_dir, "ssd.file_bytes": 8 << 20, "ssd.max_files": 4,
                                         "dram.capacity_bytes": 0, **extra}))
    be.register_mem_pool_host(pool)
    return be


@pytest.mark.parametrize("fault", ["kvikio_without_driver", "enospc_at_startup"])
def test_a_failed_attach_releases_everything_and_sglangs_retry_succeeds(ssd_dir, monkeypatch, fault):
    if fault == "kvikio_without_driver" and real_cuda_driver():
        pytest.skip("a real CUDA driver is present")
    pool = make_pool()
    fds = open_fds()
    if fault == "kvikio_without_driver":
        with pytest.raises(EngineUnavailableError):
            attach(ssd_dir, pool, **{"cio.engine": "kvikio"})
    else:
        def no_space(fd, off, n):
            raise OSError(errno.ENOSPC, "No space left on device")

        with monkeypatch.context() as m:
            m.setattr(os, "posix_fallocate", no_space)
            with pytest.raises(SsdStartupError, match="ENOSPC|errno 28"):
                attach(ssd_dir, pool)
    assert open_fds() == fds  # no descriptor, no lock kept
    be = attach(ssd_dir, pool)  # SGLang retries the attach in the same process
    assert write_pages(be, pool, ["r0"], [0]) == [True]
    be.close()
    assert open_fds() == fds


def test_detach_then_attach_in_the_same_process_serves_the_pool_again(ssd_dir):
    pool = make_pool()
    be = attach(ssd_dir, pool)
    keys = [f"a{i}" for i in range(6)]
    assert write_pages(be, pool, keys[:3], range(3)) == [True] * 3
    assert write_pages(be, pool, keys[3:], range(3, 6), keys[:3]) == [True] * 3
    be.close()  # SGLang's detach
    pool.kv_buffer.zero_()
    be = attach(ssd_dir, pool)  # ... and attach
    assert be.batch_exists(keys) == 6
    assert be.batch_get_v1(keys, slots_of(pool, range(10, 16))) == [True] * 6
    assert all(page_matches(pool, (10 + i) * pool.page_size, k) for i, k in enumerate(keys))
    assert be.flatcake_stats()["pages_rebuilt"] == 6
    be.close()


def test_clear_while_a_read_is_in_flight_retires_the_session_when_the_read_returns(make_backend):
    be, pool = make_backend()
    write_pages(be, pool, ["c0", "c1"], [0, 1])
    t, results = slow_read_in_background(be, pool, ["c0", "c1"], [4, 5])
    be.clear()
    assert be.batch_exists(["c0", "c1"]) == 0  # not promised any more, while the read goes on
    t.join(10)
    assert results == [[True, True]] and page_matches(pool, 4 * pool.page_size, "c0")
    assert be.store.ssd.used_bytes == 0 and len(be.store.index.scopes) == 0  # retired with its last reader


def test_under_sglangs_fault_wrapper_every_page_read_is_right_and_nothing_raises(ssd_dir, monkeypatch):
    """SGLang's HiCacheStorageFailureInjector (through its factory) fails and delays calls at random."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.002")
    be = StorageBackendFactory.create_backend("dynamic", storage_config({"ssd.path": ssd_dir}), None)
    assert type(be).__name__ == "HiCacheStorageFailureInjector"
    pool = make_pool(pages=64)
    be.register_mem_pool_host(pool)
    rng = random.Random(3)
    stored, reads = [], 0
    for s in range(40):
        keys = [f"w{s}-{i}" for i in range(3)]
        ok = write_pages(be, pool, keys, range(3))
        stored += [k for k, good in zip(keys, ok) if good]
        if not stored:
            continue
        pick = rng.sample(stored, min(3, len(stored)))
        got = be.batch_get_v1(pick, slots_of(pool, range(30, 30 + len(pick))))
        for i, (k, good) in enumerate(zip(pick, got)):
            if good:
                reads += 1
                assert page_matches(pool, (30 + i) * pool.page_size, k), k
    assert reads > 10
    be.close()
