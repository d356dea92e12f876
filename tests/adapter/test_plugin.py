"""The FC-MAS plugin's decisions, and its lanes over a double of SGLang 0.5.23's prefetch/ack
protocol (``cache_controller.py`` 1155-1267: 128-page batches, one progress ack per batch, a
final ``completed_req`` ack). The same behaviour against SGLang's real controller class is in
``tests/controller/``; this file needs only the backend's dependencies."""

from __future__ import annotations

import logging
import queue
import threading
from types import SimpleNamespace

import pytest
from flatcake_testkit import fill_page, page_matches, slots_of, two_requests_share, write_pages

from flatcake.adapter import plugin


class ControllerDouble:
    """What the plugin reads of SGLang's controller, with ``_page_transfer`` as 0.5.23 runs it
    for plain KV: ``batch_get_v1`` per 128 pages, stopping at the first page not delivered."""

    def __init__(self, be, page_size, groups=0):
        self.storage_backend = be
        self.page_size = page_size
        self.prefetch_buffer, self.prefetch_sync_queue = queue.Queue(), queue.Queue()
        self.storage_stop_event = threading.Event()
        self.prefetch_completion_sync_groups = [object()] * groups
        self.prefetch_hits_sync_groups = []

    def _page_transfer(self, op):
        done = 0
        for i in range(0, len(op.hash_value), 128):
            keys = op.hash_value[i:i + 128]
            ok = self.storage_backend.batch_get_v1(keys, op.host_indices[i * self.page_size:(i + len(keys)) * self.page_size])
            done += ok.index(False) if False in ok else len(ok)
            self.prefetch_sync_queue.put(("progress", op.request_id, done * self.page_size))


def op_for(rid, keys, pool, pages):
    return SimpleNamespace(request_id=rid, hash_value=list(keys), host_indices=slots_of(pool, pages),
                           is_terminated=lambda: False)


def test_register_hooks_prefetch_io_unless_switched_off(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    calls = []
    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, *a, **k: calls.append(a)))
    monkeypatch.setenv(plugin.ENV_SWITCH, "OFF")
    plugin.register()
    assert calls == []
    monkeypatch.setenv(plugin.ENV_SWITCH, "on")
    plugin.register()
    assert calls == [(plugin.HOOK_TARGET, plugin.prefetch_io_around, HookType.AROUND)]


def test_hook_falls_through_to_sglang_when_backend_is_not_flatcake_or_ranks_reduce(make_backend, caplog):
    caplog.set_level(logging.INFO, logger="flatcake.plugin")
    plugin.forget_said()
    be, _ = make_backend()
    seen = []
    original = lambda cc: seen.append(cc) or "sglang-loop"  # noqa: E731
    other = SimpleNamespace(storage_backend=object())
    assert plugin.prefetch_io_around(original, other) == "sglang-loop"
    assert plugin.prefetch_io_around(original, other) == "sglang-loop"
    multi = ControllerDouble(be, 4, groups=1)
    assert plugin.ack_ranks(multi) == 1
    assert plugin.prefetch_io_around(original, multi) == "sglang-loop"
    assert plugin.prefetch_io_around(original, multi) == "sglang-loop"
    assert seen == [other, other, multi, multi]
    assert caplog.text.count("(attention-TP, attention-CP or PP > 1): keeping SGLang's FIFO prefetch I/O") == 1
    assert caplog.text.count("the L3 backend is object, not FlatCake: nothing hooked") == 1  # each said once


def test_lanes_serve_dram_hits_before_a_held_ssd_restore_over_the_protocol_double(make_backend):
    be, pool = make_backend(pages=160, extra={"dram.capacity_bytes": 1 << 20})
    ssd = [f"ssd{i}" for i in range(40)]
    be.batch_exists(ssd)
    assert all(write_pages(be, pool, ssd, range(40)))
    assert be.store.flush_writes(30)  # on SSD, not in the write queue (queued pages go to the DRAM lane)
    dram = [f"sys{i}" for i in range(3)]
    two_requests_share(be.batch_exists, dram)
    assert all(write_pages(be, pool, dram, range(40, 43)))
    assert (be.medium_summary(ssd).ssd_pages, be.medium_summary(dram).dram_pages) == (40, 3)
    for slot in range(160):
        fill_page(pool, slot * pool.page_size, "junk")
    gate, real = threading.Event(), be.store.cio.restore
    be.store.cio.restore = lambda *a, **k: (gate.wait(30), real(*a, **k))[1]

    cc = ControllerDouble(be, pool.page_size)
    lanes = plugin.PrefetchLanes(cc, be, ssd_restores=1, ack=lambda op: ("done", op.request_id, None))
    assert lanes.lanes.pending_reads == be.store.reads_pending  # a queued restore holds the write queue
    worker = threading.Thread(target=lanes.run)
    worker.start()
    big, small = op_for("big", ssd, pool, range(100, 140)), op_for("small", dram, pool, range(150, 153))
    cc.prefetch_buffer.put(big)
    cc.prefetch_buffer.put(small)
    try:
        seen = [cc.prefetch_sync_queue.get(timeout=30) for _ in range(2)]
        assert seen == [("progress", "small", 3 * pool.page_size), ("done", "small", None)]
        gate.set()
        seen = [cc.prefetch_sync_queue.get(timeout=30) for _ in range(2)]
        assert seen == [("progress", "big", 40 * pool.page_size), ("done", "big", None)]
    finally:
        gate.set()
        cc.storage_stop_event.set()
        worker.join(30)
    assert not worker.is_alive()
    for op in (big, small):
        assert all(page_matches(pool, int(op.host_indices[i * pool.page_size]), k) for i, k in enumerate(op.hash_value))


@pytest.mark.parametrize("value, enabled", [("", True), ("1", True), ("on", True), ("0", False), ("No", False)])
def test_plugin_switch_values(monkeypatch, value, enabled):
    monkeypatch.setenv(plugin.ENV_SWITCH, value)
    assert plugin.plugin_enabled() is enabled


def test_an_operation_the_lanes_cannot_queue_runs_in_place_and_is_acked(make_backend, caplog):
    caplog.set_level(logging.INFO, logger="flatcake.plugin")
    plugin.forget_said()
    be, pool = make_backend()
    keys = ["k0", "k1"]
    be.batch_exists(keys)
    assert all(write_pages(be, pool, keys, range(2)))
    cc = ControllerDouble(be, pool.page_size)
    lanes = plugin.PrefetchLanes(cc, be, ssd_restores=1, ack=lambda op: ("done", op.request_id, None))
    odd = SimpleNamespace(request_id="odd", hash_value=keys, host_indices=slots_of(pool, [10, 11]))  # no is_terminated
    worker = threading.Thread(target=lanes.run)
    worker.start()
    cc.prefetch_buffer.put(odd)
    try:
        seen = [cc.prefetch_sync_queue.get(timeout=30) for _ in range(2)]
    finally:
        cc.storage_stop_event.set()
        worker.join(30)
    assert seen == [("progress", "odd", 2 * pool.page_size), ("done", "odd", None)]
    assert page_matches(pool, 10 * pool.page_size, "k0") and page_matches(pool, 11 * pool.page_size, "k1")
    assert "running it in place, FIFO" in caplog.text


def test_lanes_drive_a_flatcake_behind_sglangs_fault_injector_and_ack_its_failed_reads(make_backend, caplog, monkeypatch):
    """SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE / _DELAY wrap the backend in SGLang's
    ``HiCacheStorageFailureInjector``: the plugin still finds FlatCake behind it and runs its lanes;
    the reads go through the injector (failure probability 1 here: nothing delivered) and every
    operation is still acked, the thread alive."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

    # SGLang's PrefetchAck needs the controller's imports (tests/controller/); a tuple stands in
    monkeypatch.setattr(plugin, "_sglang_final_ack", lambda op: ("done", op.request_id, True))
    caplog.set_level(logging.INFO, logger="flatcake.plugin")
    plugin.forget_said()
    be, pool = make_backend()
    keys = ["k0", "k1", "k2"]
    be.batch_exists(keys)
    assert all(write_pages(be, pool, keys, range(3)))
    injector = HiCacheStorageFailureInjector(be, 0.0, 1.0)
    cc = ControllerDouble(injector, pool.page_size)
    assert plugin.flatcake_backend(cc) is be
    assert plugin.unwrap_fault_injector(be) is be
    assert plugin.flatcake_backend(SimpleNamespace(storage_backend=HiCacheStorageFailureInjector(object(), 0.0, 0.0))) is None

    worker = threading.Thread(target=plugin.prefetch_io_around, args=(lambda c: "sglang-loop", cc))
    worker.start()
    try:
        for rid, slots in (("first", range(10, 13)), ("second", range(20, 23))):
            cc.prefetch_buffer.put(op_for(rid, keys, pool, slots))
            progress, final = cc.prefetch_sync_queue.get(timeout=30), cc.prefetch_sync_queue.get(timeout=30)
            assert progress == ("progress", rid, 0)  # the injector failed the read
            assert final == ("done", rid, True)
        assert worker.is_alive()
    finally:
        cc.storage_stop_event.set()
        worker.join(30)
        plugin.forget_said()  # the tests after this one expect the once-per-process lines again
    assert not worker.is_alive()
    assert be.prefetch_lanes is not None and be.prefetch_lanes.stats()["dram"] + be.prefetch_lanes.stats()["ssd"] == 2
    assert "FC-MAS lanes drive" in caplog.text and "not FlatCake" not in caplog.text
