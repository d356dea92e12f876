"""The FC-MAS plugin inside SGLang 0.5.23's real cache controller, on the CPU.

The controller is SGLang's ``HybridCacheController`` (the class every 0.5.23 server uses), loaded
through SGLang's own ``load_plugins()`` (entry point discovery, ``HookRegistry``). It is built
with ``__new__`` and given only what its storage threads read (SGLang's constructor allocates
device pools); ``_start_storage_threads``, ``prefetch_io_aux_func``, ``_page_transfer``,
``_page_get_zero_copy``, the prefetch-sync thread and ``_stop_storage_threads`` are SGLang's code.
The backend is FlatCake built by SGLang's factory over a host-pool double.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import pytest
from flatcake_testkit import fill_page, page_matches, slots_of, two_requests_share, write_pages

from flatcake.adapter import plugin

SSD_PAGES = 64  # one big SSD restore
DRAM_REQUESTS = 4  # DRAM-hit requests of 2 pages each, arriving after it


class LayoutLeaseDouble:
    """The host pool group's ``layout_lease()`` (``pool_host/group.py`` 78-86): counts leases."""

    def __init__(self):
        self.leases = 0

    @contextlib.contextmanager
    def layout_lease(self):
        self.leases += 1
        yield


@pytest.fixture
def hooked(controller_module, monkeypatch):
    """SGLang's ``load_plugins()`` run for real (it finds FlatCake's entry point and applies the
    hook); the controller's original method is put back afterwards."""
    import sglang.srt.plugins as plugins
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(HiCacheController, "prefetch_io_aux_func", HiCacheController.prefetch_io_aux_func)
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.delenv(plugin.ENV_SWITCH, raising=False)
    HookRegistry.reset()
    found = plugins.load_plugins_by_group(plugins.GENERAL_PLUGINS_GROUP)
    assert found["flatcake"][0] is plugin.register
    plugins.load_plugins()
    assert HiCacheController.prefetch_io_aux_func.__wrapped__ is not None
    yield
    HookRegistry.reset()


def make_controller(controller_module, be, pool):
    """A ``HybridCacheController`` with what its storage threads read, threads started."""
    cls = controller_module.HybridCacheController
    cc = cls.__new__(cls)
    cc.storage_backend = be
    cc.page_size = pool.page_size
    cc.mem_pool_host = LayoutLeaseDouble()
    cc.storage_host_pool = pool
    cc.page_get_func = cc._page_get_zero_copy
    cc.storage_stop_event = threading.Event()
    cc.enable_storage = True
    cc.storage_config = be.storage_config  # backup_skip reads is_storage_writer
    cc.prefetch_hits_sync_groups, cc.prefetch_completion_sync_groups = [], []
    cc.pp_prefetch_command_group = cc.pp_prefetch_command_thread = None
    cc._start_storage_threads()
    return cc


def prefetch_op(controller_module, rid, keys, pool, pages):
    """The hybrid controller's ``PrefetchOperation`` after its hit query and host allocation."""
    handle = controller_module.CacheRequestHandle(rid, 0)
    op = controller_module.PrefetchOperation(handle, list(range(len(keys) * pool.page_size)))
    op.hash_value, op.host_indices = list(keys), slots_of(pool, pages)
    return op


def scenario(make_backend, controller_module, scheduler):
    """One big SSD restore (held at a gate) queued before DRAM-hit requests; returns
    ``(cc, be, pool, ops, gate)`` with every destination page overwritten with junk."""
    be, pool = make_backend(pages=160, extra={"dram.capacity_bytes": 1 << 20, "mas.scheduler": scheduler})
    ssd_keys = [f"ssd{i}" for i in range(SSD_PAGES)]
    be.batch_exists(ssd_keys)
    assert all(write_pages(be, pool, ssd_keys, range(SSD_PAGES)))
    assert be.store.flush_writes(30)  # on SSD: queued pages would go to the DRAM lane
    dram_keys = [[f"sys{r}-{i}" for i in range(2)] for r in range(DRAM_REQUESTS)]
    for r, keys in enumerate(dram_keys):
        two_requests_share(be.batch_exists, keys)
        assert all(write_pages(be, pool, keys, range(SSD_PAGES + 2 * r, SSD_PAGES + 2 * r + 2)))
    assert be.medium_summary(ssd_keys).ssd_pages == SSD_PAGES
    assert all(be.medium_summary(k).dram_pages == 2 for k in dram_keys)
    for slot in range(pool.size // pool.page_size):
        fill_page(pool, slot * pool.page_size, "junk")

    gate = threading.Event()
    real = be.store.cio.restore

    def gated_restore(*a, **k):
        assert gate.wait(30)
        return real(*a, **k)

    be.store.cio.restore = gated_restore
    cc = make_controller(controller_module, be, pool)
    ops = [prefetch_op(controller_module, "big", ssd_keys, pool, range(SSD_PAGES))]
    ops += [prefetch_op(controller_module, f"dram{r}", keys, pool, range(96 + 2 * r, 98 + 2 * r)) for r, keys in enumerate(dram_keys)]
    for op in ops:
        cc.prefetch_buffer.put(op)
    return cc, be, pool, ops, gate


def completions(cc, n, timeout):
    """rids of the next ``n`` completed-request acks SGLang's sync thread forwards (fewer on
    timeout); progress acks are checked against the operation as they pass."""
    done = []
    while len(done) < n:
        try:
            ack = cc.ack_prefetch_queue.get(timeout=timeout)
        except queue.Empty:
            break
        if ack.completed_req:
            done.append(ack.rid)
        else:
            assert ack.completed_tokens <= len(ack.operation.hash_value) * cc.page_size
    return done


def test_dram_hits_complete_while_a_big_ssd_restore_is_held(hooked, make_backend, controller_module, caplog):
    caplog.set_level("INFO", logger="flatcake.plugin")
    cc, be, pool, ops, gate = scenario(make_backend, controller_module, "mas")
    try:
        assert sorted(completions(cc, DRAM_REQUESTS, 30)) == [f"dram{r}" for r in range(DRAM_REQUESTS)]
        gate.set()
        assert completions(cc, 1, 30) == ["big"]
        for op in ops:  # every page the bytes written, in the slots SGLang asked for
            assert all(page_matches(pool, int(op.host_indices[i * pool.page_size]), k)
                       for i, k in enumerate(op.hash_value))
        assert cc.mem_pool_host.leases == len(ops)  # SGLang's _page_transfer ran for each
    finally:
        gate.set()
        cc._stop_storage_threads()
    assert not cc.prefetch_io_aux_thread.is_alive()
    assert "FC-MAS lanes drive" in caplog.text


def test_fcfs_config_keeps_sglangs_fifo(hooked, make_backend, controller_module):
    cc, be, pool, ops, gate = scenario(make_backend, controller_module, "fcfs")
    try:
        assert completions(cc, 1, 1.0) == []  # FIFO: the DRAM hits wait behind the held restore
        gate.set()
        assert completions(cc, 1 + DRAM_REQUESTS, 30) == ["big"] + [f"dram{r}" for r in range(DRAM_REQUESTS)]
    finally:
        gate.set()
        cc._stop_storage_threads()
    assert not cc.prefetch_io_aux_thread.is_alive()


def test_stop_drops_queued_operations_and_joins(hooked, make_backend, controller_module):
    """Stopping while restores wait: SGLang's stop returns with the thread gone; operations that
    never started get no ack (as SGLang leaves them in prefetch_buffer)."""
    be, pool = make_backend(pages=160, extra={"dram.capacity_bytes": 0, "cio.windows": 1})
    keys = [[f"s{r}-{i}" for i in range(4)] for r in range(3)]
    for r, ks in enumerate(keys):
        be.batch_exists(ks)
        assert all(write_pages(be, pool, ks, range(4 * r, 4 * r + 4)))
    assert be.store.flush_writes(30)  # on SSD: queued pages would go to the DRAM lane
    gate, real = threading.Event(), be.store.cio.restore
    be.store.cio.restore = lambda *a, **k: (gate.wait(30), real(*a, **k))[1]
    cc = make_controller(controller_module, be, pool)
    for r, ks in enumerate(keys):
        cc.prefetch_buffer.put(prefetch_op(controller_module, f"r{r}", ks, pool, range(64 + 4 * r, 68 + 4 * r)))
    assert completions(cc, 1, 0.5) == []
    cc.storage_stop_event.set()
    gate.set()
    cc._stop_storage_threads()
    assert not cc.prefetch_io_aux_thread.is_alive()
    acks = []  # forwarded by the sync thread, or left for it when it stopped first
    for q in (cc.ack_prefetch_queue, cc.prefetch_sync_queue):
        while not q.empty():
            acks.append(q.get())
    assert [a.rid for a in acks if a.completed_req] == ["r0"]  # the one running finished
    assert sum(a.completed_tokens or 0 for a in acks) == 4 * pool.page_size


def test_stop_terminates_a_long_restore_after_its_current_batch(hooked, make_backend, controller_module):
    """SGLang joins the prefetch-I/O thread for 10 s: a 300-page restore (three 128-page batches)
    caught by a stop ends after the batch in flight, its operation marked terminated."""
    be, pool = make_backend(pages=640, extra={"dram.capacity_bytes": 0, "ssd.max_files": 8})
    keys = [f"long{i}" for i in range(300)]
    be.batch_exists(keys)
    assert all(write_pages(be, pool, keys, range(300)))
    assert be.store.flush_writes(30)  # on SSD: queued pages would go to the DRAM lane
    gate, calls, real = threading.Event(), [], be.store.cio.restore

    def counted(*a, **k):
        calls.append(1)
        assert gate.wait(30)
        return real(*a, **k)

    be.store.cio.restore = counted
    cc = make_controller(controller_module, be, pool)
    op = prefetch_op(controller_module, "long", keys, pool, range(320, 620))
    cc.prefetch_buffer.put(op)
    for _ in range(3000):  # until the first batch's restore is in flight (30 s at most)
        if calls:
            break
        time.sleep(0.01)
    assert calls
    cc.storage_stop_event.set()  # what _stop_storage_threads does first
    gate.set()
    cc._stop_storage_threads()
    assert not cc.prefetch_io_aux_thread.is_alive()
    assert op.is_terminated() and len(calls) == 1  # the second and third batches never started
