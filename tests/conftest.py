"""Shared fixtures: FlatCake backends built through SGLang's real factory on host-pool doubles."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from flatcake_testkit import make_pool, storage_config  # noqa: E402


@pytest.fixture
def ssd_dir(tmp_path):
    """An SSD pool directory on the ext4 work filesystem (not tmpfs: O_DIRECT alignment matters)."""
    d = tmp_path / "ssd"
    d.mkdir()
    return str(d)


@pytest.fixture
def allow_small_files(monkeypatch):
    """Turn off the adapter's start-up refusal of pool files smaller than one 128-page round
    (``flatcake.adapter.startup.check_file_bytes``, tested on its own) for tests that exercise
    reclaim and oversized rounds with tiny pool files."""
    monkeypatch.setattr("flatcake.adapter.storage.check_file_bytes", lambda cfg, geometry: None)


@pytest.fixture(autouse=True)
def _short_follower_wait(monkeypatch):
    """An MLA follower rank whose writer never comes waits 1 s here, not the 300 s a real server's
    start-up is given (``identity.FOLLOWER_WAIT_S``): unit tests build lone follower ranks on
    purpose. The full wait and its log lines are tested with a fake clock in
    tests/adapter/test_identity.py."""
    from flatcake.adapter import identity

    monkeypatch.setattr(identity, "FOLLOWER_WAIT_S", 1.0)


@pytest.fixture
def make_backend(ssd_dir):
    """Factory: ``make_backend(mla=..., layout=..., dtype=..., extra={...})`` -> (backend, pool),
    created by SGLang's ``StorageBackendFactory.create_backend('dynamic', ...)``."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    made = []

    def _make(*, mla=False, layout="page_first", dtype=torch.bfloat16, extra=None, pool=None, model="test-model", tp_rank=0, tp_size=1, **pool_kw):
        ex = {"ssd.path": ssd_dir, "ssd.file_bytes": 8 << 20, "ssd.max_files": 4, "dram.capacity_bytes": 0}
        ex.update(extra or {})
        cfg = storage_config(ex, mla=mla, layout=layout, model=model, tp_rank=tp_rank, tp_size=tp_size)
        be = StorageBackendFactory.create_backend("dynamic", cfg, None)
        pool = pool or make_pool(mla=mla, layout=layout, dtype=dtype, **pool_kw)
        be.register_mem_pool_host(pool)
        made.append(be)
        return be, pool

    yield _make
    for be in made:
        be.close()
