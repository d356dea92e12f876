"""Index and scopes: readers never lock, never see a scope freed under them (paper §3.1)."""

from flatcake.gva.address import MEDIUM_SSD, encode_gva
from flatcake.gva.index import GvaIndex, PageEntry
from flatcake.gva.placement import ReuseScope


def test_retired_scope_refuses_new_readers():
    idx = GvaIndex()
    with idx.lock:
        s = idx.open_scope_locked(MEDIUM_SSD, ReuseScope.ONE_SHOT)
        idx.publish_locked(["k"], [PageEntry(encode_gva(1, 0, 4096), s, 4096)])
    entry = idx.get("k")  # a reader looked the key up ...
    assert s.try_retire()  # ... reclaim wins the race ...
    assert entry.scope.try_acquire() is False  # ... so the reader gets a miss, never freed bytes
    with idx.lock:
        assert idx.unpublish_scope_locked(s) == 1
    assert idx.get("k") is None
