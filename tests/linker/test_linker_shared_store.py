"""Two doors, one house: on one rank the HiCache backend (``FlatCakeStorage``) and the direct
linker (``FlatCakeLinker``) use one store, so each door reads the pages the other wrote."""

from __future__ import annotations

import torch
from flatcake_testkit import page_matches, slots_of, write_pages
from linker_kit import LAYERS, PAGE, drain_offloads, fill, load_transfer, lookup_transfer, make_linker, \
    offload_transfer, page_hashes

from flatcake.common.layout import KvPageLayout


def test_both_doors_of_a_rank_share_one_store_and_read_each_others_pages(make_backend, ssd_dir):
    be, pool = make_backend(layout="page_first")  # host pool: 2 heads x 16, bf16, pages of 4: the device geometry
    lk, kv, alloc = make_linker(ssd_dir, "mha")  # same ssd.path, same page geometry
    try:
        assert lk.store is be.store and not lk.owns_store
        host = KvPageLayout.from_host_pool(pool)
        # HiCache door writes from the host pool; the linker restores into the device pool
        keys = page_hashes(list(range(3 * PAGE)))
        assert write_pages(be, pool, keys, [0, 1, 2]) == [True] * 3
        assert be.flush_writes(30)
        assert lk.lookup("r", lookup_transfer(keys)) == [1, 2, 3]
        load = load_transfer(alloc, keys)
        assert lk.load("r", load)
        index = lk.start_layer_wise_loading()
        assert lk.finish_layer_wise_loading(index)
        dst = (load[0].device_indices[::PAGE] // PAGE).tolist()
        for layer in range(LAYERS):
            for h, d in zip(host.layer_planes(layer), lk.device.layout.layer_planes(layer)):
                assert all(torch.equal(h[p], d[q]) for p, q in zip([0, 1, 2], dst))
        # the linker offloads from the device pool; the HiCache door reads into the host pool
        keys2 = page_hashes(list(range(500, 500 + 2 * PAGE)))
        slots = alloc.alloc(2 * PAGE)
        fill(kv, slots, 99)
        assert lk.offload(offload_transfer(slots, keys2), session_id="s")
        assert drain_offloads(lk, 1) == [True]
        assert be.batch_exists(keys2) == 2
        assert be.batch_get_v1(keys2, slots_of(pool, [10, 11])) == [True, True]
        src = (slots[::PAGE] // PAGE).tolist()
        for layer in range(LAYERS):
            for h, d in zip(host.layer_planes(layer), lk.device.layout.layer_planes(layer)):
                assert all(torch.equal(h[p], d[q]) for p, q in zip([10, 11], src))
    finally:
        lk.close()
    assert not be.store.closed  # the linker's close leaves the HiCache door's store open
    assert page_matches(pool, 0, keys[0])
