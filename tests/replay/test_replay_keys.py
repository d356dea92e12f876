"""Chained page keys: SGLang's SHA-256 chain over pages, qualified by namespace."""

import hashlib

import pytest

from flatcake.replay.keys import PageKeyer
from flatcake.replay.traces import TraceRequest


def _req(ids, ns="ns", block=512, tokens=None):
    return TraceRequest(0.0, ns, ns, tuple(ids), block, tokens if tokens is not None else len(ids) * block, 1)


def test_512_token_block_is_8_pages_of_64_chained_sha256():
    keys = PageKeyer(64).keys(_req([7]))
    assert len(keys) == 8
    assert all(len(k) == 64 and int(k, 16) >= 0 for k in keys)
    assert keys[0] == hashlib.sha256(b"ns/7/0").hexdigest()
    assert keys[1] == hashlib.sha256(bytes.fromhex(keys[0]) + b"ns/7/1").hexdigest()
    assert len(set(keys)) == 8


def test_same_prefix_same_keys_then_diverge():
    k = PageKeyer(64)
    a, b = k.keys(_req([0, 1, 2])), k.keys(_req([0, 1, 3]))
    assert a[:16] == b[:16]
    assert not set(a[16:]) & set(b[16:])


def test_key_depends_on_everything_before_it():
    k = PageKeyer(64)
    # block id 5 after different prefixes gives different keys (chaining), as SGLang's hash does
    assert k.keys(_req([1, 5]))[8:] != k.keys(_req([2, 5]))[8:]


def test_different_sessions_give_different_keys():
    k = PageKeyer(64)
    assert not set(k.keys(_req([1, 2], "weka:a", 64))) & set(k.keys(_req([1, 2], "weka:b", 64)))


def test_partial_last_block_is_dropped():
    k = PageKeyer(64)
    assert len(k.keys(_req([0, 1, 2], tokens=1300))) == 16  # 2 whole blocks of 512
    assert len(k.keys(_req([0], tokens=100))) == 0


def test_page_larger_than_block_groups_blocks_and_drops_the_tail():
    k = PageKeyer(128)
    keys = k.keys(_req([1, 2, 3, 4, 5], block=64))
    assert len(keys) == 2  # (1,2) (3,4); block 5 alone is a partial page
    assert keys == k.keys(_req([1, 2, 3, 4], block=64))


def test_incompatible_sizes_raise():
    with pytest.raises(ValueError, match="divide"):
        PageKeyer(48).keys(_req([1], block=64))


def test_memo_gives_identical_results():
    k = PageKeyer(16)
    first = k.keys(_req([3, 4], block=64))
    assert k.keys(_req([3, 4], block=64)) == first
    assert PageKeyer(16).keys(_req([3, 4], block=64)) == first
