"""Engine-model parts: HBM LRU, host-pool free list, deterministic page bytes, model profile."""

import pytest
import torch

from flatcake.config import read_yaml
from flatcake.replay.cli import DEFAULT_MODEL_PROFILE
from flatcake.replay.engine import HbmCache, HostPages, ModelProfile, PageContent
from replay_fixtures import tiny_profile  # noqa: F401  (pytest fixture)


def test_hbm_longest_prefix_match_and_capacity():
    h = HbmCache(4)
    h.insert(["a", "b", "c"])
    assert h.match_prefix(["a", "b", "x", "c"]) == 2
    assert h.match_prefix(["b"]) == 1 and h.match_prefix(["x", "a"]) == 0
    h.insert(["d", "e"])
    assert len(h) == 4 and h.evicted_pages == 1


def test_hbm_evicts_a_sequence_tail_first_like_radix_leaves():
    h = HbmCache(4)
    h.insert(["a", "b", "c", "d"])
    h.insert(["x"])  # the least recent is the tail "d", not the prefix "a"
    assert "d" not in h and h.match_prefix(["a", "b", "c"]) == 3


def test_hbm_lru_order_across_requests():
    h = HbmCache(4)
    h.insert(["a1", "a2"])
    h.insert(["b1", "b2"])
    h.insert(["a1", "a2"])  # a becomes recent again
    h.insert(["c1", "c2"])  # evicts b (b2 then b1)
    assert h.match_prefix(["a1", "a2"]) == 2 and h.match_prefix(["b1"]) == 0
    assert h.match_prefix(["c1", "c2"]) == 2


def test_hbm_zero_capacity_holds_nothing():
    h = HbmCache(0)
    h.insert(["a"])
    assert h.match_prefix(["a"]) == 0


def test_host_pages_hand_out_page_aligned_token_slots(tiny_profile):
    pool = tiny_profile.make_host_pool(4)
    pages = HostPages(pool)
    idx = pages.alloc(3)
    assert idx.dtype == torch.int64 and idx.shape == (3 * 64,)
    starts = idx[::64].tolist()
    assert all(s % 64 == 0 for s in starts) and len(set(starts)) == 3
    assert torch.equal(idx[:64], torch.arange(starts[0], starts[0] + 64))
    assert pages.free_pages == 1
    with pytest.raises(MemoryError):
        pages.alloc(2)
    pages.free(idx)
    assert pages.free_pages == 4


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_page_content_fill_then_verify_and_detect_corruption(layout, attention):
    prof = ModelProfile(name="t", attention=attention, layers=3, kv_heads=2, head_dim=8, kv_cache_dim=12,
                        page_size=4, layout=layout)
    pool = prof.make_host_pool(3)
    c = PageContent(pool)
    assert c.page_bytes == prof.page_bytes
    c.fill(4, "k1")
    c.fill(8, "k2")
    assert c.verify(4, "k1") and c.verify(8, "k2")
    assert not c.verify(4, "k2")
    page = pool.get_data_page(8, flat=False).view(torch.uint8)
    page[(0,) * (page.dim() - 1) + (5,)] ^= 1  # flip one bit in place
    assert not c.verify(8, "k2")
    assert torch.equal(c.expected("k1"), c.expected("k1")) and not torch.equal(c.expected("k1"), c.expected("k3"))


def test_demo_model_profile_has_768_kib_pages():
    prof = ModelProfile.from_dict(read_yaml(DEFAULT_MODEL_PROFILE)["model"])
    assert prof.bytes_per_token == 2 * 24 * 2 * 64 * 2 == 12288
    assert prof.page_bytes == 786432


def test_prefill_model_formula(tiny_profile):
    p = tiny_profile
    assert p.prefill_s(0, 100) == 0.0
    flops = 2 * 1e6 * 64 + 4 * 2 * 2 * 32 * 64 * (128 + 32)
    assert p.prefill_s(64, 128) == pytest.approx(flops / (100e12 * 0.5))
    assert p.prefill_s(64, 1024) > p.prefill_s(64, 128)
    assert p.load_s(10 * 10**9) == pytest.approx(1.0)


def test_profile_rejects_unknown_keys_and_coerces_numbers():
    with pytest.raises(ValueError, match="unknown"):
        ModelProfile.from_dict({"name": "x", "attention": "mha", "layers": 1, "page_size": 1, "bogus": 1})
    with pytest.raises(ValueError, match="attention"):
        ModelProfile.from_dict({"name": "x", "attention": "gqa", "layers": 1, "page_size": 1})
    p = ModelProfile.from_dict({"name": "x", "attention": "mha", "layers": "2", "page_size": 64, "params": "4.9e8"})
    assert p.layers == 2 and p.params == 4.9e8


class _DictSystem:
    """A minimal in-memory L3 with the L3System call shapes; optionally corrupts one page on read."""

    name = "dict"

    def __init__(self, profile, corrupt_key=None):
        self.pool = profile.make_host_pool(256)
        self.P = profile.page_size
        self.store = {}
        self.corrupt_key = corrupt_key
        self.last_call_s = 0.0
        self.last_backlog_pages = 0  # no write backlog: every page it serves is "on SSD"
        self.calls = []

    def exists(self, keys, prefix_keys):
        self.calls.append(("exists", len(keys), len(prefix_keys)))
        n = 0
        for k in keys:
            if k not in self.store:
                break
            n += 1
        return n

    def get(self, keys, host_indices, prefix_keys):
        self.calls.append(("get", len(keys), len(prefix_keys)))
        for i, k in enumerate(keys):
            page = self.store[k].clone()
            if k == self.corrupt_key:
                page[0] ^= 1
            self.pool.set_from_flat_data_page(int(host_indices[i * self.P]), page.view(self.pool.dtype))
        return len(keys), 0, len(keys)

    def prepare_set(self, keys):
        pass

    def set(self, keys, host_indices, prefix_keys):
        self.calls.append(("set", len(keys), len(prefix_keys)))
        for i, k in enumerate(keys):
            self.store[k] = self.pool.get_data_page(int(host_indices[i * self.P])).view(torch.int64).clone()
        return True

    def after_call(self):
        pass


def test_engine_calls_l3_like_sglang_and_verifies_every_page(tiny_profile):
    from dataclasses import replace

    from flatcake.replay.engine import Engine, EngineConfig

    prof = replace(tiny_profile, page_size=16)
    keys = [f"k{i}" for i in range(300)]
    sysm = _DictSystem(prof, corrupt_key="k200")
    eng = Engine(sysm, prof, EngineConfig(hbm_pages=0, host_pool_pages=256, prefetch_threshold_tokens=0))
    first = eng.run(keys, 300 * 16 + 5)
    assert first.computed_pages == 300 and first.written_pages == 300
    # backup in 128-page calls with the keys before each call as prefix_keys
    assert sysm.calls == [("exists", 300, 0), ("set", 128, 0), ("set", 128, 128), ("set", 44, 256)]
    sysm.calls.clear()
    second = eng.run(keys, 300 * 16 + 5)
    assert sysm.calls == [("exists", 300, 0), ("get", 128, 0), ("get", 128, 128), ("get", 44, 256)]
    assert second.ssd_pages == 300 and second.computed_pages == 0
    assert second.verify_failures == 1  # the one corrupted page is caught
    assert second.prefill_s == prof.prefill_s(5, 300 * 16)  # only the partial tail is computed


class _FullSystem(_DictSystem):
    """Refuses every put after the first ``room`` pages, as a store whose DRAM is full does."""

    def __init__(self, profile, room):
        super().__init__(profile)
        self.room = room

    def set(self, keys, host_indices, prefix_keys):
        if len(self.store) + len(keys) > self.room:
            self.calls.append(("refused", len(keys), len(prefix_keys)))
            return False
        return super().set(keys, host_indices, prefix_keys)


def test_a_refused_put_counts_that_batch_and_the_rest_as_failed_write_pages(tiny_profile):
    from dataclasses import replace

    from flatcake.replay.engine import Engine, EngineConfig

    prof = replace(tiny_profile, page_size=16)
    sysm = _FullSystem(prof, room=200)
    eng = Engine(sysm, prof, EngineConfig(hbm_pages=0, host_pool_pages=256, prefetch_threshold_tokens=0))
    out = eng.run([f"k{i}" for i in range(300)], 300 * 16)
    # (a prompt of exactly 300 pages: SGLang asks L3 for 299, prompt - 1 tokens, and writes all 300)
    # 128 stored; the second batch of 128 would pass 200: refused, and the last 44 never tried
    assert sysm.calls == [("exists", 299, 0), ("set", 128, 0), ("refused", 128, 128)]
    assert out.written_pages == 128 and out.failed_write_pages == 172
    assert out.written_pages + out.failed_write_pages == out.computed_pages == 300
