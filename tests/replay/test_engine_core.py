"""The engine core every replay engine shares (issue 25): its steps, and that the serial engine,
the hybrid engine and the serving model are that one core and start the same way."""

import pytest

from flatcake.config import load_config
from flatcake.replay.cli import REPLAY_DEFAULTS
from flatcake.replay.engine import Engine
from flatcake.replay.engine_core import (EngineConfig, EngineCore, fill_pages, prefill_tokens, read_batches,
                                         usable_hit, verify_pages, write_batches)
from flatcake.replay.hybrid_engine import HybridEngine
from flatcake.replay.keys import PageKeyer
from flatcake.replay.serving import ServingConfig, ServingModel
from flatcake.replay.startup import load_requests, storage_keys
from replay_fixtures import mooncake_path, tiny_profile  # noqa: F401  (pytest fixtures)


def test_read_batches_reads_128_page_calls_and_stops_at_the_first_short_one():
    calls = []

    def read(b, e):
        calls.append((b, e))
        return e - b if b < 256 else 10  # the third call delivers 10 of its 44 pages

    assert read_batches(300, read) == 128 + 128 + 10
    assert calls == [(0, 128), (128, 256), (256, 300)]
    calls.clear()
    assert read_batches(300, lambda b, e: calls.append((b, e)) or 3) == 3  # short at once: one call
    assert calls == [(0, 128)]
    assert read_batches(0, read) == 0


def test_read_batches_stops_before_a_call_once_told():
    """``stop`` is asked before each call (the timeout budget spent after the second call)."""
    calls = []
    assert read_batches(400, lambda b, e: calls.append((b, e)) or e - b, lambda: len(calls) == 2) == 256
    assert calls == [(0, 128), (128, 256)]
    assert read_batches(400, lambda b, e: pytest.fail("read after stop"), lambda: True) == 0


def test_write_batches_gives_every_key_before_a_call_as_prefix_keys_and_counts_failed_and_skipped():
    keys = [f"k{i}" for i in range(310)]
    seen = []

    def stored(batch, prefix):
        seen.append((batch[0], len(batch), len(prefix), prefix == keys[: len(prefix)]))
        return True

    wb = write_batches(keys, 20, stored)  # 290 computed pages after 20 cached
    assert (wb.written, wb.failed, wb.skipped) == (290, 0, 0)
    assert seen == [("k20", 128, 20, True), ("k148", 128, 148, True), ("k276", 34, 276, True)]
    # the second put refused: it and the 34 after it are failed, the last call is never made
    wb = write_batches(keys, 20, lambda batch, prefix: prefix == keys[:20])
    assert (wb.written, wb.failed, wb.skipped) == (128, 162, 0)
    # no host pages for the second call: the rest is skipped, not failed
    wb = write_batches(keys, 20, lambda batch, prefix: None if len(prefix) > 20 else True)
    assert (wb.written, wb.failed, wb.skipped) == (128, 0, 162)
    assert write_batches(keys, 310, lambda *a: pytest.fail("nothing to write")).written == 0


def test_core_match_threshold_budget_and_prefill_tokens(tiny_profile):
    P = tiny_profile.page_size
    cfg = EngineConfig(hbm_pages=8, host_pool_pages=256, prefetch_threshold_tokens=3 * P)
    core = EngineCore(tiny_profile, cfg, tiny_profile.make_host_pool(256))
    keys = [f"k{i}" for i in range(10)]
    core.insert(keys[:2])
    prefix = core.match(keys, 10 * P)  # exactly 10 pages: 9 reusable (prompt - 1 tokens)
    assert (prefix.reusable, prefix.hbm, list(prefix.rest)) == (9, 2, keys[2:9])
    assert core.match(keys, 10 * P + 1).reusable == 10
    assert [core.asks_l3(n) for n in (0, 2, 3, 7)] == [False, False, True, True]
    assert core.prefetch_budget_s(prefix) == pytest.approx(1.0 + 7 * P / 1024 * 0.25)
    wait = EngineCore(tiny_profile, EngineConfig(prefetch_policy="wait_complete"), tiny_profile.make_host_pool(256))
    assert wait.prefetch_budget_s(prefix) is None
    assert usable_hit(12, 7) == 7 and usable_hit(-1, 7) == 0 and usable_hit(5, 7) == 5
    assert prefill_tokens(10 * P + 5, 9, P) == (P + 5, 9 * P)
    core.flush()
    assert core.match(keys, 10 * P).hbm == 0


def test_core_fills_and_verifies_whole_pages(tiny_profile):
    from flatcake.replay.engine_core import PageContent

    pool = tiny_profile.make_host_pool(256)
    core = EngineCore(tiny_profile, EngineConfig(), pool)
    content = PageContent(pool)
    host = core.pages.alloc(3)
    fill_pages(content, host, ["a", "b", "c"], tiny_profile.page_size)
    assert verify_pages(content, host, ["a", "b", "c"], 3, tiny_profile.page_size) == 0
    assert verify_pages(content, host, ["a", "x", "y"], 3, tiny_profile.page_size) == 2
    assert verify_pages(content, host, ["a", "x", "y"], 1, tiny_profile.page_size) == 0  # only n pages


def test_every_engine_is_the_one_core_and_refuses_a_small_host_pool_alike(tiny_profile):
    class _NoL3:
        has_l3 = False
        hybrid = None

        def __init__(self, pages):
            self.pool = tiny_profile.make_host_pool(pages)

    for make in (lambda s: Engine(s, tiny_profile, EngineConfig()),
                 lambda s: HybridEngine(s, tiny_profile, EngineConfig()),
                 lambda s: ServingModel(s, tiny_profile, EngineConfig(), ServingConfig(qps=1.0))):
        with pytest.raises(ValueError, match="host_pool_pages must be >= 256"):
            make(_NoL3(255))
        engine = make(_NoL3(256))
        assert isinstance(engine, EngineCore) and engine.pages.free_pages == 256 and len(engine.hbm) == 0


def test_every_replay_starts_from_the_same_settings(mooncake_path, tiny_profile):
    settings = {**REPLAY_DEFAULTS, "trace": mooncake_path, "max_requests": 4}
    assert EngineConfig.from_settings(settings) == EngineConfig()
    assert EngineConfig.from_settings({**settings, "hbm_pages": 7}).hbm_pages == 7
    reqs, keys = load_requests(settings, tiny_profile)
    keyer = PageKeyer(tiny_profile.page_size)
    assert len(reqs) == 4 and keys == [keyer.keys(r) for r in reqs]
    fc = storage_keys(load_config(None, {"dram": {"capacity_bytes": 1 << 20}}))
    assert fc["dram.capacity_bytes"] == 1 << 20 and not any(k.startswith(("model", "replay")) for k in fc)
